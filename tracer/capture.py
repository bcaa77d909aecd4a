"""The CUPTI capture: the session that runs inside the child, and the parent that runs the child.

Child side, :class:`Session` (the one CUPTI session a process may hold):

- activity tracing of CONCURRENT_KERNEL, MEMCPY, MEMSET, MARKER + MARKER_DATA (NVTX) and
  OVERHEAD; no RUNTIME / DRIVER activity (too costly, DESIGN.md section 3);
- callbacks enabled one by one for the launch APIs only (cudaLaunchKernel*, cudaGraphLaunch*,
  cuLaunchKernel*, cuLaunchKernelEx*, cuGraphLaunch*, cooperative launches): each records
  (correlation id, OS thread id, CUPTI timestamp, API name) on the host at API entry;
- RESOURCE callbacks GRAPHNODE_CREATED / GRAPHNODE_CLONED: node id, thread, timestamp and the
  host-side range stack of :mod:`decodescope.tracer.ranges` (the node's range path is resolved
  later from the NVTX ranges open on that thread, which covers any program's own ranges);
- buffer-completed callback that converts record by record (failures counted, never fatal) and
  writes what it has as Arrow IPC chunk files into the child's folder, so a crash or a hang still
  leaves everything flushed so far; forced flush and dropped-record count at the end.

Parent side, :func:`run_capture`: starts the child (``python -m decodescope.tracer.child``) with
``NVTX_INJECTION64_PATH`` naming the libcupti that cupti-python loads, waits with a timeout,
reads the chunk files, assembles the run (:func:`decodescope.tracer.cupti_records.assemble`) and
writes it. A crash, hang or CUDA error ends with one clear line and a run marked partial.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc

from decodescope.analysis.schema import Run, RunMeta
from decodescope.tracer import cupti_records as cr
from decodescope.tracer.errors import TraceError
from decodescope.tracer.ranges import current_path

SPEC_ENV = "DECODESCOPE_CAPTURE_SPEC"  # path of the child's spec JSON
# set in every capture child, always (before torch or NCCL start): no NVLink multicast (NVLS)
NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
OWNER_ENV = "DECODESCOPE_CAPTURE_OWNER"  # pid of the process that holds the session

# launch APIs whose callbacks we enable (matched by prefix against cupti's cbid enum names)
RUNTIME_LAUNCH_PREFIXES = (
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cudaLaunchCooperativeKernel",
    "cudaGraphLaunch",
    "cudaLaunch_",
)
DRIVER_LAUNCH_PREFIXES = (
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cuLaunchCooperativeKernel",
    "cuGraphLaunch",
    "cuLaunchGrid",
)
ACTIVITY_KINDS = ("CONCURRENT_KERNEL", "MEMCPY", "MEMSET", "MARKER", "MARKER_DATA", "OVERHEAD")
LAUNCH_RECORDS = ("callback", "activity", "none")
# activity buffers: large enough that a short capture completes none while the workload runs
DEFAULT_BUFFER_BYTES = 64 << 20


def _api_short(name: str) -> str:
    """``cudaLaunchKernel_v7000`` -> ``cudaLaunchKernel``; ``cuLaunchKernel_ptsz`` stays."""
    head, _, tail = name.rpartition("_v")
    return head if head and tail.isdigit() else name


def launch_cbids(enum_members: dict[str, int], prefixes: Sequence[str]) -> dict[int, str]:
    """cbid -> short API name for the launch APIs among a cupti cbid enum's members."""
    out: dict[int, str] = {}
    for name, value in enum_members.items():
        if "HostFunc" in name or "MultiDevice" in name:
            continue
        if any(name == p or name.startswith(p) for p in prefixes):
            out[int(value)] = _api_short(name)
    return out


def _members(mod: Any, *names: str) -> dict[str, int]:
    for n in names:
        e = getattr(mod, n, None)
        if e is not None and hasattr(e, "__members__"):
            return {k: int(v) for k, v in e.__members__.items()}
    return {}


def _ptr(obj: Any) -> int:
    if isinstance(obj, int):
        return obj
    p = getattr(obj, "ptr", None)
    return int(p) if p is not None else int(obj)


def libcupti_path() -> str | None:
    """The libcupti that cupti-python loads (what NVTX_INJECTION64_PATH must name)."""
    try:
        from cuda import pathfinder

        return str(pathfinder.load_nvidia_dynamic_lib("cupti").abs_path)
    except Exception:
        return None


# ---------------------------------------------------------------------------------------------
# child side


class Session:
    """The process's CUPTI session. ``start()``, run the work, ``stop()``; rows land in ``out``.

    Cost model (what runs while the workload runs):

    - launch callbacks (``launch_records="callback"``): one Python call per API entry and exit
      of each launch API; the entry appends one tuple ``(correlation id, thread, timestamp,
      domain, cbid)`` to a list, nothing else (names are resolved when the chunk is written);
    - buffer-completed callback (CUPTI's own thread): by default it keeps the record objects
      cupti-python built (copies of the records, checked per buffer by
      :func:`_records_are_views`) and converts only NVTX markers at once (their name strings);
      the rest becomes rows in :meth:`write_chunk` / :meth:`stop`, outside the workload's
      steps. Buffers are ``buffer_bytes`` (64 MB) so that a short capture completes none while
      it runs;
    - nothing flushes unless asked: :meth:`discard` and :meth:`stop` flush, and a
      ``flush_period_ms`` (program mode) makes CUPTI deliver buffers periodically.

    ``kinds``, ``launch_records`` ("callback" | "activity" | "none") and ``graph_nodes`` select
    the parts, so that the overhead benchmark can enable them one at a time. ``hw_trace`` asks
    CUPTI for kernel timestamps from the GPU's Hardware Event System
    (``cuptiActivityEnableHWTrace``) instead of its instrumented ones; a CUPTI or GPU that
    refuses it leaves a note and the count ``hw_trace_refused``, and the session records as
    without it. Off by default: on the H200 the per-kernel record is what the standard path's
    graph replays pay (+3.5% at 58 kernels a step, ``CONCURRENT_KERNEL`` alone the same,
    notes/capture.md); whether HES is cheaper there is the benchmark's ``hw_trace`` variant. The default launch
    records are CUPTI's native API records for the launch functions only ("activity"): on the
    H200 (2026-11-30, benchmarks/bench_capture_overhead.py, toy workload) they cost +49% per
    eager step against +431% for Python callbacks, whose trampoline costs ~27 us a launch.
    """

    def __init__(
        self,
        out: str | os.PathLike[str],
        *,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        flush_period_ms: int = 0,
        launch_records: str = "activity",
        kinds: Sequence[str] = ACTIVITY_KINDS,
        graph_nodes: bool = True,
        defer_conversion: bool = True,
        hw_trace: bool = False,
        cupti_module: Any = None,
    ) -> None:
        if launch_records not in LAUNCH_RECORDS:
            raise ValueError(
                f"launch_records must be one of {', '.join(LAUNCH_RECORDS)}, not {launch_records!r}"
            )
        self.launch_records = launch_records
        self.kinds = tuple(kinds)
        self.graph_nodes = graph_nodes
        self.defer_conversion = defer_conversion
        self.hw_trace = bool(hw_trace)
        self._hw_trace_on = False
        self._paused = False
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.buffer_bytes = int(buffer_bytes)
        self.flush_period_ms = flush_period_ms
        self._cupti = cupti_module
        self.conv = cr.RecordConverter()
        self._lock = threading.Lock()
        self._rows: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self._pending: list[Any] = []  # record lists delivered by CUPTI, not yet converted
        self._launch: list[tuple[Any, ...]] = []
        self._launch_append = self._launch.append
        self._gnode: list[tuple[str, int | None, int | None, int, int, str | None]] = []
        self.counts: dict[str, int] = defaultdict(int)
        self._chunk = 0
        self._subscriber: int | None = None
        self._enabled: list[int] = []
        self._api_enabled: list[tuple[Any, int]] = []  # (activity_enable_*_api, cbid)
        self._api: dict[int, dict[int, str]] = {}
        self._dom_rt = self._dom_drv = self._dom_res = -1
        self._enter = -1
        self.running = False
        self.errors: list[str] = []

    # -- setup ---------------------------------------------------------------------------------
    def start(self) -> Session:
        if self._cupti is None:
            from cupti import cupti

            self._cupti = cupti
        c = self._cupti
        self._ts = c.get_timestamp
        self._tid = threading.get_native_id
        with contextlib.suppress(Exception):
            c.set_thread_id_type(c.ActivityThreadIdType.SYSTEM)
        # host rows must use the thread ids CUPTI puts in marker records
        with contextlib.suppress(Exception):
            if int(c.get_thread_id_type()) != int(c.ActivityThreadIdType.SYSTEM):
                self._tid = threading.get_ident  # pthread_self(), CUPTI's default
                self._note("thread id type is not SYSTEM: using pthread_self ids")
        # the record kinds cupti_records relies on
        for name, want in (
            ("CONCURRENT_KERNEL", cr.KIND_CONCURRENT_KERNEL),
            ("MARKER", cr.KIND_MARKER),
            ("MEMCPY", cr.KIND_MEMCPY),
            ("MEMSET", cr.KIND_MEMSET),
            ("OVERHEAD", cr.KIND_OVERHEAD),
        ):
            got = int(getattr(c.ActivityKind, name))
            if got != want:
                self._note(f"ActivityKind.{name} is {got}, expected {want}")
        D = c.CallbackDomain
        self._dom_rt, self._dom_drv, self._dom_res = (
            int(D.RUNTIME_API),
            int(D.DRIVER_API),
            int(D.RESOURCE),
        )
        self._enter = int(c.ApiCallbackSite.API_ENTER)
        self._cb_created = int(c.CallbackIdResource.GRAPHNODE_CREATED)
        self._cb_cloned = int(c.CallbackIdResource.GRAPHNODE_CLONED)
        self._api = {
            self._dom_rt: launch_cbids(
                _members(c, "RuntimeApiTraceCbid", "runtime_api_trace_cbid"),
                RUNTIME_LAUNCH_PREFIXES,
            ),
            self._dom_drv: launch_cbids(
                _members(c, "DriverApiTraceCbid", "driver_api_trace_cbid"), DRIVER_LAUNCH_PREFIXES
            ),
        }
        if not any(self._api.values()):
            self._note("no launch API cbids found in cupti-python's cbid enums")
        self.conv.api_names = {
            **{(cr.KIND_RUNTIME, cbid): n for cbid, n in self._api[self._dom_rt].items()},
            **{(cr.KIND_DRIVER, cbid): n for cbid, n in self._api[self._dom_drv].items()},
        }
        c.activity_register_callbacks(self._requested, self._completed)
        if self.launch_records == "activity":
            # native API records for the launch APIs only (no Python on the launch path)
            for fn, dom in (
                (c.activity_enable_runtime_api, self._dom_rt),
                (c.activity_enable_driver_api, self._dom_drv),
            ):
                for cbid, name in self._api[dom].items():
                    try:
                        fn(cbid, 1)
                        self._api_enabled.append((fn, cbid))
                    except Exception as e:
                        self.counts["enable_api_record_failed"] += 1
                        self._note(f"activity_enable_*_api({name}): {e}")
        if self.hw_trace:  # before the kinds: it selects how kernel records get timestamps
            try:
                c.activity_enable_hw_trace(1)
                self._hw_trace_on = True
                self.counts["hw_trace"] = 1
            except Exception as e:
                self.counts["hw_trace_refused"] += 1
                self._note(f"activity_enable_hw_trace: {e}")
        for name in self.kinds:
            self.enable_kind(name)
        if self.flush_period_ms:
            try:
                c.activity_flush_period(int(self.flush_period_ms))
            except Exception as e:
                self._note(f"activity_flush_period: {e}")

        wanted: list[tuple[int, int, str]] = []
        if self.launch_records == "callback":
            wanted += [(d, cbid, n) for d, apis in self._api.items() for cbid, n in apis.items()]
        if self.graph_nodes:
            wanted += [
                (self._dom_res, self._cb_created, "GRAPHNODE_CREATED"),
                (self._dom_res, self._cb_cloned, "GRAPHNODE_CLONED"),
            ]
        if wanted:
            self._subscriber = c.subscribe(self._callback, None)
            for dom, cbid, name in wanted:
                try:
                    c.enable_callback(1, self._subscriber, dom, cbid)
                except Exception as e:
                    self.counts["enable_callback_failed"] += 1
                    self._note(f"enable_callback({name}): {e}")
        self.running = True
        return self

    def enable_kind(self, name: str) -> bool:
        """Enable one activity kind by its ``cupti.ActivityKind`` name, also while running.
        False, with a note, if CUPTI refuses, and for ``GRAPH_TRACE`` once the session runs:
        switched on after graphs were launched with kernel records, the next ``cuGraphLaunch``
        crashed (SIGSEGV, H200, CUDA 13 / cupti-python 13.0.1, 2026-11-30, tests/
        test_capture_gpu.py). Ask for it at start (``kinds=(..., "GRAPH_TRACE")``): graph
        launches then give one record each and no kernel records, eager kernels keep theirs."""
        c = self._cupti
        if name == "GRAPH_TRACE" and self.running:
            self.counts[f"enable_failed:{name}"] += 1
            self._note("GRAPH_TRACE can only be enabled when the session starts (kinds=...)")
            return False
        try:
            kind = getattr(c.ActivityKind, name)
            c.activity_enable(kind)
        except Exception as e:
            self.counts[f"enable_failed:{name}"] += 1
            self._note(f"activity_enable({name}): {e}")
            return False
        self._enabled.append(kind)
        return True

    def pause(self) -> None:
        """Stop recording without stopping the session: every enabled activity kind (but
        ``GRAPH_TRACE``, which cannot come back) and every per-API launch record is disabled;
        subscribers stay. For the overhead benchmark's interleaved eager blocks (the same
        process, recording and not, block by block). Graphs may be replayed while paused: the
        benchmark's ``--graph-ab`` did so on the H200 (s31, a494371: no crash, no kernel record
        in a paused block; unlike GRAPH_TRACE, no kind is switched on mid-session, only off and
        back on). What remains is CUPTI loaded and subscribed, recording nothing."""
        if not self.running or self._paused:
            return
        self._switch(False)
        self._paused = True

    def resume(self) -> None:
        """Undo :meth:`pause`: the same kinds and launch records enabled again."""
        if not self._paused:
            return
        self._switch(True)
        self._paused = False

    def _switch(self, on: bool) -> None:
        """Every enabled kind but ``GRAPH_TRACE``, and every launch record, on or off."""
        c = self._cupti
        graph_trace = getattr(getattr(c, "ActivityKind", None), "GRAPH_TRACE", None)
        what = "resume" if on else "pause"
        for kind in self._enabled:
            if graph_trace is not None and int(kind) == int(graph_trace):
                continue
            try:
                (c.activity_enable if on else c.activity_disable)(kind)
            except Exception as e:
                self._note(f"{what}: activity_{'enable' if on else 'disable'}({kind}): {e}")
        for fn, cbid in self._api_enabled:
            try:
                fn(cbid, 1 if on else 0)
            except Exception as e:
                self._note(f"{what}: launch record {cbid}: {e}")

    def _note(self, msg: str) -> None:
        if len(self.errors) < 50:
            self.errors.append(msg)

    # -- CUPTI callbacks (never raise) ---------------------------------------------------------
    def _requested(self, *args: Any) -> tuple[int, int]:
        return self.buffer_bytes, 0

    def _completed(self, *args: Any) -> None:
        """CUPTI's buffer-completed callback (its own thread): keep the records, nothing more."""
        try:
            t0 = time.perf_counter_ns()
            activities = args[-1] if args else None
            if activities is None:
                activities = []
            if (
                self.defer_conversion
                and isinstance(activities, list)
                and not _records_are_views(activities)
            ):
                keep, now = _split_for_deferral(activities)
                with self._lock:
                    if keep:
                        self._pending.append(keep)
            else:  # records that point into CUPTI's buffer die with it: convert now
                now = activities
            if now:
                rows = self.conv.convert_all(now)
                with self._lock:
                    for k, v in rows.items():
                        self._rows[k].extend(v)
            self._read_dropped()
            with self._lock:
                self.counts["buffers_completed"] += 1
                self.counts["records_delivered"] += len(activities)
                self.counts["buffer_callback_ns"] += time.perf_counter_ns() - t0
            if self.running and self.flush_period_ms:
                self.write_chunk()
        except Exception as e:
            self.counts["buffer_callback_errors"] += 1
            self._note(f"buffer completed: {type(e).__name__}: {e}")

    def _callback(self, userdata: Any, domain: Any, cbid: Any, cbdata: Any) -> None:
        # the launch path: one attribute read, one tuple append; nothing else
        try:
            if domain == self._dom_res:
                self._on_resource(int(cbid), cbdata)
                return
            try:
                site = cbdata.callback_site
            except AttributeError:  # a binding that passes the pointer
                cbdata = self._cupti.CallbackData.from_ptr(_ptr(cbdata))
                site = cbdata.callback_site
            if site == self._enter:
                self._launch_append((cbdata.correlation_id, self._tid(), self._ts(), domain, cbid))
        except Exception as e:
            self.counts["callback_errors"] += 1
            self._note(f"callback: {type(e).__name__}: {e}")

    def _on_resource(self, cbid: int, cbdata: Any) -> None:
        c = self._cupti
        if cbid not in (self._cb_created, self._cb_cloned):
            return
        res = (
            cbdata
            if hasattr(cbdata, "resource_descriptor")
            else c.ResourceData.from_ptr(_ptr(cbdata))
        )
        g = c.GraphData.from_ptr(int(res.resource_descriptor))
        node = c.get_graph_node_id(int(g.node))
        if cbid == self._cb_created:
            self._gnode.append(
                ("created", node, None, self._tid(), self._ts(), current_path() or None)
            )
        else:
            orig = c.get_graph_node_id(int(g.original_node))
            self._gnode.append(("cloned", node, orig, self._tid(), self._ts(), None))

    def _read_dropped(self) -> None:
        import ctypes

        try:
            n = ctypes.c_size_t(0)
            self._cupti.activity_get_num_dropped_records(0, 0, ctypes.addressof(n))
            if n.value:
                self.counts["dropped_records"] += int(n.value)
        except Exception as e:
            self.counts["drop_count_unreadable"] = 1
            self._note(f"activity_get_num_dropped_records: {e}")

    # -- output --------------------------------------------------------------------------------
    def _drain(self) -> None:
        """Convert the record lists kept by the buffer callback into rows (caller's thread)."""
        with self._lock:
            pending, self._pending = self._pending, []
        for acts in pending:
            rows = self.conv.convert_all(acts)
            with self._lock:
                for k, v in rows.items():
                    self._rows[k].extend(v)

    def _api_name(self, domain: Any, cbid: Any) -> str:
        try:
            return self._api[int(domain)].get(int(cbid)) or str(cbid)
        except (KeyError, TypeError, ValueError):
            return str(cbid)

    def _take(self) -> dict[str, pa.Table]:
        self._drain()
        with self._lock:
            rows, self._rows = self._rows, defaultdict(list)
            n = len(self._launch)  # same list object: the callback keeps its bound append,
            launch = self._launch[:n]  # and what a thread appends meanwhile stays for later
            del self._launch[:n]
            gnode, self._gnode = self._gnode, []
            counts = dict(self.counts)
            self.counts = defaultdict(int)
        for k, v in self.conv.errors.items():
            counts[f"conversion_errors:{k}"] = counts.get(f"conversion_errors:{k}", 0) + v
        self.conv.errors.clear()
        if launch:
            names: dict[tuple[Any, Any], str] = {}
            for corr, tid, ts, dom, cbid in launch:
                key = (dom, cbid)
                name = names.get(key)
                if name is None:
                    name = names[key] = self._api_name(dom, cbid)
                rows["launch"].append(
                    {"correlation_id": int(corr), "thread": tid, "ts": int(ts), "api": name}
                )
        out = {k: cr.raw_table(k, v) for k, v in rows.items() if v}
        if gnode:
            keys = ("event", "node_id", "original_node_id", "thread", "ts", "host_path")
            out["gnode"] = cr.raw_table("gnode", (dict(zip(keys, g, strict=True)) for g in gnode))
        if counts:
            out["count"] = cr.raw_table(
                "count", ({"name": k, "value": v} for k, v in counts.items())
            )
        return out

    def write_chunk(self) -> int:
        """Write everything collected since the last chunk; returns the number of rows."""
        tables = self._take()
        n = 0
        with self._lock:
            self._chunk += 1
            chunk = self._chunk
        for kind, t in tables.items():
            n += t.num_rows
            write_ipc(t, self.out / f"chunk-{chunk:05d}-{kind}.arrow")
        return n

    def discard(self, keep: Sequence[str] = ("marker",)) -> None:
        """Flush and drop what was recorded so far (warm-up), keeping graph-node rows, counts
        and the raw kinds in ``keep`` (NVTX markers, so capture-time ranges stay resolvable).
        Call it outside timed regions: the flush converts what CUPTI delivers."""
        self.flush()
        self._drain()
        with self._lock:
            for k in list(self._rows):
                if k not in keep:
                    self._rows[k] = []
            del self._launch[:]

    def flush(self) -> None:
        try:
            self._cupti.activity_flush_all(
                int(getattr(self._cupti.ActivityFlag, "FLUSH_FORCED", 1))
            )
        except Exception as e:
            self._note(f"activity_flush_all: {e}")

    def stop(self) -> None:
        """Forced flush, unsubscribe, write the last chunk. Safe to call twice."""
        if not self.running:
            return
        self.flush()
        self._read_dropped()
        self.running = False
        c = self._cupti
        if self._subscriber is not None:
            with contextlib.suppress(Exception):
                c.unsubscribe(self._subscriber)
            self._subscriber = None
        for kind in self._enabled:
            with contextlib.suppress(Exception):
                c.activity_disable(kind)
        self._enabled = []
        for fn, cbid in self._api_enabled:  # per-API records outlive the kinds otherwise
            with contextlib.suppress(Exception):
                fn(cbid, 0)
        self._api_enabled = []
        if self._hw_trace_on:
            with contextlib.suppress(Exception):
                c.activity_enable_hw_trace(0)
            self._hw_trace_on = False
        if self.flush_period_ms:
            with contextlib.suppress(Exception):
                c.activity_flush_period(0)
        if self.errors:
            self.counts["session_notes"] += len(self.errors)
            (self.out / "session-notes.txt").write_text("\n".join(self.errors) + "\n")
        self.write_chunk()


def _split_for_deferral(acts: list[Any]) -> tuple[list[Any], list[Any]]:
    """(records to keep for later, records to convert now). Kernel names are CUPTI's for the
    module's lifetime (Kineto reads them after the callback too); a marker's name string is not
    documented to outlive its buffer, so markers (a few per range) are converted at once.
    MARKER_DATA records are dropped (nothing reads them)."""
    keep: list[Any] = []
    now: list[Any] = []
    for a in acts:
        try:
            k = a.kind
        except Exception:
            now.append(a)  # let the converter count it
            continue
        if k == cr.KIND_MARKER:
            now.append(a)
        elif k != cr.KIND_MARKER_DATA:
            keep.append(a)
    return keep, now


def _records_are_views(acts: list[Any]) -> bool:
    """Whether cupti-python's record objects point into CUPTI's buffer (freed when the callback
    returns) rather than owning copies. Views of one buffer sit back to back (address steps of
    one record size); copies are separate allocations. One record cannot tell: say views."""
    try:
        if len(acts) < 2:
            return True
        ptrs = [a.ptr for a in acts[:6]]
    except AttributeError:
        return False  # plain Python objects (tests): nothing points anywhere
    except Exception:
        return True
    steps = [b - a for a, b in zip(ptrs, ptrs[1:], strict=False)]
    return all(0 < s <= 1024 for s in steps)


def write_ipc(table: pa.Table, path: Path) -> None:
    tmp = path.with_name("." + path.name + ".tmp")
    with pa.OSFile(str(tmp), "wb") as f, ipc.new_file(f, table.schema) as w:
        w.write_table(table)
    os.replace(tmp, path)


def read_chunks(folder: str | os.PathLike[str]) -> dict[str, pa.Table]:
    """Concatenate a child's chunk files per raw kind (unreadable chunks are counted)."""
    parts: dict[str, list[pa.Table]] = defaultdict(list)
    bad = 0
    for p in sorted(Path(folder).glob("chunk-*.arrow")):
        kind = p.stem.split("-", 2)[2]
        if kind not in cr.RAW_COLUMNS:
            continue
        try:
            with pa.memory_map(str(p)) as src:
                parts[kind].append(ipc.open_file(src).read_all())
        except (pa.ArrowException, OSError):
            bad += 1
    out = {k: pa.concat_tables(v, promote_options="default") for k, v in parts.items()}
    if bad:
        extra = cr.raw_table("count", [{"name": "unreadable_chunks", "value": bad}])
        out["count"] = pa.concat_tables([out["count"], extra]) if "count" in out else extra
    return out


# ---------------------------------------------------------------------------------------------
# parent side


@dataclass
class CaptureResult:
    run: Run
    out: Path | None
    ok: bool
    message: str | None  # one line when the child failed (the run is partial then)
    returncode: int | None
    child_dir: Path | None = None
    stderr_tail: list[str] = field(default_factory=list)


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    lib = libcupti_path()
    if lib and "NVTX_INJECTION64_PATH" not in env:
        env["NVTX_INJECTION64_PATH"] = lib
    elif not lib and "NVTX_INJECTION64_PATH" not in env:
        # never silently: without it no NVTX range reaches CUPTI and nothing is attributed
        print(
            "decodescope: libcupti not found through cuda.pathfinder; NVTX ranges will not be "
            "captured (set NVTX_INJECTION64_PATH to the libcupti cupti-python loads)",
            file=sys.stderr,
        )
    env.pop(OWNER_ENV, None)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(NO_MULTICAST_ENV)  # always: NVLink multicast can take the host's GPUs down
    if extra:
        env.update(extra)
    return env


_SITECUSTOMIZE = """\
# written by decodescope capture: start the CUPTI session before the program runs
import os as _os
if _os.environ.get("{spec}") and not _os.environ.get("{owner}"):
    try:
        from decodescope.tracer.child import bootstrap as _b
        _b()
    except Exception as _e:  # never stop the program from starting
        import sys as _sys
        print("decodescope: capture bootstrap failed: %s" % (_e,), file=_sys.stderr)
# chain to any other sitecustomize further down the path
import sys as _sys, importlib as _il
_here = _os.path.dirname(_os.path.abspath(__file__))
_saved = list(_sys.path)
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or ".") != _here]
_sys.modules.pop("sitecustomize", None)
try:
    _il.import_module("sitecustomize")
except ImportError:
    pass
finally:
    _sys.path[:] = _saved
"""


def _python_command(cmd: Sequence[str]) -> list[str]:
    """``python prog.py`` -> this interpreter (which has decodescope and cupti-python)."""
    cmd = list(cmd)
    if cmd and os.path.basename(cmd[0]) in ("python", "python3") and os.sep not in cmd[0]:
        cmd[0] = sys.executable
    return cmd


def run_capture(
    spec: dict[str, Any],
    *,
    out: str | os.PathLike[str] | None,
    timeout: float | None = None,
    command: Sequence[str] | None = None,
    meta: dict[str, Any] | None = None,
    keep_child_dir: bool = False,
    env: dict[str, str] | None = None,
    grace_s: float = 10.0,
    echo: bool = True,
    on_start: Any = None,
) -> CaptureResult:
    """Run one capture in a child process and write the run to ``out`` (unless ``None``).

    ``spec`` is the child's job (see :mod:`decodescope.tracer.child`); with ``command`` the child
    is that program, bootstrapped through a ``sitecustomize`` on ``PYTHONPATH``.
    """
    from decodescope.tracer.store import write_run

    child_dir = Path(tempfile.mkdtemp(prefix="decodescope-capture-"))
    spec = {**spec, "out": str(child_dir)}
    spec_path = child_dir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    extra = {SPEC_ENV: str(spec_path), **(env or {})}
    if command:
        boot = child_dir / "boot"
        boot.mkdir()
        (boot / "sitecustomize.py").write_text(
            _SITECUSTOMIZE.format(spec=SPEC_ENV, owner=OWNER_ENV)
        )
        pp = os.environ.get("PYTHONPATH")
        extra["PYTHONPATH"] = str(boot) + (os.pathsep + pp if pp else "")
        argv = _python_command(command)
    else:
        argv = [sys.executable, "-m", "decodescope.tracer.child", str(spec_path)]
    stderr_path = child_dir / "stderr.txt"
    started = time.time()
    timed_out = False
    with open(stderr_path, "wb") as errf:
        try:
            proc = subprocess.Popen(argv, env=child_env(extra), stderr=errf, start_new_session=True)
        except OSError as e:  # one line, and no child folder left behind
            import shutil

            errf.close()
            shutil.rmtree(child_dir, ignore_errors=True)
            raise TraceError(argv[0], f"cannot start it: {e.strerror or e}") from None
        if on_start is not None:  # tracer/distributed.py: stops every rank when one fails
            on_start(proc)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            rc = _stop_child(proc, grace_s)
        except KeyboardInterrupt:
            _stop_child(proc, grace_s)
            raise
    tail = _tail(stderr_path)
    if echo and tail and (rc != 0 or timed_out):
        for line in tail[-15:]:
            print(f"  child| {line}", file=sys.stderr)
    raw = read_chunks(child_dir)
    info = _read_json(child_dir / "env.json")
    err = _read_json(child_dir / "error.json")
    status = _read_json(child_dir / "status.json")
    ok = rc == 0 and not timed_out and not err and bool(status.get("completed", not command))
    late_signal = None
    if rc is not None and rc < 0 and not timed_out and not err and status.get("completed"):
        # everything was written; the process died afterwards, in interpreter or CUDA teardown
        ok, late_signal = (
            True,
            f"the child died of signal {-rc} ({_signame(-rc)}) after writing its capture",
        )
    message = None
    if timed_out:
        message = f"the capture child did not finish within {timeout:g} s and was stopped"
    elif err and err.get("kind") == "session":
        message = err.get("message", "the CUPTI session could not start")
    elif err:
        message = f"the workload failed in the capture child: {err.get('message', 'unknown error')}"
    elif late_signal:
        pass
    elif rc is not None and rc < 0:
        message = f"the capture child was killed by signal {-rc} ({_signame(-rc)})"
    elif rc != 0:
        last = next((line for line in reversed(tail) if line.strip()), "")
        message = f"the capture child exited with code {rc}" + (f": {last.strip()}" if last else "")
    elif not ok:
        message = "the capture child ended without reporting completion"
    run_meta = _build_meta(
        spec,
        info,
        meta or {},
        started,
        partial=not ok,
        command=command,
        message=message or late_signal,
    )
    run = cr.assemble(raw, run_meta)
    try:  # layer, kind, block and op from the range paths, as `load` would give them
        from decodescope.analysis.attribution import attribute

        run = attribute(run)
    except Exception as e:  # never lose a capture to a naming problem; load() retries
        print(f"decodescope: attribution of the capture failed: {e}", file=sys.stderr)
    if message:
        n = run.kernels.num_rows
        message += f"; run marked partial with {n} kernel record{'s' if n != 1 else ''} flushed"
    out_path = None
    if out is not None:
        out_path = write_run(run, out, overwrite=True)
        notes = child_dir / "session-notes.txt"
        if notes.exists():
            with contextlib.suppress(OSError):
                (out_path / "capture-notes.txt").write_text(
                    notes.read_text() + "\n".join(tail[-40:]) + "\n"
                )
    if not keep_child_dir:
        import shutil

        shutil.rmtree(child_dir, ignore_errors=True)
    return CaptureResult(
        run, out_path, ok, message, rc, child_dir if keep_child_dir else None, tail
    )


def _stop_child(proc: subprocess.Popen, grace_s: float) -> int | None:
    """SIGTERM the child's process group (it flushes and writes), then SIGKILL after grace."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        return proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        try:
            return proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            return None


def _signame(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return "unknown"


def _tail(path: Path, n: int = 60) -> list[str]:
    try:
        data = path.read_bytes()[-16384:]
    except OSError:
        return []
    return data.decode("utf-8", "replace").splitlines()[-n:]


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


# DECODESCOPE_* variables that steer the tool, not the measured kernels (left out of a run's knobs)
NOT_KNOBS = frozenset(
    {
        SPEC_ENV,
        OWNER_ENV,
        "DECODESCOPE_GIT_COMMIT",
        "DECODESCOPE_RESULTS",
        "DECODESCOPE_CHROMIUM",
        "DECODESCOPE_DASHBOARD_PROFILE",
        "DECODESCOPE_DASHBOARD_SOURCES",
        "DECODESCOPE_DIST_TIMEOUT",
        "DECODESCOPE_SKIP_GPU_CHECK",  # ui/cmd_capture.require_cuda_driver
    }
)


def kernel_knobs(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ``DECODESCOPE_*`` environment variables set (non-empty) for a capture, sorted: the
    kernels' knobs (``DECODESCOPE_DENSE_TILE=0``, ``DECODESCOPE_MOE_T1_W2=tile``, ...), which
    the child inherits and which change what runs. A run records them (``config_json["knobs"]``
    and its notes) so that a figure measured off the defaults is never read as the defaults'."""
    env = os.environ if environ is None else environ
    return {
        k: v
        for k, v in sorted(env.items())
        if k.startswith("DECODESCOPE_")
        and not k.startswith("DECODESCOPE_CAPTURE_")
        and k not in NOT_KNOBS
        and v.strip()
    }


def knobs_line(knobs: Mapping[str, str] | None) -> str | None:
    """``"kernel knobs: A=1, B=x"`` or None."""
    return "kernel knobs: " + ", ".join(f"{k}={v}" for k, v in knobs.items()) if knobs else None


def _git_commit() -> str | None:
    env = os.environ.get("DECODESCOPE_GIT_COMMIT")  # a copy of the tree without its .git
    if env:
        return env
    try:
        here = Path(__file__).resolve().parent.parent
        r = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        )
        out = r.stdout.strip()
        return out if r.returncode == 0 and re.fullmatch(r"[0-9a-f]{7,40}", out) else None
    except (OSError, subprocess.SubprocessError):
        return None


def _build_meta(
    spec: dict[str, Any],
    info: dict[str, Any],
    meta: dict[str, Any],
    started: float,
    *,
    partial: bool,
    command: Sequence[str] | None,
    message: str | None,
) -> RunMeta:
    wl_meta = dict(info.get("workload_meta") or {})
    workload = (
        wl_meta.pop("workload", None)
        or spec.get("workload")
        or (Path(command[-1]).stem if command else None)
    )
    if command:
        for a in command[1:]:
            if a.endswith(".py"):
                workload = Path(a).stem
                break
    stamp = _dt.datetime.fromtimestamp(started, tz=_dt.UTC)
    run_id = (
        meta.get("run_id")
        or f"{workload or 'capture'}-{stamp:%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:6]}"
    )
    fields = {f for f in RunMeta.__dataclass_fields__}
    kw: dict[str, Any] = {k: v for k, v in wl_meta.items() if k in fields}
    if "layer_bytes" in kw and kw["layer_bytes"] is not None:
        kw["layer_bytes"] = {str(k): int(v) for k, v in dict(kw["layer_bytes"]).items()}
    config = {"capture": {k: v for k, v in spec.items() if k != "out"}}
    if command:
        config["command"] = list(command)
    knobs = kernel_knobs()
    if knobs:
        config["knobs"] = knobs
    if wl_meta.get("config_json"):
        with contextlib.suppress(ValueError):
            config["workload"] = json.loads(wl_meta["config_json"])
    kw.pop("config_json", None)
    notes = [n for n in (kw.pop("notes", None), knobs_line(knobs), message) if n]
    kw.update({k: v for k, v in meta.items() if k in fields and k != "run_id"})
    graph_mode = kw.pop("graph_mode", None) or (
        None if command else ("graph" if spec.get("graph") else "eager")
    )
    return RunMeta(
        run_id=run_id,
        source="cupti",
        created_at=stamp,
        workload=workload,
        graph_mode=graph_mode,
        gpu=info.get("gpu"),
        driver=info.get("driver"),
        cuda=info.get("cuda"),
        torch=info.get("torch"),
        cutlass_dsl=info.get("cutlass_dsl"),
        git_commit=_git_commit(),
        host=socket.gethostname(),
        notes="; ".join(notes) or None,
        config_json=json.dumps(config, default=str),
        partial=partial,
        **{
            k: v
            for k, v in kw.items()
            if k not in {"gpu", "driver", "cuda", "torch", "cutlass_dsl", "host"}
        },
    )
