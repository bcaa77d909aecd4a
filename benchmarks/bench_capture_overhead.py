"""What the capture costs on the real decode step, option by option (issue 3, item 7).

    python benchmarks/bench_capture_overhead.py [--workload standard,specialized] [--batch 1,64]
        [--variants default[,launch_none,graph_trace,...]] [--rounds 1] [--blocks 3]
        [--block-ms 25] [--budget-s 195] [--out benchmarks/results/capture_overhead_decode]
    python benchmarks/bench_capture_overhead.py --workload toy --batch 1      # the old toy
    python benchmarks/bench_capture_overhead.py --range-api                  # CPU: range API alone

One short-lived child process per (case, variant), case = workload x batch (preset kimi-k3,
tp_shape 8, layers kda,mla unless ``--opt`` says otherwise). A child does what a real capture
does, and nothing else with CUPTI:

1. ``build``: build the workload, warm up, capture CUDA graph ``G0`` (no session yet; NVTX
   injection set, as in capture children);
2. ``off``: ``--blocks`` blocks with no session (``G0`` replays and eager steps): the child's own
   baseline;
3. ``session``: start ONE :class:`Session` with the variant's options, capture ``G`` under it
   (GRAPHNODE callbacks fire, as in a real capture);
4. ``on``: ``--blocks`` blocks (``G`` replays and eager steps), with the records per step counted
   (proof that the variant traced what it claims); then ``--eager-ab`` rounds of eager blocks
   with the session paused (:meth:`Session.pause`: every kind and launch record disabled, CUPTI
   still loaded and subscribed) and recording, interleaved ABBA: an eager overhead measured in
   one process, free of the drift between the off and on phases (the s11 H200 run: the A/A
   control's eager step moved -18% from its off to its on phase, and the off phases of the
   children spread 34%); then ``--graph-ab`` rounds (default 0) of ``G`` replays, paused and
   recording, ABBA: what a recording replay costs over a paused one in one process, and what a
   paused session costs a replay (paused blocks against the ``off`` blocks' ``G0``): the
   figures a capture that records one step in N would pay;
5. exit with ``os._exit``: the session is never stopped, nothing is replayed after it.

Why (the H200 run of eb72dbd, ``notes/gpu-logs/s4/overhead_decode.log``): the earlier design
switched sessions on and off inside one process and replayed graphs after ``Session.stop()``
(which unsubscribes the callback subscriber and disables the kinds); every case died with
SIGSEGV in ``cuGraphLaunch``. Replaying CUDA graphs after CUPTI callbacks are unsubscribed is a
known crash (pytorch/pytorch#112507, #150957: Kineto turns CUPTI teardown and lazy re-init off
when graphs are used). The real capture never does that, and neither does this benchmark now.

Each child prints ``[case/variant] phase ...`` (flushed) before every phase, so a crash names
where it happened; the parent keeps the child's last phase line in the error. Drift: each child
compares with its own ``off`` blocks (seconds apart, same process); with ``--rounds N`` the
children of a case run N times, the variant order rotated each round, and a variant's overhead
is the median over its children.

Figures per block and target (``graph`` = graph replays, ``eager`` = eager steps), each a median
of per-step CUDA-event intervals:

- ``natural``: steps back to back, an event between consecutive steps;
- ``gpu``: the same steps enqueued behind a ``torch.cuda._sleep`` spin long enough to hide the
  host (``hidden`` says whether it did): pure GPU time per step; the graph verdict is on it
  (target <= 2%), since a layer span sees GPU time;
- ``host``: host microseconds per step while the GPU spins (the launch-side cost).

The eager verdict is on ``natural`` (target <= 10%): eager layer spans include launch gaps.
Block sizes adapt to the step time (``--block-ms`` of steps per figure). Prints one table per
case as it goes, verdict lines last; writes ``OUT.json`` and ``OUT.txt`` after every child.

Variants (``VARIANTS``; ``kind`` names are ``cupti.ActivityKind`` members):

- ``default``: what ``decodescope capture`` enables: CONCURRENT_KERNEL, MEMCPY, MEMSET, MARKER,
  MARKER_DATA, OVERHEAD; native launch-API records (``activity_enable_*_api`` per launch cbid);
  GRAPHNODE callbacks; 64 MB buffers, records kept in the buffer callback and converted at stop
- ``kernel``: CONCURRENT_KERNEL alone (CUPTI's own per-kernel cost)
- ``kernel_serial``: KERNEL instead of CONCURRENT_KERNEL (serializes kernels)
- ``no_marker_data``: default without MARKER_DATA (records nobody reads)
- ``lean``: CONCURRENT_KERNEL + MARKER only (no memcpy/memset/overhead records: loses data)
- ``launch_callback``: launch APIs through Python callbacks instead of native records
- ``launch_none``: no launch records (enough for graph-only captures)
- ``small_buffers``: 1 MB buffers: CUPTI completes buffers during the steps (records kept)
- ``small_buffers_convert``: 1 MB buffers, converted in the buffer callback (Python on
  CUPTI's thread, holding the GIL, while the workload runs)
- ``flush_period``: ``cuptiActivityFlushPeriod(20 ms)`` and a chunk written per delivered buffer
  (what program mode does)
- ``graph_trace``: default + GRAPH_TRACE (graph-level records for graphs, kernel records for
  eager launches)
- ``graph_trace_only``: GRAPH_TRACE alone (what graph-level tracing costs by itself)
- ``hw_trace``: default with kernel timestamps from the Hardware Event System
  (``cuptiActivityEnableHWTrace``); ``hw_trace_kernel``: the same for ``kernel``. Where CUPTI
  refuses it the child's session notes say so and its records are the plain variant's
- ``control``: no session in either phase (G captured again, no CUPTI): an A/A child that
  measures what "off blocks first, on blocks second" costs by itself (order, drift)

Process-wide settings (a separate run each): ``--no-inject`` (no NVTX_INJECTION64_PATH: no
marker records at all); ``--attrs host_pinned=1,device_buffer_mb=32,prealloc=3,pool_limit=N``
(CUPTI activity attributes, set before CUDA starts).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

TARGETS = {"graph": 0.02, "eager": 0.10}
VERDICT_ON = {"graph": "gpu", "eager": "natural"}
DEFAULT_VARIANT = "default"

_ALL = ["CONCURRENT_KERNEL", "MEMCPY", "MEMSET", "MARKER", "MARKER_DATA", "OVERHEAD"]
# variant -> Session keyword options (None: no session)
VARIANTS: dict[str, dict | None] = {
    "off": None,
    "control": None,  # A/A: a child with no session in either phase (order/drift bias)
    "default": {},
    "kernel": {"kinds": ["CONCURRENT_KERNEL"], "launch_records": "none", "graph_nodes": False},
    "kernel_serial": {"kinds": ["KERNEL"], "launch_records": "none", "graph_nodes": False},
    "no_marker_data": {"kinds": [k for k in _ALL if k != "MARKER_DATA"]},
    "lean": {"kinds": ["CONCURRENT_KERNEL", "MARKER"]},
    "launch_callback": {"launch_records": "callback"},
    "launch_none": {"launch_records": "none"},
    "small_buffers": {"buffer_bytes": 1 << 20},
    "small_buffers_convert": {"buffer_bytes": 1 << 20, "defer_conversion": False},
    "flush_period": {"flush_period_ms": 20},
    "graph_trace": {"kinds": [*_ALL, "GRAPH_TRACE"]},
    "graph_trace_only": {"kinds": ["GRAPH_TRACE"], "launch_records": "none", "graph_nodes": False},
    "hw_trace": {"hw_trace": True},
    "hw_trace_kernel": {
        "kinds": ["CONCURRENT_KERNEL"],
        "launch_records": "none",
        "graph_nodes": False,
        "hw_trace": True,
    },
}
# what each variant still records completely, per mode (the others are ablations)
CORRECT = {
    "default": ("graph", "eager"),
    "no_marker_data": ("graph", "eager"),
    "launch_callback": ("graph", "eager"),
    "launch_none": ("graph",),
    "small_buffers": ("graph", "eager"),
    "small_buffers_convert": ("graph", "eager"),
    "flush_period": ("graph", "eager"),
    "graph_trace": ("graph",),  # step times per launch; kernels from the replays before it
    "hw_trace": ("graph", "eager"),
}
LABELS = {
    "off": "off",
    "control": "control (A/A)",
    "default": "default (capture)",
    "kernel": "kernel only",
    "kernel_serial": "KERNEL (serial)",
    "no_marker_data": "no MARKER_DATA",
    "lean": "kernel+marker only",
    "launch_callback": "launch=callback",
    "launch_none": "launch=none",
    "small_buffers": "1 MB buffers",
    "small_buffers_convert": "1 MB, convert in cb",
    "flush_period": "flush 20 ms (program)",
    "graph_trace": "default+GRAPH_TRACE",
    "graph_trace_only": "GRAPH_TRACE alone",
    "hw_trace": "default+HW trace (HES)",
    "hw_trace_kernel": "kernel only, HW trace",
}
ATTRS = {  # --attrs key -> (cupti ActivityAttribute member, ctypes type name, scale)
    "host_pinned": ("ATTR_MEM_ALLOCATION_TYPE_HOST_PINNED", "c_uint8", 1),
    "device_buffer_mb": ("ATTR_DEVICE_BUFFER_SIZE", "c_size_t", 1 << 20),
    "prealloc": ("ATTR_DEVICE_BUFFER_PRE_ALLOCATE_VALUE", "c_size_t", 1),
    "pool_limit": ("ATTR_DEVICE_BUFFER_POOL_LIMIT", "c_size_t", 1),
}
WORKLOAD_DEFAULTS = {
    "standard": {"preset": "kimi-k3", "tp_shape": "8", "layers": "kda,mla"},
    "specialized": {"preset": "kimi-k3", "tp_shape": "8", "layers": "kda,mla"},
    "toy": {},
}


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# planning (pure: tested on the CPU)


def parse_variants(text: str) -> list[str]:
    names = [v for v in text.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    out = [v for v in dict.fromkeys(names) if v != "off"]
    if not out:
        raise ValueError("--variants needs at least one variant besides off")
    return out


def plan_children(cases: list[str], variants: list[str], rounds: int) -> list[tuple[int, str, str]]:
    """(round, case, variant) for every child, in run order: round by round, case by case, the
    variant order rotated every round (so that no variant always runs first in a case)."""
    out = []
    for r in range(rounds):
        k = r % len(variants)
        order = variants[k:] + variants[:k]
        out += [(r, case, v) for case in cases for v in order]
    return out


def steps_for(step_us: float, block_ms: float, lo: int, hi: int) -> int:
    """Steps per figure: about ``block_ms`` of work, within [lo, hi]."""
    if not step_us or step_us <= 0:
        return lo
    return max(lo, min(hi, int(block_ms * 1000 / step_us)))


def parse_attrs(text: str | None) -> dict[str, int]:
    out: dict[str, int] = {}
    for kv in (text or "").split(","):
        if not kv:
            continue
        k, sep, v = kv.partition("=")
        if not sep or k not in ATTRS:
            raise ValueError(f"--attrs takes {', '.join(ATTRS)} as key=integer, got {kv!r}")
        try:
            out[k] = int(v)
        except ValueError:
            raise ValueError(f"--attrs {k} needs an integer, got {v!r}") from None
    return out


def workload_opts(workload: str, batch: str, extra: list[str]) -> dict[str, str]:
    opts = dict(WORKLOAD_DEFAULTS.get(workload, {}))
    opts["batch"] = str(batch)
    for kv in extra:
        k, sep, v = kv.partition("=")
        if not sep:
            raise ValueError(f"--opt takes key=value, got {kv!r}")
        opts[k] = v
    return opts


# ---------------------------------------------------------------------------------------------
# inner: one child = one case (workload x batch) and one variant


def _set_attrs(attrs: dict[str, int]) -> list[str]:
    """CUPTI activity attributes, before CUDA starts; one note per attribute that failed."""
    import ctypes

    from cupti import cupti as c

    notes = []
    for key, val in attrs.items():
        member, ctype, scale = ATTRS[key]
        try:
            v = getattr(ctypes, ctype)(val * scale)
            size = ctypes.c_size_t(ctypes.sizeof(v))
            c.activity_set_attribute(
                int(getattr(c.ActivityAttribute, member)), ctypes.addressof(size),
                ctypes.addressof(v),
            )  # fmt: skip
        except Exception as e:
            notes.append(f"{key}: {type(e).__name__}: {e}")
    return notes


def _take_counts(session) -> dict[str, int]:
    """Flush; count what the session recorded since the last call, by record kind, and drop it:
    records still kept unconverted by kind, plus rows converted meanwhile (the converter's
    ``seen``: in the buffer callback, or in chunks that a flush period wrote), plus launch
    callback rows."""
    from decodescope.tracer import cupti_records as cr

    names = {
        cr.KIND_CONCURRENT_KERNEL: "kernel", cr.KIND_KERNEL: "kernel", cr.KIND_MARKER: "marker",
        cr.KIND_MEMCPY: "memop", cr.KIND_MEMSET: "memop", cr.KIND_OVERHEAD: "overhead",
        cr.KIND_RUNTIME: "launch_api", cr.KIND_DRIVER: "launch_api", cr.KIND_GRAPH_TRACE: "graph",
    }  # fmt: skip
    session.flush()
    c: Counter = Counter()
    with session._lock:
        pending, session._pending = session._pending, []
        for rows in session._rows.values():
            rows.clear()
        c["launch_cb"] += len(session._launch)
        del session._launch[:]
        seen = dict(session.conv.seen)
    prev = getattr(session, "_bench_seen", {})
    session._bench_seen = seen
    for k, v in seen.items():
        c[{"launch": "launch_api"}.get(k, k)] += v - prev.get(k, 0)
    for acts in pending:
        for a in acts:
            try:
                c[names.get(int(a.kind), f"kind{int(a.kind)}")] += 1
            except Exception:
                c["unreadable"] += 1
    return {k: v for k, v in c.items() if v}


def _time_steps(torch, fn, n: int, spin_cycles: int | None) -> tuple[list[float], float]:
    """Per-step CUDA-event intervals (us) of ``n`` steps and the host us per step to enqueue
    them; behind a spin kernel of ``spin_cycles`` when given."""
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    if spin_cycles:
        torch.cuda._sleep(spin_cycles)
    t = time.perf_counter()
    ev[0].record()
    for i in range(n):
        fn()
        ev[i + 1].record()
    host = (time.perf_counter() - t) / n * 1e6
    ev[-1].synchronize()
    return [ev[i].elapsed_time(ev[i + 1]) * 1e3 for i in range(n)], host


def _figure(torch, fn, n_nat: int, n_gpu: int, cyc_per_us: float) -> dict:
    fn()
    torch.cuda.synchronize()
    nat, nat_host = _time_steps(torch, fn, n_nat, None)
    spin_us = 3 * nat_host * n_gpu + 2000
    gpu, host = _time_steps(torch, fn, n_gpu, int(spin_us * cyc_per_us))
    return {
        "natural_us": statistics.median(nat),
        "natural_host_us": nat_host,
        "gpu_us": statistics.median(gpu),
        "host_us": host,
        "hidden": host * n_gpu < 0.8 * spin_us,
        "n": n_nat,
        "n_gpu": n_gpu,
    }


def inner(args: argparse.Namespace) -> dict:
    """One child: one case, one variant; off blocks first (no session), then ONE session started,
    the graph captured under it, the variant's blocks. Never stops the session (the caller
    leaves with ``os._exit``): no graph is launched after CUPTI callbacks are unsubscribed."""
    case = json.loads(args.inner)
    variant = case["variant"]
    tag = f"[{case['name']}/{variant}]"
    t_start = time.time()
    res: dict = {"case": case["name"], "variant": variant, "round": case.get("round", 0),
                 "notes": [], "blocks": []}  # fmt: skip

    def phase(name: str) -> None:
        res["phase"] = name
        log(f"{tag} phase {name} ({time.time() - t_start:.1f} s)")

    phase("import")
    if case.get("attrs"):
        res["notes"] += _set_attrs(case["attrs"])
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(
            "the overhead benchmark needs a CUDA GPU (torch.cuda.is_available() is False)"
        )
    from decodescope.tracer import range as trange
    from decodescope.tracer.capture import Session
    from decodescope.tracer.child import _find_workload, env_info

    phase("build")
    t = time.perf_counter()
    wl = _find_workload(case["workload"])(**case["opts"])
    if wl.refresh:
        wl.refresh()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            with trange("warmup"):
                wl.step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    def eager_step() -> None:
        with trange("step"):
            wl.step()

    def capture():
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g), trange("step"):
            wl.step()
        torch.cuda.synchronize()
        return g

    phase("capture G0 (no session)")
    g0 = capture()
    res["build_s"] = time.perf_counter() - t
    phase("sizing (G0 replays, eager steps; no session)")
    torch.cuda._sleep(1000)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(20_000_000)
    b.record()
    b.synchronize()
    cyc = 20_000_000 / (a.elapsed_time(b) * 1e3)
    g_us = statistics.median(_time_steps(torch, g0.replay, 10, None)[0])
    e_us = max(
        statistics.median(_time_steps(torch, eager_step, 5, None)[0]),
        _time_steps(torch, eager_step, 5, None)[1],
    )
    n_g = steps_for(g_us, args.block_ms, 10, 400)
    n_e = steps_for(e_us, args.block_ms, 3, 50)
    sizes = {"graph": (n_g, min(n_g, 50)), "eager": (n_e, min(n_e, 5))}
    res.update(step_us={"graph": g_us, "eager": e_us}, sizes=sizes, cycles_per_us=cyc)
    res["env"] = env_info(
        {"workload_meta": {k: v for k, v in wl.meta.items() if k != "config_json"}}
    )
    log(f"{tag} built in {res['build_s']:.0f} s; graph step {g_us:.0f} us x {n_g}, "
        f"eager step {e_us:.0f} us x {n_e}")  # fmt: skip

    def refresh() -> None:
        if wl.refresh:
            wl.refresh()
        torch.cuda.synchronize()

    def block(kind: str, graph, session) -> None:
        rec: dict = {"phase": kind, "variant": "off" if kind == "off" else variant,
                     "figures": {}, "records": {}}  # fmt: skip
        for tgt, fn in (("graph", graph.replay), ("eager", eager_step)):
            n_nat, n_gpu = sizes[tgt]
            b0 = session.buffers if session else 0
            f = _figure(torch, fn, n_nat, n_gpu, cyc)
            if session is not None:
                f["buffers_in_loop"] = session.buffers - b0
                counts = _take_counts(session)
                rec["records"][tgt] = {k: v / (1 + n_nat + n_gpu) for k, v in counts.items()}
            rec["figures"][tgt] = f
        res["blocks"].append(rec)

    def ab_blocks(session, rounds: int, pre: str, tgt: str, fn) -> None:
        """``rounds`` ABBA pairs of ``tgt`` blocks (``fn``) in one session, paused
        (``{pre}_off``) and recording (``{pre}_on``), the records of each block counted per
        step; the session is left recording."""
        for i in range(rounds):
            pair = (f"{pre}_off", f"{pre}_on")
            for state in pair if i % 2 == 0 else pair[::-1]:
                (session.pause if state.endswith("_off") else session.resume)()
                torch.cuda.synchronize()
                n_nat, n_gpu = sizes[tgt]
                _take_counts(session)  # what the switch itself flushed is not the block's
                f = _figure(torch, fn, n_nat, n_gpu, cyc)
                recs = {k: v / (1 + n_nat + n_gpu) for k, v in _take_counts(session).items()}
                res["blocks"].append({"phase": state, "variant": variant,
                                      "figures": {tgt: f}, "records": {tgt: recs}})  # fmt: skip
        session.resume()
        _take_counts(session)

    try:
        phase(f"off: {args.blocks} blocks, G0 + eager, no session")
        refresh()
        for _ in range(args.blocks):
            block("off", g0, None)
        opts = VARIANTS[variant]
        session = None
        if opts is not None:
            phase(f"session start ({variant}: {opts or 'the capture defaults'})")
            tmp = Path(tempfile.mkdtemp(prefix="ds-overhead-"))

            class Counted(Session):
                """Counts delivered buffers itself (``counts`` resets whenever a chunk is
                written)."""

                buffers = 0

                def _completed(self, *a):
                    self.buffers += 1
                    super()._completed(*a)

            session = Counted(tmp / "s", **opts).start()
            res["session_errors"] = list(session.errors[:5])
        phase(f"capture G under the session ({variant})" if session else "capture G (control)")
        graph = capture()
        if session is not None:
            res["graph_nodes_seen"] = len(session._gnode)
        phase(f"refresh + first replay of G ({variant})")
        refresh()
        graph.replay()
        torch.cuda.synchronize()
        if session is not None:
            _take_counts(session)
        phase(f"on: {args.blocks} blocks, G + eager, session {variant}")
        for _ in range(args.blocks):
            block("on", graph, session)
        if session is not None and args.eager_ab:
            phase(f"eager A/B: {args.eager_ab} rounds, session paused / recording, ABBA")
            ab_blocks(session, args.eager_ab, "ab", "eager", eager_step)
        if session is not None and args.graph_ab:
            phase(f"graph A/B: {args.graph_ab} rounds, G replayed paused / recording, ABBA")
            ab_blocks(session, args.graph_ab, "gab", "graph", graph.replay)
        if session is not None:
            res["session_errors"] = list(session.errors[:5])
            res["callback_errors"] = session.counts.get("callback_errors", 0)
        phase("done (session left running; the process exits without stopping it)")
    except Exception as e:  # keep the blocks measured so far
        import traceback

        traceback.print_exc()
        res["failed"] = f"{type(e).__name__}: {' '.join(str(e).split())}"[:400]
        res["notes"].append(f"stopped by {res['failed']} during {res.get('phase')}")
    res["child_s"] = time.time() - t_start
    return res


# ---------------------------------------------------------------------------------------------
# summary (pure)


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _child_fig(child: dict, kind: str, tgt: str, f: str) -> float:
    return _med([b["figures"][tgt][f"{f}_us"] for b in child.get("blocks", [])
                 if b["phase"] == kind and tgt in b["figures"]])  # fmt: skip


def summarize_case(children: list[dict]) -> dict:
    """A case's children -> per target (graph, eager) and variant: the median over children of
    the variant's figure, and of its overhead against the same child's off blocks; records per
    step; ``off`` = every child's off blocks."""
    ok = [c for c in children if c.get("blocks")]
    out: dict = {}
    for tgt in ("graph", "eager"):
        rows: dict = {}
        offs = [b for c in ok for b in c["blocks"] if b["phase"] == "off" and tgt in b["figures"]]
        if offs:
            row: dict = {"children": len({id(c) for c in ok}), "blocks": len(offs)}
            for f in ("natural", "gpu", "host"):
                xs = [b["figures"][tgt][f"{f}_us"] for b in offs]
                row[f], row[f"{f}_min"], row[f"{f}_max"] = _med(xs), min(xs), max(xs)
                row[f"{f}_overhead"] = 0.0
            row["hidden"] = all(b["figures"][tgt]["hidden"] for b in offs)
            row["buffers_in_loop"], row["records_per_step"] = 0, {}
            rows["off"] = row
        for v in dict.fromkeys(c["variant"] for c in ok):
            cs = [c for c in ok if c["variant"] == v]
            bl = [b for c in cs for b in c["blocks"] if b["phase"] == "on" and tgt in b["figures"]]
            if not bl:
                continue
            row = {"children": len(cs), "blocks": len(bl)}
            for f in ("natural", "gpu", "host"):
                xs = [b["figures"][tgt][f"{f}_us"] for b in bl]
                row[f], row[f"{f}_min"], row[f"{f}_max"] = _med(xs), min(xs), max(xs)
                ovs = [_ratio(_child_fig(c, "on", tgt, f), _child_fig(c, "off", tgt, f))
                       for c in cs]  # fmt: skip
                ovs = [x for x in ovs if x == x]
                row[f"{f}_overhead"] = _med(ovs)
                row[f"{f}_overheads"] = ovs
            row["hidden"] = all(b["figures"][tgt]["hidden"] for b in bl)
            row["buffers_in_loop"] = sum(b["figures"][tgt].get("buffers_in_loop", 0) for b in bl)
            recs: dict[str, list[float]] = {}
            for b in bl:
                for k, x in (b["records"].get(tgt) or {}).items():
                    recs.setdefault(k, []).append(x)
            row["records_per_step"] = {k: _med(x) for k, x in sorted(recs.items())}
            if tgt == "eager":  # interleaved in one process (ABBA, --eager-ab)
                ab = [_ratio(_child_fig(c, "ab_on", tgt, "natural"),
                             _child_fig(c, "ab_off", tgt, "natural")) for c in cs]  # fmt: skip
                ab = [x for x in ab if x == x]
                if ab:
                    row["natural_ab_overhead"] = _med(ab)
                    row["natural_ab_overheads"] = ab
            else:  # G replayed with the session paused and recording (ABBA, --graph-ab)
                on = [_ratio(_child_fig(c, "gab_on", tgt, "gpu"),
                             _child_fig(c, "gab_off", tgt, "gpu")) for c in cs]  # fmt: skip
                paused = [_ratio(_child_fig(c, "gab_off", tgt, "gpu"),
                                 _child_fig(c, "off", tgt, "gpu")) for c in cs]  # fmt: skip
                on, paused = [x for x in on if x == x], [x for x in paused if x == x]
                if on:
                    row["gpu_ab_overhead"], row["gpu_ab_overheads"] = _med(on), on
                    recs = [b["records"].get(tgt) or {} for c in cs for b in c["blocks"]
                            if b["phase"] == "gab_off"]  # fmt: skip
                    row["paused_records_per_step"] = _med(
                        [sum(r.values()) for r in recs]) if recs else float("nan")  # fmt: skip
                if paused:
                    row["paused_overhead"], row["paused_overheads"] = _med(paused), paused
            rows[v] = row
        out[tgt] = rows
    out["checks"] = {
        "off_graph_gpu_spread": _spread([_child_fig(c, "off", "graph", "gpu") for c in ok]),
        "off_eager_natural_spread": _spread([_child_fig(c, "off", "eager", "natural") for c in ok]),
        "g_vs_g0_note": "off = G0 (captured before any session), on = G (captured under it)",
    }
    out["child_errors"] = [
        f"{c.get('variant')}: {c['error']}" for c in children if c.get("error")
    ] + [f"{c.get('variant')}: {c['failed']}" for c in children if c.get("failed")]
    notes = Counter(f"{c.get('variant')}: {n}" for c in children
                    for n in (c.get("session_errors") or []) + (c.get("notes") or []))  # fmt: skip
    out["session_notes"] = [f"{k} (x{v})" for k, v in notes.items()]
    out["verdicts"] = verdicts(out)
    return out


def _ratio(a: float | None, b: float | None) -> float:
    return a / b - 1 if a and b and a == a and b == b else float("nan")


def _spread(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return (max(xs) - min(xs)) / _med(xs) if len(xs) > 1 and _med(xs) else float("nan")


def verdicts(summary: dict) -> dict:
    """The default capture's verdict per mode, and the cheapest variant that still records
    everything that mode needs (``CORRECT``)."""
    out = {}
    for mode, f in VERDICT_ON.items():
        rows = summary.get(mode, {})
        d = rows.get(DEFAULT_VARIANT)
        v: dict = {"figure": f, "target": TARGETS[mode]}
        if d and d[f"{f}_overhead"] == d[f"{f}_overhead"]:
            v.update(default=d[f"{f}_overhead"], ok=d[f"{f}_overhead"] <= TARGETS[mode])
        ok = [(r[f"{f}_overhead"], name) for name, r in rows.items()
              if mode in CORRECT.get(name, ()) and r[f"{f}_overhead"] == r[f"{f}_overhead"]]  # fmt: skip
        if ok:
            best = min(ok)
            v.update(best=best[1], best_overhead=best[0], best_ok=best[0] <= TARGETS[mode])
        if d and d.get(f"{f}_ab_overhead") is not None:
            x = d[f"{f}_ab_overhead"]
            v.update(interleaved=x, interleaved_ok=x <= TARGETS[mode])
        out[mode] = v
    return out


def _pct(x: float | None) -> str:
    return "   n/a" if x is None or x != x else f"{x:+6.1%}"


def format_case(name: str, children: list[dict], summary: dict) -> str:
    w = io.StringIO()
    p = lambda *a: print(*a, file=w)  # noqa: E731
    good = [c for c in children if c.get("blocks")]
    if not good:
        for c in children:
            p(f"\n== {name}/{c.get('variant')}: error: {c.get('error') or c.get('failed')}")
        return w.getvalue()
    c0 = good[0]
    su = c0.get("step_us", {})
    p(f"\n== {name}: graph step {su.get('graph', 0):.0f} us, eager step {su.get('eager', 0):.0f} "
      f"us; {len(children)} children (one per variant and round), each: off blocks, then one "
      f"session; built in {c0.get('build_s', 0):.0f} s, child {c0.get('child_s', 0):.0f} s; "
      f"graph nodes seen at capture {c0.get('graph_nodes_seen')}")  # fmt: skip
    for n in summary.get("session_notes", []):
        p(f"   note: {n}")
    for n in summary.get("child_errors", [])[:10]:
        p(f"   child error: {n}")
    for mode in ("graph", "eager"):
        f = VERDICT_ON[mode]
        p(f"  {mode}: us per step, median over blocks (overhead: median over children of on vs "
          f"the child's own off); verdict on {f}, target {TARGETS[mode]:.0%}")  # fmt: skip
        p(f"  {'variant':<24}{'gpu':>10}{'':>8}{'natural':>10}{'':>8}{'host':>9}{'':>8}"
          f"{'min-max gpu':>16} bufs hid  records/step")  # fmt: skip
        for vname, r in summary.get(mode, {}).items():
            recs = " ".join(f"{k}={v:.1f}" for k, v in r["records_per_step"].items() if v)
            p(f"  {LABELS.get(vname, vname):<24}{r['gpu']:>10.1f}{_pct(r['gpu_overhead']):>8}"
              f"{r['natural']:>10.1f}{_pct(r['natural_overhead']):>8}{r['host']:>9.1f}"
              f"{_pct(r['host_overhead']):>8}{r['gpu_min']:>8.1f}-{r['gpu_max']:<7.1f}"
              f"{r['buffers_in_loop']:>5} {'y' if r['hidden'] else 'n':>3}  {recs}")  # fmt: skip
    ab = {v: r for v, r in summary.get("eager", {}).items() if "natural_ab_overheads" in r}
    if ab:
        p("  eager, interleaved in one process (session paused vs recording, ABBA blocks; "
          "natural): " + "; ".join(f"{LABELS.get(v, v)} {_pct(r['natural_ab_overhead'])} "
                                   f"(children {', '.join(_pct(x).strip() for x in r['natural_ab_overheads'])})"
                                   for v, r in ab.items()))  # fmt: skip
    gab = {v: r for v, r in summary.get("graph", {}).items() if "gpu_ab_overheads" in r}
    if gab:
        p("  graph, interleaved in one process (G replayed with the session paused vs "
          "recording, ABBA blocks; gpu): " + "; ".join(
              f"{LABELS.get(v, v)} recording {_pct(r['gpu_ab_overhead'])} over paused "
              f"(children {', '.join(_pct(x).strip() for x in r['gpu_ab_overheads'])}), "
              f"paused {_pct(r.get('paused_overhead'))} over off (G0, no session), "
              f"{r.get('paused_records_per_step', float('nan')):.1f} records per paused step"
              for v, r in gab.items()))  # fmt: skip
    c = summary.get("checks", {})
    p(f"  checks: off spread across children gpu {_pct(c.get('off_graph_gpu_spread'))}, eager "
      f"{_pct(c.get('off_eager_natural_spread'))}; {c.get('g_vs_g0_note', '')}")  # fmt: skip
    return w.getvalue()


def format_verdicts(results: dict) -> str:
    w = io.StringIO()
    for name, s in results.get("summaries", {}).items():
        for mode, v in s.get("verdicts", {}).items():
            if not s.get(mode):  # nothing measured (the children's errors are listed below)
                continue
            line = f"  verdict {name} {mode} ({v['figure']}): default"
            if "default" in v:
                line += f" {_pct(v['default'])} ({'ok' if v['ok'] else 'over'} {v['target']:.0%})"
            else:
                line += " not measured"
            if "best" in v:
                line += (f"; cheapest complete: {LABELS.get(v['best'], v['best'])} "
                         f"{_pct(v['best_overhead'])} ({'ok' if v['best_ok'] else 'over'})")  # fmt: skip
            if "interleaved" in v:
                line += (f"; interleaved in one process (paused vs recording): "
                         f"{_pct(v['interleaved'])} ({'ok' if v['interleaved_ok'] else 'over'})")  # fmt: skip
            print(line, file=w)
    for name, cs in results.get("cases", {}).items():
        for c in cs:
            if "error" in c:
                print(f"  verdict {name}/{c.get('variant')}: error: {c['error']}", file=w)
    return w.getvalue()


# ---------------------------------------------------------------------------------------------
# outer


def run_child(case: dict, args: argparse.Namespace, timeout: float) -> dict:
    """One child process; its stderr passes through, its last ``phase`` line is kept so that a
    crash names the phase it happened in."""
    from decodescope.tracer import capture as cap

    env = dict(os.environ)
    env.update(getattr(cap, "NO_MULTICAST_ENV", {}))  # as in capture children
    env.pop("NVTX_INJECTION64_PATH", None)
    if not args.no_inject:
        lib = cap.libcupti_path()
        if lib:
            env["NVTX_INJECTION64_PATH"] = lib
    cmd = [sys.executable, __file__, "--inner", json.dumps(case), "--blocks", str(args.blocks),
           "--block-ms", str(args.block_ms), "--eager-ab", str(args.eager_ab),
           "--graph-ab", str(args.graph_ab)]  # fmt: skip
    name = f"{case['name']}/{case['variant']}"
    last = {"phase": "start"}

    def relay(stream) -> None:
        for line in stream:
            sys.stderr.write(line)
            sys.stderr.flush()
            if " phase " in line and line.startswith(f"[{name}]"):
                last["phase"] = line.split(" phase ", 1)[1].strip()

    t = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    got: list[str] = []  # stdout, read by its own thread (stderr is the relay's alone)
    threads = [threading.Thread(target=relay, args=(proc.stderr,), daemon=True),
               threading.Thread(target=lambda: got.append(proc.stdout.read()), daemon=True)]  # fmt: skip
    for th in threads:
        th.start()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        for th in threads:
            th.join(5)
        return {"case": case["name"], "variant": case["variant"],
                "error": f"timed out after {timeout:.0f} s in phase: {last['phase']}"}  # fmt: skip
    for th in threads:
        th.join(5)
    lines = "".join(got).strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"case": case["name"], "variant": case["variant"],
                "error": f"exit {proc.returncode} in phase: {last['phase']}"}  # fmt: skip
    out = json.loads(lines[-1])
    out["process_s"] = time.perf_counter() - t
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workload", default="standard,specialized", help="standard,specialized,toy")
    ap.add_argument("--batch", default="1,64")
    ap.add_argument("--opt", action="append", default=[], help="workload option key=value")
    ap.add_argument("--variants", default="default",
                    help="comma-separated, each its own child per case: " + ", ".join(
                        v for v in VARIANTS if v != "off"))  # fmt: skip
    ap.add_argument("--rounds", type=int, default=1, help="children per case and variant")
    ap.add_argument("--blocks", type=int, default=3, help="off blocks and on blocks per child")
    ap.add_argument("--eager-ab", type=int, default=4,
                    help="after the on blocks: rounds of eager blocks with the session paused "
                         "and recording, interleaved ABBA (0: none)")  # fmt: skip
    ap.add_argument("--graph-ab", type=int, default=0,
                    help="after the eager A/B: rounds of graph replays with the session paused "
                         "and recording, interleaved ABBA: what a recording replay costs over a "
                         "paused one, and a paused one over no session (0: none)")  # fmt: skip
    ap.add_argument("--block-ms", type=float, default=25.0, help="ms of steps per figure")
    ap.add_argument("--budget-s", type=float, default=195.0, help="the whole run, seconds")
    ap.add_argument("--no-inject", action="store_true", help="no NVTX_INJECTION64_PATH")
    ap.add_argument("--attrs", default=None, help="CUPTI attributes: " + ", ".join(ATTRS))
    ap.add_argument("--out", default="benchmarks/results/capture_overhead_decode",
                    help="writes OUT.json and OUT.txt")  # fmt: skip
    ap.add_argument("--range-api", action="store_true")
    ap.add_argument("--inner", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.inner:
        try:
            res = inner(args)
        except Exception as e:  # before any block: the child fails alone, in one line
            import traceback

            traceback.print_exc()
            c = json.loads(args.inner)
            res = {"case": c.get("name"), "variant": c.get("variant"),
                   "error": f"{type(e).__name__}: {' '.join(str(e).split())}"[:400]}  # fmt: skip
        sys.stdout.flush()
        print(json.dumps(res, default=str), flush=True)
        return 0
    if args.range_api:
        res = range_api()
        with open(args.out + "_range_api.json", "w") as f:
            json.dump(res, f, indent=2)
        return 0
    try:
        variants = parse_variants(args.variants)
        attrs = parse_attrs(args.attrs)
        if args.rounds < 1 or args.blocks < 1:
            raise ValueError("--rounds and --blocks must be at least 1")
        if args.eager_ab < 0 or args.graph_ab < 0:
            raise ValueError("--eager-ab and --graph-ab must be 0 or more")
        cases = {
            f"{wl}-b{b}": {"name": f"{wl}-b{b}", "workload": wl,
                           "opts": workload_opts(wl, b, args.opt), "attrs": attrs}
            for b in args.batch.split(",") if b for wl in args.workload.split(",") if wl
        }  # fmt: skip
    except ValueError as e:
        ap.error(str(e))
    t0 = time.time()
    results: dict = {
        "argv": sys.argv[1:] if argv is None else argv,
        "design": "one child per case and variant: off blocks, then one session, never stopped",
        "inject": not args.no_inject,
        "attrs": attrs,
        "rounds": args.rounds,
        "blocks": args.blocks,
        "block_ms": args.block_ms,
        "cases": {n: [] for n in cases},
        "summaries": {},
    }
    plan = plan_children(list(cases), variants, args.rounds)
    took: dict[str, float] = {}  # workload -> seconds its slowest child took (b64 builds longer)
    for i, (r, name, v) in enumerate(plan):
        left = args.budget_s - (time.time() - t0)
        wl = cases[name]["workload"]
        need = took.get(wl, 20.0)
        if left < need + 5:
            log(f"child {i + 1}/{len(plan)} {name}/{v} round {r}: skipped (time budget: {left:.0f}"
                f" s left, a child of this case takes ~{need:.0f} s)")  # fmt: skip
            results["cases"][name].append({"case": name, "variant": v, "round": r,
                                           "error": "skipped: time budget"})  # fmt: skip
            continue
        log(f"child {i + 1}/{len(plan)} {name}/{v} round {r}: {left:.0f} s left in the budget")
        t = time.time()
        child = run_child({**cases[name], "variant": v, "round": r}, args, max(20.0, left - 2))
        took[wl] = max(took.get(wl, 0.0), time.time() - t)
        child.setdefault("round", r)
        results["cases"][name].append(child)
        results["summaries"][name] = summarize_case(results["cases"][name])
        _write(args.out, results, _report(results))  # as it goes
    text = _report(results)
    print(text, flush=True)
    results["total_s"] = time.time() - t0
    _write(args.out, results, text)
    print(f"  total {results['total_s']:.0f} s -> {args.out}.json, {args.out}.txt")
    return 0


def _report(results: dict) -> str:
    text = "".join(
        format_case(n, cs, results["summaries"].get(n, {}))
        for n, cs in results["cases"].items()
        if cs
    )
    return text + "\n" + format_verdicts(results)


def _write(out: str, results: dict, text: str) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    for suffix, data in ((".json", json.dumps(results, indent=1, default=str)), (".txt", text)):
        tmp = out + suffix + ".tmp"
        with open(tmp, "w") as f:
            f.write(data)
        os.replace(tmp, out + suffix)


def range_api(n: int = 200_000) -> dict:
    """ns per ``with range(...)`` with no tool attached (what every workload pays when idle)."""
    from decodescope.tracer import range as trange

    def loop_empty() -> float:
        t = time.perf_counter_ns()
        for _ in range(n):
            pass
        return (time.perf_counter_ns() - t) / n

    def loop_range() -> float:
        t = time.perf_counter_ns()
        for _ in range(n):
            with trange("layer.3.attn.qkv_proj"):
                pass
        return (time.perf_counter_ns() - t) / n

    @trange("step")
    def f() -> None:
        pass

    def loop_deco() -> float:
        t = time.perf_counter_ns()
        for _ in range(n):
            f()
        return (time.perf_counter_ns() - t) / n

    class _Trivial:
        __slots__ = ()

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return None

    def loop_trivial() -> float:
        t = time.perf_counter_ns()
        for _ in range(n):
            with _Trivial():
                pass
        return (time.perf_counter_ns() - t) / n

    base = min(loop_empty() for _ in range(5))
    trivial = min(loop_trivial() for _ in range(5)) - base
    with_range = min(loop_range() for _ in range(5))
    deco = min(loop_deco() for _ in range(5))
    import decodescope.tracer.ranges as R

    res = {
        "nvtx_package": R._nvtx is not None,
        "nvtx_injection": os.environ.get("NVTX_INJECTION64_PATH"),
        "ns_per_range": with_range - base,
        "ns_per_decorated_call": deco - base,
        "ns_per_trivial_with": trivial,
    }
    print(f"range API, no tool attached: {res['ns_per_range']:.0f} ns per `with range()`, "
          f"{res['ns_per_decorated_call']:.0f} ns per decorated call; an empty `with` of a trivial "
          f"class costs {trivial:.0f} ns here (nvtx package: {res['nvtx_package']})")  # fmt: skip
    return res


if __name__ == "__main__":
    code = 1
    with contextlib.suppress(BrokenPipeError):
        code = main()
    sys.stdout.flush()
    if "--inner" in sys.argv:
        # CUPTI may still call into Python at interpreter teardown: leave at once (all written)
        os._exit(code)
    sys.exit(code)
