"""CUPTI records -> rows, and raw rows -> a run's tables.

Two halves, both pure (no CUPTI import, no GPU), so that CPU tests drive them with objects that
mirror cupti-python's record attributes:

1. :class:`RecordConverter` turns one activity record (kernel, memcpy, memset, NVTX marker,
   overhead) into a plain row dict. The capture session calls it inside CUPTI's
   buffer-completed callback; one record that fails to convert is counted, never fatal.
2. :func:`assemble` turns the raw tables that a capture child wrote (kernels, memops, markers,
   overheads, launch callbacks, graph-node callbacks, counters) into a
   :class:`~decodescope.analysis.schema.Run`: NVTX start/end markers become the ``ranges`` table,
   kernels are joined to their launch API call (correlation id), graph kernels get the range path
   that was open when their graph node was created (DESIGN.md section 8), and steps are numbered.

Raw table kinds (one Arrow table each, columns as in ``RAW_COLUMNS``):
``kernel``, ``memop``, ``marker``, ``overhead``, ``graph``, ``launch``, ``gnode``, ``count``.

``graph`` rows come from CUPTI's graph-level records (``GRAPH_TRACE``: one record per graph
launch, start and end of the whole graph on the GPU, no kernel records): a capture that switches
to them after the replays that attribute kernels keeps measuring step time at almost no cost.
:func:`assemble` turns them into ``ranges`` rows on the GPU timeline (``thread`` = stream, name
``graph_launch``, domain ``cupti:graph_trace``) and counts them (``graph_trace_records``).
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import functools
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

import pyarrow as pa

from decodescope.analysis.schema import Run, RunMeta, from_pydict

# CUpti_ActivityKind values (stable C ABI); the session checks them against cupti.ActivityKind.
KIND_MEMCPY = 1
KIND_MEMSET = 2
KIND_KERNEL = 3
KIND_DRIVER = 4
KIND_RUNTIME = 5
KIND_CONCURRENT_KERNEL = 10
KIND_MARKER = 12
KIND_MARKER_DATA = 13
KIND_OVERHEAD = 17
KIND_GRAPH_TRACE = 51

# graph-level records (GRAPH_TRACE: one per graph launch, no kernels) become GPU-timeline ranges
GRAPH_RANGE_NAME = "graph_launch"
GRAPH_RANGE_DOMAIN = "cupti:graph_trace"

# CUpti_ActivityFlag bits of a marker record (`flags_` in cupti-python).
MARKER_INSTANT = 1
MARKER_START = 2
MARKER_END = 4

OBJECT_KIND_PROCESS = 1
OBJECT_KIND_THREAD = 2

_MEMCPY_KINDS = {1: "memcpy_htod", 2: "memcpy_dtoh", 8: "memcpy_dtod"}

OVERHEAD_KINDS = {
    0: "unknown",
    1: "driver_compiler",
    65536: "cupti_buffer_flush",
    131072: "cupti_instrumentation",
    196608: "cupti_resource",
    262144: "runtime_triggered_module_loading",
    327680: "lazy_function_loading",
    393216: "command_buffer_full",
    458752: "activity_buffer_request",
    524288: "uvm_activity_init",
}

RAW_COLUMNS: dict[str, dict[str, pa.DataType]] = {
    "kernel": {
        "device": pa.int32(),
        "context": pa.int64(),
        "stream": pa.int64(),
        "start_ns": pa.int64(),
        "end_ns": pa.int64(),
        "mangled": pa.string(),
        "correlation_id": pa.int64(),
        "graph_id": pa.int64(),
        "graph_node_id": pa.int64(),
        "grid_x": pa.int32(),
        "grid_y": pa.int32(),
        "grid_z": pa.int32(),
        "block_x": pa.int32(),
        "block_y": pa.int32(),
        "block_z": pa.int32(),
        "registers": pa.int32(),
        "shared_static": pa.int32(),
        "shared_dynamic": pa.int32(),
    },
    "memop": {
        "device": pa.int32(),
        "stream": pa.int64(),
        "kind": pa.string(),
        "start_ns": pa.int64(),
        "end_ns": pa.int64(),
        "bytes": pa.int64(),
        "correlation_id": pa.int64(),
        "graph_id": pa.int64(),
        "graph_node_id": pa.int64(),
    },
    "marker": {
        "id": pa.int64(),
        "flags": pa.int64(),
        "ts": pa.int64(),
        "name": pa.string(),
        "domain": pa.string(),
        "thread": pa.int64(),
        "object_kind": pa.int32(),
    },
    "overhead": {
        "kind": pa.string(),
        "start_ns": pa.int64(),
        "end_ns": pa.int64(),
        "detail": pa.string(),
    },
    "graph": {
        "device": pa.int32(),
        "stream": pa.int64(),
        "start_ns": pa.int64(),
        "end_ns": pa.int64(),
        "correlation_id": pa.int64(),
        "graph_id": pa.int64(),
    },
    # host-side callback rows (capture.py writes them)
    "launch": {
        "correlation_id": pa.int64(),
        "thread": pa.int64(),
        "ts": pa.int64(),
        "api": pa.string(),
    },
    "gnode": {
        "event": pa.string(),  # created | cloned
        "node_id": pa.int64(),
        "original_node_id": pa.int64(),
        "thread": pa.int64(),
        "ts": pa.int64(),
        "host_path": pa.string(),
    },
    "count": {"name": pa.string(), "value": pa.int64()},
}


def raw_table(kind: str, rows: Iterable[Mapping[str, Any]]) -> pa.Table:
    """An Arrow table of raw rows of ``kind`` (missing keys become nulls)."""
    cols = RAW_COLUMNS[kind]
    rows = list(rows)
    return pa.table(
        {c: pa.array([r.get(c) for r in rows], type=t) for c, t in cols.items()},
    )


def empty_raw(kind: str) -> pa.Table:
    return raw_table(kind, [])


# ---------------------------------------------------------------------------------------------
# 1. records -> rows


def _get(rec: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        v = getattr(rec, n, None)
        if v is not None:
            return v
    return default


def _int(v: Any) -> int | None:
    if v is None:
        return None
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def _str(v: Any) -> str | None:
    if v is None:
        return None
    if isinstance(v, bytes):
        v = v.decode("utf-8", "replace")
    return str(v)


def _graph_id(v: Any) -> int | None:
    """CUPTI reports 0 for 'not in a graph'; keep that as null."""
    v = _int(v)
    return v if v else None


class RecordConverter:
    """Converts activity records into raw rows; counts what it could not convert.

    ``convert(rec)`` returns ``(kind, row)`` or ``None`` for a record kind we do not keep. It
    raises on a malformed record; :meth:`convert_all` catches per record and counts failures in
    ``errors`` (per raw kind), so one bad record never loses the rest of a buffer.
    """

    def __init__(self, api_names: Mapping[tuple[int, int], str] | None = None) -> None:
        self.api_names = dict(api_names or {})  # (activity kind, cbid) -> API name
        self.errors: dict[str, int] = defaultdict(int)
        self.seen: dict[str, int] = defaultdict(int)
        self.last_error: str | None = None

    def convert(self, rec: Any) -> tuple[str, dict[str, Any]] | None:
        kind = int(rec.kind)
        if kind in (KIND_CONCURRENT_KERNEL, KIND_KERNEL):
            return "kernel", self._kernel(rec)
        if kind == KIND_MARKER:
            return "marker", self._marker(rec)
        if kind in (KIND_MEMCPY, KIND_MEMSET):
            return "memop", self._memop(rec, kind)
        if kind == KIND_OVERHEAD:
            return "overhead", self._overhead(rec)
        if kind in (KIND_RUNTIME, KIND_DRIVER):
            return "launch", self._api(rec, kind)
        if kind == KIND_GRAPH_TRACE:
            return "graph", self._graph(rec)
        return None  # MARKER_DATA and anything else: nothing we keep

    def convert_all(self, records: Iterable[Any]) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = defaultdict(list)
        it = iter(records)
        while True:
            try:
                rec = next(it)
            except StopIteration:
                break
            except Exception as e:  # a record the binding itself cannot build
                self.errors["iterate"] += 1
                self.last_error = f"iterate: {type(e).__name__}: {e}"
                continue
            try:
                got = self.convert(rec)
            except Exception as e:
                k = _kind_name(rec)
                self.errors[k] += 1
                self.last_error = f"{k}: {type(e).__name__}: {e}"
                continue
            if got is not None:
                out[got[0]].append(got[1])
                self.seen[got[0]] += 1
        return out

    @staticmethod
    def _kernel(rec: Any) -> dict[str, Any]:
        start, end = int(rec.start), int(rec.end)
        return {
            "device": _int(_get(rec, "device_id")),
            "context": _int(_get(rec, "context_id")),
            "stream": _int(_get(rec, "stream_id")),
            "start_ns": start,
            "end_ns": end,
            "mangled": _str(_get(rec, "name")),
            "correlation_id": _int(_get(rec, "correlation_id")),
            "graph_id": _graph_id(_get(rec, "graph_id")),
            "graph_node_id": _graph_id(_get(rec, "graph_node_id")),
            "grid_x": _int(_get(rec, "grid_x")),
            "grid_y": _int(_get(rec, "grid_y")),
            "grid_z": _int(_get(rec, "grid_z")),
            "block_x": _int(_get(rec, "block_x")),
            "block_y": _int(_get(rec, "block_y")),
            "block_z": _int(_get(rec, "block_z")),
            "registers": _int(_get(rec, "registers_per_thread")),
            "shared_static": _int(_get(rec, "static_shared_memory")),
            "shared_dynamic": _int(_get(rec, "dynamic_shared_memory")),
        }

    @staticmethod
    def _marker(rec: Any) -> dict[str, Any]:
        flags = _int(_get(rec, "flags_", "flags")) or 0
        okind = _int(_get(rec, "object_kind"))
        thread = None
        oid = _get(rec, "object_id")
        if oid is not None:
            pt = getattr(oid, "pt", None)
            if pt is not None:
                thread = _int(getattr(pt, "thread_id", None))
                if okind == OBJECT_KIND_PROCESS:
                    thread = None  # start/end ranges are process-wide: no thread
        return {
            "id": int(rec.id),
            "flags": flags,
            "ts": int(rec.timestamp),
            "name": _str(_get(rec, "name")) or None,
            "domain": _str(_get(rec, "domain")) or None,
            "thread": thread,
            "object_kind": okind,
        }

    @staticmethod
    def _memop(rec: Any, kind: int) -> dict[str, Any]:
        if kind == KIND_MEMSET:
            k = "memset"
        else:
            k = _MEMCPY_KINDS.get(_int(_get(rec, "copy_kind")) or 0, "memcpy_other")
        return {
            "device": _int(_get(rec, "device_id")),
            "stream": _int(_get(rec, "stream_id")),
            "kind": k,
            "start_ns": int(rec.start),
            "end_ns": int(rec.end),
            "bytes": _int(_get(rec, "bytes")),
            "correlation_id": _int(_get(rec, "correlation_id")),
            "graph_id": _graph_id(_get(rec, "graph_id")),
            "graph_node_id": _graph_id(_get(rec, "graph_node_id")),
        }

    def _api(self, rec: Any, kind: int) -> dict[str, Any]:
        """A runtime/driver API record (only the launch APIs are enabled): a launch row."""
        cbid = int(rec.cbid)
        return {
            "correlation_id": int(rec.correlation_id),
            "thread": _int(_get(rec, "thread_id")),
            "ts": int(rec.start),
            "api": self.api_names.get(
                (kind, cbid), f"{'runtime' if kind == KIND_RUNTIME else 'driver'}:{cbid}"
            ),
        }

    @staticmethod
    def _graph(rec: Any) -> dict[str, Any]:
        """A graph-level record (``ActivityGraphTrace2``): one graph launch, start to end."""
        return {
            "device": _int(_get(rec, "device_id")),
            "stream": _int(_get(rec, "stream_id")),
            "start_ns": int(rec.start),
            "end_ns": int(rec.end),
            "correlation_id": _int(_get(rec, "correlation_id")),
            "graph_id": _graph_id(_get(rec, "graph_id")),
        }

    @staticmethod
    def _overhead(rec: Any) -> dict[str, Any]:
        ok = _int(_get(rec, "overhead_kind")) or 0
        return {
            "kind": "cupti_overhead:" + OVERHEAD_KINDS.get(ok, str(ok)),
            "start_ns": _int(_get(rec, "start")),
            "end_ns": _int(_get(rec, "end")),
            "detail": None,
        }


def _kind_name(rec: Any) -> str:
    try:
        k = int(rec.kind)
    except Exception:
        return "unknown"
    return {
        KIND_CONCURRENT_KERNEL: "kernel",
        KIND_KERNEL: "kernel",
        KIND_MARKER: "marker",
        KIND_MEMCPY: "memop",
        KIND_MEMSET: "memop",
        KIND_OVERHEAD: "overhead",
        KIND_GRAPH_TRACE: "graph",
        KIND_RUNTIME: "launch",
        KIND_DRIVER: "launch",
    }.get(k, f"kind{k}")


# ---------------------------------------------------------------------------------------------
# kernel names


@functools.cache
def _cxa_demangle():
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6")
        f = lib.__cxa_demangle
    except (OSError, AttributeError):
        return None
    f.restype = ctypes.c_void_p
    f.argtypes = [
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.POINTER(ctypes.c_int),
    ]
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.free.argtypes = [ctypes.c_void_p]
    return f, libc.free


@functools.lru_cache(maxsize=65536)
def demangle(name: str) -> str:
    """The demangled C++ name (through libstdc++), or ``name`` itself when it is not mangled."""
    if not name or not name.startswith("_Z"):
        return name
    fns = _cxa_demangle()
    if fns is None:
        return name
    f, free = fns
    status = ctypes.c_int(0)
    p = f(name.encode(), None, None, ctypes.byref(status))
    if not p or status.value != 0:
        return name
    try:
        return ctypes.string_at(p).decode("utf-8", "replace")
    finally:
        free(p)


def _strip_brackets(s: str, open_: str, close: str) -> str:
    out, depth = [], 0
    for ch in s:
        if ch == open_:
            depth += 1
        elif ch == close:
            depth = max(0, depth - 1)
        elif depth == 0:
            out.append(ch)
    return "".join(out)


_RET = re.compile(r"^(?:void|int|unsigned int|float|bool)\s+")


@functools.lru_cache(maxsize=65536)
def short_name(mangled: str | None) -> str | None:
    """A short kernel name: demangled, without return type, template and parameter lists.

    ``void at::native::vectorized_elementwise_kernel<4, ...>(int, ...)`` ->
    ``at::native::vectorized_elementwise_kernel``. Names that are not C++ (Triton's, CuTe
    DSL's) stay as they are.
    """
    if mangled is None:
        return None
    d = demangle(mangled)
    if d == mangled and not mangled.startswith("_Z"):
        return mangled
    s = d.replace("(anonymous namespace)", "anon")
    s = _strip_brackets(s, "(", ")")
    s = _strip_brackets(s, "<", ">")
    s = _RET.sub("", s.strip())
    s = s.split()[-1] if s.split() else d
    return s or d


# ---------------------------------------------------------------------------------------------
# 2. raw tables -> a run


def _rows(t: pa.Table | None) -> list[dict[str, Any]]:
    return [] if t is None else t.to_pylist()


class _Intervals:
    """Ranges of one thread, for 'innermost range open at time t' queries."""

    def __init__(self, ranges: list[dict[str, Any]]) -> None:
        self.r = sorted(ranges, key=lambda x: (x["start_ns"], -(x["end_ns"] or 2**62)))
        self.starts = [x["start_ns"] for x in self.r]

    def innermost(self, ts: int) -> dict[str, Any] | None:
        # Ranges of one thread nest properly, so the enclosing range that started last is the
        # innermost one. Walking back from ts, a top-level range ends the search: nothing that
        # started before it can still be open after it began.
        i = bisect.bisect_right(self.starts, ts) - 1
        while i >= 0:
            x = self.r[i]
            if x["end_ns"] is None or x["end_ns"] >= ts:
                return x
            if x["depth"] == 0:
                return None
            i -= 1
        return None


def build_ranges(markers: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Pair NVTX start/end markers into range rows with path, depth and parent per thread.

    Returns the rows (``ranges`` table columns) and counts of what did not pair.
    """
    starts: dict[int, dict[str, Any]] = {}
    ends: dict[int, int] = {}
    counts = {"instant_markers": 0, "unmatched_end_markers": 0, "open_ranges": 0}
    for m in markers:
        f = m["flags"] or 0
        if f & MARKER_START:
            starts[m["id"]] = m
        elif f & MARKER_END:
            ends[m["id"]] = m["ts"]
        elif f & MARKER_INSTANT:
            counts["instant_markers"] += 1
    counts["unmatched_end_markers"] = sum(1 for i in ends if i not in starts)
    by_thread: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for mid, m in starts.items():
        end = ends.get(mid)
        if end is None:
            counts["open_ranges"] += 1
        by_thread[m["thread"]].append(
            {
                "thread": m["thread"],
                "timeline": "cpu",
                "start_ns": m["ts"],
                "end_ns": end,
                "domain": m["domain"],
                "name": m["name"] or "",
            }
        )
    out: list[dict[str, Any]] = []
    rid = 0
    for thread in sorted(by_thread, key=lambda t: (t is None, t or 0)):
        rs = sorted(by_thread[thread], key=lambda x: (x["start_ns"], -(x["end_ns"] or 2**62)))
        stack: list[dict[str, Any]] = []
        for r in rs:
            while (
                stack and stack[-1]["end_ns"] is not None and stack[-1]["end_ns"] <= r["start_ns"]
            ):
                stack.pop()
            parent = stack[-1] if stack else None
            r["range_id"] = rid
            rid += 1
            r["depth"] = len(stack)
            r["parent"] = parent["range_id"] if parent else None
            r["path"] = (parent["path"] + "/" if parent else "") + r["name"].replace("/", "|")
            stack.append(r)
            out.append(r)
    out.sort(key=lambda x: x["range_id"])
    return out, counts


def innermost_paths(
    ranges: list[dict[str, Any]], queries: Iterable[tuple[Any, int | None]]
) -> list[str | None]:
    """For each (thread, ts): the path of the innermost range open on that thread at ts."""
    idx: dict[Any, _Intervals] = {}
    by_thread: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for r in ranges:
        if r.get("timeline", "cpu") == "cpu":
            by_thread[r["thread"]].append(r)
    out: list[str | None] = []
    for thread, ts in queries:
        if ts is None or thread not in by_thread:
            out.append(None)
            continue
        iv = idx.get(thread)
        if iv is None:
            iv = idx[thread] = _Intervals(by_thread[thread])
        hit = iv.innermost(ts)
        out.append(hit["path"] if hit else None)
    return out


def graph_node_paths(gnodes: list[dict[str, Any]], ranges: list[dict[str, Any]]) -> dict[int, str]:
    """graph node id -> range path open when the node was created; clones inherit their origin.

    A created node takes the innermost NVTX range open on its thread at its timestamp (this
    covers any program's own NVTX ranges); where no marker range covers it, the host-side stack
    of ``decodescope.tracer.range`` recorded in the callback (``host_path``) is used.
    """
    created = [g for g in gnodes if g["event"] == "created" and g["node_id"] is not None]
    paths = innermost_paths(ranges, ((g["thread"], g["ts"]) for g in created))
    out: dict[int, str] = {}
    for g, p in zip(created, paths, strict=True):
        p = p or g.get("host_path") or None
        if p:
            out[g["node_id"]] = p
    clones = [g for g in gnodes if g["event"] == "cloned" and g["node_id"] is not None]
    # clones of clones: repeat until nothing changes (bounded by the chain length)
    for _ in range(8):
        changed = False
        for g in clones:
            src = g.get("original_node_id")
            if src in out and out.get(g["node_id"]) != out[src]:
                out[g["node_id"]] = out[src]
                changed = True
        if not changed:
            break
    return out


def graph_launch_ranges(graphs: list[dict[str, Any]], first_id: int = 0) -> list[dict[str, Any]]:
    """GRAPH_TRACE rows -> ``ranges`` rows on the GPU timeline (one per graph launch, in time
    order; ``thread`` is the stream, as for Kineto's GPU annotations)."""
    out: list[dict[str, Any]] = []
    for i, g in enumerate(sorted(graphs, key=lambda g: (g["start_ns"], g["end_ns"]))):
        out.append(
            {
                "range_id": first_id + i,
                "thread": g.get("stream"),
                "timeline": "gpu",
                "start_ns": g["start_ns"],
                "end_ns": g["end_ns"],
                "domain": GRAPH_RANGE_DOMAIN,
                "name": GRAPH_RANGE_NAME,
                "path": GRAPH_RANGE_NAME,
                "depth": 0,
                "parent": None,
            }
        )
    return out


def number_steps(
    kernels: list[dict[str, Any]],
    ranges: list[dict[str, Any]],
    step_name: str = "step",
) -> None:
    """Fill ``step`` in place: graph replays by graph-launch order, eager launches by the
    enclosing ``step`` range (i-th step range on the launch thread, in time order)."""
    graph_corr = sorted(
        {
            k["correlation_id"]
            for k in kernels
            if k.get("graph_node_id") is not None and k.get("correlation_id") is not None
        }
    )
    rank = {c: i for i, c in enumerate(graph_corr)}
    steps = [r for r in ranges if r["name"] == step_name and r.get("timeline", "cpu") == "cpu"]
    steps.sort(key=lambda r: r["start_ns"])
    by_thread: dict[Any, list[tuple[int, int, int]]] = defaultdict(list)
    for i, r in enumerate(steps):
        by_thread[r["thread"]].append(
            (r["start_ns"], r["end_ns"] if r["end_ns"] is not None else 2**62, i)
        )
    starts = {t: [s for s, _, _ in v] for t, v in by_thread.items()}
    for k in kernels:
        if k.get("graph_node_id") is not None and k.get("correlation_id") in rank:
            k["step"] = rank[k["correlation_id"]]
            continue
        t, ts = k.get("launch_thread"), k.get("launch_start_ns")
        if ts is None or t not in by_thread:
            continue
        j = bisect.bisect_right(starts[t], ts) - 1
        if j >= 0:
            s, e, i = by_thread[t][j]
            if s <= ts <= e:
                k["step"] = i


def assemble(
    raw: Mapping[str, pa.Table],
    meta: RunMeta,
    *,
    step_name: str = "step",
    rank: int = 0,
) -> Run:
    """Build a run from the raw tables of one capture (see the module docstring)."""
    run_id = meta.run_id
    markers = _rows(raw.get("marker"))
    ranges, range_counts = build_ranges(markers)
    graph_ranges = graph_launch_ranges(_rows(raw.get("graph")), first_id=len(ranges))
    if graph_ranges:
        range_counts["graph_trace_records"] = len(graph_ranges)

    launches: dict[int, dict[str, Any]] = {}
    for row in _rows(raw.get("launch")):
        c = row["correlation_id"]
        if c is not None and c not in launches:
            launches[c] = row
    node_paths = graph_node_paths(_rows(raw.get("gnode")), ranges)
    ranges = ranges + graph_ranges

    kernels = _rows(raw.get("kernel"))
    for k in kernels:
        k.pop("context", None)
        k["name"] = short_name(k["mangled"])
        la = launches.get(k["correlation_id"])
        if la is not None:
            k["launch_api"] = la["api"]
            k["launch_thread"] = la["thread"]
            k["launch_start_ns"] = la["ts"]
        gn = k.get("graph_node_id")
        if gn is not None and gn in node_paths:
            k["range_path"] = node_paths[gn]
    kernels.sort(key=lambda k: (k["start_ns"], k["end_ns"]))
    number_steps(kernels, ranges, step_name)

    memops = _rows(raw.get("memop"))
    graph_corr = {
        k["correlation_id"]: k.get("step") for k in kernels if k.get("graph_node_id") is not None
    }
    for m in memops:
        gn = m.get("graph_node_id")
        if gn is not None:
            m["range_path"] = node_paths.get(gn)
            m["step"] = graph_corr.get(m["correlation_id"])
    memops.sort(key=lambda m: m["start_ns"])

    overheads = _rows(raw.get("overhead"))
    counts: dict[str, int] = defaultdict(int)
    for row in _rows(raw.get("count")):
        counts[row["name"]] += row["value"] or 0
    for name, v in range_counts.items():
        counts[name] += v
    graph_kernels = sum(1 for k in kernels if k.get("graph_node_id") is not None)
    counts["graph_kernels_unmapped"] = sum(
        1 for k in kernels if k.get("graph_node_id") is not None and k.get("range_path") is None
    )
    counts["kernels_without_launch"] = sum(
        1 for k in kernels if k.get("launch_api") is None and k.get("graph_node_id") is None
    )
    for name in sorted(counts):
        overheads.append({"kind": name, "count": counts[name]})
    dropped = counts.get("dropped_records", 0)

    kern_cols = {c: [k.get(c) for k in kernels] for c in _KERNEL_COLS}
    kt = from_pydict(
        {**kern_cols, "run_id": [run_id] * len(kernels), "rank": [rank] * len(kernels)}, "kernels"
    )
    rcols = [
        "range_id",
        "thread",
        "timeline",
        "start_ns",
        "end_ns",
        "domain",
        "name",
        "path",
        "depth",
        "parent",
    ]
    rt = from_pydict(
        {
            **{c: [r[c] for r in ranges] for c in rcols},
            "run_id": [run_id] * len(ranges),
            "rank": [rank] * len(ranges),
        },
        "ranges",
    )
    mcols = list(RAW_COLUMNS["memop"]) + ["step", "range_path"]
    mt = from_pydict(
        {
            **{c: [m.get(c) for m in memops] for c in mcols},
            "run_id": [run_id] * len(memops),
            "rank": [rank] * len(memops),
        },
        "memops",
    )
    ocols = ["kind", "start_ns", "end_ns", "count", "detail"]
    ot = from_pydict(
        {
            **{c: [o.get(c) for o in overheads] for c in ocols},
            "run_id": [run_id] * len(overheads),
            "rank": [rank] * len(overheads),
        },
        "overheads",
    )
    graph_mode = meta.graph_mode
    if graph_mode is None:
        eager = len(kernels) - graph_kernels
        graph_mode = (
            "graph"
            if graph_kernels and not eager
            else "eager"
            if eager and not graph_kernels
            else "mixed"
            if kernels
            else "unknown"
        )
    meta = meta.replace(dropped_records=int(dropped), graph_mode=graph_mode)
    return Run(meta=meta, kernels=kt, ranges=rt, memops=mt, overheads=ot)


_KERNEL_COLS = [
    "device",
    "stream",
    "start_ns",
    "end_ns",
    "name",
    "mangled",
    "correlation_id",
    "graph_id",
    "graph_node_id",
    "grid_x",
    "grid_y",
    "grid_z",
    "block_x",
    "block_y",
    "block_z",
    "registers",
    "shared_static",
    "shared_dynamic",
    "launch_api",
    "launch_thread",
    "launch_start_ns",
    "step",
    "range_path",
]
