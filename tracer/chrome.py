"""A run as Chrome-trace JSON (the format ui.perfetto.dev and chrome://tracing open).

Tracks:
- one process per GPU device ("GPU d"), one thread per CUDA stream, a slice per kernel and memop;
- one process "CPU" with a thread per OS thread: the NVTX ranges as they were pushed and popped;
- per GPU, "ranges" threads by depth: each range projected onto the GPU timeline as the span of
  the kernels attributed to it (first start to last end, per step), so a layer or op reads as
  one slice above its kernels, also for CUDA-graph replays where no range fires at replay time;
- ranges that were recorded on the GPU timeline (Kineto's gpu_user_annotation) stay there.

Slices that would overlap on one track without nesting go to an extra lane, because the
importer drops improperly nested slices.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

from decodescope.analysis.schema import Run
from decodescope.tracer.errors import TraceError

CPU_PID = 1
GPU_PID0 = 100
RANGE_TID0 = 1_000_000_000
GPU_RANGE_TID0 = 2_000_000_000


class _Lanes:
    """Greedy lane assignment: a slice goes on the first lane where it nests or follows."""

    def __init__(self) -> None:
        self.stacks: list[list[float]] = []  # per lane: the open slices' end times

    def place(self, start: float, end: float) -> int:
        for i, stack in enumerate(self.stacks):
            while stack and stack[-1] <= start:
                stack.pop()
            if not stack or end <= stack[-1]:
                stack.append(end)
                return i
        self.stacks.append([end])
        return len(self.stacks) - 1


def _us(ns: int, base: int) -> float:
    return (ns - base) / 1000.0


def chrome_trace(run: Run) -> dict[str, Any]:
    """The Chrome-trace document of ``run`` (see the module docstring)."""
    k = run.kernels.to_pylist()
    m = run.memops.to_pylist()
    r = [x for x in run.ranges.to_pylist() if x["start_ns"] is not None and x["end_ns"] is not None]
    starts = [x["start_ns"] for x in k + m + r if x["start_ns"] is not None]
    base = min(starts) if starts else 0
    ev: list[dict[str, Any]] = []
    meta: list[dict[str, Any]] = []
    named: set[tuple[int, int | None]] = set()

    def name_proc(pid: int, name: str, sort: int) -> None:
        if (pid, None) not in named:
            named.add((pid, None))
            meta.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}})
            meta.append(
                {"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": sort}}
            )

    def name_thread(pid: int, tid: int, name: str, sort: int) -> None:
        if (pid, tid) not in named:
            named.add((pid, tid))
            meta.append(
                {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}
            )
            meta.append(
                {
                    "ph": "M",
                    "name": "thread_sort_index",
                    "pid": pid,
                    "tid": tid,
                    "args": {"sort_index": sort},
                }
            )

    # kernels and memops on stream tracks
    lanes: dict[tuple[int, int], _Lanes] = defaultdict(_Lanes)
    gpu_items = [(x, "kernel") for x in k] + [(x, "memop") for x in m]
    gpu_items.sort(key=lambda t: (t[0]["start_ns"], -(t[0]["end_ns"] or 0)))
    for x, what in gpu_items:
        if x["start_ns"] is None or x["end_ns"] is None:
            continue
        dev = x.get("device") or 0
        pid = GPU_PID0 + dev
        stream = int(x.get("stream") or 0)
        s, e = _us(x["start_ns"], base), _us(x["end_ns"], base)
        lane = lanes[(pid, stream)].place(s, e)
        tid = stream * 8 + lane
        name_proc(pid, f"GPU {dev}", 10 + dev)
        name_thread(
            pid, tid, f"stream {stream}" + (f" ({lane + 1})" if lane else ""), stream * 8 + lane
        )
        if what == "kernel":
            args = {
                "range_path": x.get("range_path"),
                "layer": x.get("layer"),
                "op": x.get("op"),
                "step": x.get("step"),
                "correlation_id": x.get("correlation_id"),
                "graph_node_id": x.get("graph_node_id"),
                "grid": [x.get("grid_x"), x.get("grid_y"), x.get("grid_z")],
                "block": [x.get("block_x"), x.get("block_y"), x.get("block_z")],
            }
            ev.append(
                {
                    "ph": "X",
                    "cat": "kernel",
                    "name": x.get("name") or "kernel",
                    "pid": pid,
                    "tid": tid,
                    "ts": s,
                    "dur": e - s,
                    "args": _clean(args),
                }
            )
        else:
            args = {
                "bytes": x.get("bytes"),
                "range_path": x.get("range_path"),
                "step": x.get("step"),
            }
            ev.append(
                {
                    "ph": "X",
                    "cat": "memop",
                    "name": x.get("kind") or "memop",
                    "pid": pid,
                    "tid": tid,
                    "ts": s,
                    "dur": e - s,
                    "args": _clean(args),
                }
            )

    # ranges as recorded (CPU threads; Kineto's GPU annotations on their GPU)
    rl: dict[tuple[int, int], _Lanes] = defaultdict(_Lanes)
    for x in sorted(r, key=lambda x: (x["start_ns"], -x["end_ns"])):
        s, e = _us(x["start_ns"], base), _us(x["end_ns"], base)
        thread = int(x.get("thread") or 0)
        if x.get("timeline") == "gpu":
            pid, label, sort0 = GPU_PID0, f"annotations (stream {thread})", GPU_RANGE_TID0
            name_proc(pid, "GPU 0", 10)
        else:
            pid, label, sort0 = CPU_PID, f"thread {thread}", 0
            name_proc(pid, "CPU", 0)
        lane = rl[(pid, thread)].place(s, e)
        tid = (thread % 100_000_000) * 4 + lane + (sort0 if x.get("timeline") == "gpu" else 0)
        name_thread(pid, tid, label + (f" ({lane + 1})" if lane else ""), tid)
        ev.append(
            {
                "ph": "X",
                "cat": "range",
                "name": x["name"],
                "pid": pid,
                "tid": tid,
                "ts": s,
                "dur": e - s,
                "args": _clean({"path": x.get("path"), "domain": x.get("domain")}),
            }
        )

    # ranges projected onto the GPU: span of the kernels under each path prefix, per step
    spans: dict[tuple[int, Any, str], list[int]] = {}
    for x in k:
        p = x.get("range_path")
        if not p or p.startswith("(") or x["start_ns"] is None or x["end_ns"] is None:
            continue
        parts = p.split("/")
        for i in range(1, len(parts) + 1):
            key = (x.get("device") or 0, x.get("step"), "/".join(parts[:i]))
            sp = spans.get(key)
            if sp is None:
                spans[key] = [x["start_ns"], x["end_ns"], 1]
            else:
                sp[0] = min(sp[0], x["start_ns"])
                sp[1] = max(sp[1], x["end_ns"])
                sp[2] += 1
    pl: dict[tuple[int, int], _Lanes] = defaultdict(_Lanes)
    for (dev, step, path), (s0, e0, n) in sorted(
        spans.items(), key=lambda t: (t[1][0], -t[1][1], t[0][2].count("/"))
    ):
        depth = path.count("/")
        pid = GPU_PID0 + dev
        s, e = _us(s0, base), _us(e0, base)
        lane = pl[(pid, 0)].place(s, e)
        tid = RANGE_TID0 + lane
        name_thread(pid, tid, "ranges on GPU" + (f" ({lane + 1})" if lane else ""), -1000 + lane)
        ev.append(
            {
                "ph": "X",
                "cat": "gpu_range",
                "name": path.rsplit("/", 1)[-1],
                "pid": pid,
                "tid": tid,
                "ts": s,
                "dur": e - s,
                "args": _clean({"path": path, "step": step, "kernels": n, "depth": depth}),
            }
        )

    return {
        "traceEvents": meta + ev,
        "displayTimeUnit": "ns",
        "otherData": {"run_id": run.run_id, "source": run.meta.source, "base_ns": base},
    }


def _clean(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None and v != [None, None, None]}


def write_chrome_trace(run: Run, out: str | os.PathLike[str]) -> int:
    """Write the Chrome-trace JSON of ``run`` (gzip when ``out`` ends in .gz); returns #events.

    The file appears complete or not at all: it is written to a temporary sibling and renamed.
    A path that cannot be written raises a one-line :class:`TraceError` naming ``out``; the
    temporary file, and any folders made for it, are removed on every failure."""
    out = Path(out)
    folder = out.parent
    try:
        if out.is_dir():
            raise TraceError(out, "is a folder; give a file name such as trace.json")
        made = [d for d in (folder, *folder.parents) if not d.exists()]  # nearest first
    except OSError as e:
        raise TraceError(out, f"cannot write: {e.strerror or e}") from None
    tmp = out.with_name("." + out.name + ".tmp")
    opened = False
    try:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            why = f"{e.filename or folder}: {e.strerror or e}"
            with contextlib.suppress(OSError):
                chain = (folder, *folder.parents)
                file = next((d for d in chain if d.exists() and not d.is_dir()), None)
                if file is not None:
                    why = f"{file} is a file"
            raise TraceError(out, f"cannot create its folder ({why})") from None
        doc = chrome_trace(run)
        data = json.dumps(doc, separators=(",", ":")).encode()
        if out.suffix == ".gz":
            data = gzip.compress(data, compresslevel=5)
        try:
            with open(tmp, "wb") as f:
                opened = True  # ours now: removed below if anything fails
                f.write(data)
            os.replace(tmp, out)
        except OSError as e:
            raise TraceError(out, f"cannot write: {e.strerror or e}") from None
    except BaseException:
        if opened:
            with contextlib.suppress(OSError):
                tmp.unlink()
        for d in made:
            try:
                d.rmdir()  # only the empty folders made above
            except OSError:
                break
        raise
    return sum(1 for e in doc["traceEvents"] if e["ph"] != "M")
