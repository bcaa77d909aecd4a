"""What the capture costs, part by part: the same decode step with and without a CUPTI session.

    python benchmarks/bench_capture_overhead.py [--workload toy] [--opt k=v ...] [--quick]
        [--variants off,kernel,launch_cb,graph_nodes,markers,all,all_activity] [--out overhead.json]
    python benchmarks/bench_capture_overhead.py --range-api      # CPU: the range API alone

Every variant runs in its own process (CUPTI is per process) and measures both modes there:

- ``off``           no session, no NVTX injection (the baseline)
- ``kernel``        (a) CONCURRENT_KERNEL activity only
- ``launch_cb``     (b) + Python callbacks on the launch APIs (cudaLaunchKernel*, cuLaunchKernel*,
                    cudaGraphLaunch*, ...): what correlates an eager kernel with its thread/time
- ``graph_nodes``   (c) + RESOURCE GRAPHNODE_CREATED / CLONED callbacks
- ``markers``       (d) + MARKER + MARKER_DATA, NVTX_INJECTION64_PATH naming cupti's libcupti
- ``all``           (e) everything the capture enables by default (+ MEMCPY, MEMSET, OVERHEAD)
- ``all_activity``  (f) as (e) but launches recorded as native API activity records (no Python
                    on the launch path) instead of callbacks

Three figures per mode (medians over repeats):

- ``gpu``: per step of N steps enqueued behind a long spin kernel (``torch.cuda._sleep``) and
  timed with CUDA events after the spin: pure GPU execution, host launch cost hidden (flagged
  ``hidden=False`` when the host needed longer than the spin to enqueue). For CUDA-graph mode
  this is what a layer span sees, so the graph verdict is on it (target <= 2%).
- ``host``: host time per step (``g.replay()`` or one eager step) while the GPU is busy with the
  spin (no back-pressure): the launch-side cost, printed plainly.
- ``natural``: N steps back to back, CUDA events around them (the old figure; host-bound steps
  show the host cost here). The eager verdict is on it (target <= 10%): eager layer spans
  include launch gaps.

Also per variant: launch rows recorded per step, buffers CUPTI completed during the timed loops
(should be 0: 64 MB buffers, no flush inside), and time spent in the buffer callback. Prints one
table; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

TARGETS = {"graph": 0.02, "eager": 0.10}
VERDICT_ON = {"graph": "gpu", "eager": "natural"}

# variant -> Session options (None: no session); "inject": NVTX_INJECTION64_PATH set
VARIANTS: dict[str, dict | None] = {
    "off": None,
    "kernel": {"kinds": ["CONCURRENT_KERNEL"], "launch_records": "none", "graph_nodes": False},
    "launch_cb": {"kinds": ["CONCURRENT_KERNEL"], "launch_records": "callback", "graph_nodes": False},
    "graph_nodes": {"kinds": ["CONCURRENT_KERNEL"], "launch_records": "callback", "graph_nodes": True},
    "markers": {"kinds": ["CONCURRENT_KERNEL", "MARKER", "MARKER_DATA"], "launch_records": "callback",
                "graph_nodes": True, "inject": True},
    "all": {"launch_records": "callback", "inject": True},
    "all_activity": {"launch_records": "activity", "inject": True},
}  # fmt: skip
LABELS = {
    "off": "off",
    "kernel": "(a) kernel only",
    "launch_cb": "(b) + launch cb",
    "graph_nodes": "(c) + graph nodes",
    "markers": "(d) + markers/NVTX",
    "all": "(e) all (default)",
    "all_activity": "(f) all, launch=activity",
}
DEFAULT_VARIANT = "all"


# ---------------------------------------------------------------------------------------------
# inner: one process, one variant, both modes


def _counts(session) -> dict:
    if session is None:
        return {}
    with session._lock:
        return {
            "buffers": session.counts.get("buffers_completed", 0),
            "callback_ns": session.counts.get("buffer_callback_ns", 0),
            "launch_rows": len(session._launch),
        }


def _delta(a: dict, b: dict) -> dict:
    return {k: b.get(k, 0) - a.get(k, 0) for k in b}


def _measure(torch, one, n_nat: int, n_gpu: int, repeats: int, cyc_per_us: float, session) -> dict:
    """natural / gpu / host figures for one step function (see the module docstring)."""
    for _ in range(10):
        one()
    torch.cuda.synchronize()
    c0 = _counts(session)
    natural, nat_host = [], []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        a.record()
        for _ in range(n_nat):
            one()
        b.record()
        nat_host.append((time.perf_counter() - t) / n_nat * 1e6)
        b.synchronize()
        natural.append(a.elapsed_time(b) * 1e3 / n_nat)
    # spin long enough to hide the host's enqueue time of n_gpu steps (x3, + 2 ms)
    spin_us = 3 * statistics.median(nat_host) * n_gpu + 2000
    gpu, host, hidden = [], [], []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(spin_us * cyc_per_us))
        a.record()
        t = time.perf_counter()
        for _ in range(n_gpu):
            one()
        dt = time.perf_counter() - t
        b.record()
        b.synchronize()
        host.append(dt / n_gpu * 1e6)
        hidden.append(dt * 1e6 < 0.8 * spin_us)
        gpu.append(a.elapsed_time(b) * 1e3 / n_gpu)
    d = _delta(c0, _counts(session))
    steps = repeats * (n_nat + n_gpu)
    return {
        "natural_us": natural,
        "natural_host_us": nat_host,
        "gpu_us": gpu,
        "host_us": host,
        "hidden": all(hidden),
        "spin_us": spin_us,
        "steps_timed": steps,
        "launch_rows_per_step": d.get("launch_rows", 0) / steps if session else 0,
        "buffers_completed_timed": d.get("buffers", 0),
        "buffer_callback_ms_timed": d.get("callback_ns", 0) / 1e6,
    }


def inner(args: argparse.Namespace) -> None:
    opts_v = VARIANTS[args.inner]
    session = None
    if opts_v is not None:
        from decodescope.tracer.capture import Session

        kw = {k: v for k, v in opts_v.items() if k != "inject"}
        session = Session(tempfile.mkdtemp(prefix="ds-bench-"), **kw).start()
    import torch

    from decodescope.tracer import range as trange
    from decodescope.tracer.child import _find_workload

    opts = dict(kv.split("=", 1) for kv in args.opt)
    wl = _find_workload(args.workload)(**opts)
    if wl.refresh:
        wl.refresh()
    for _ in range(3):
        with trange("warmup"):
            wl.step()
    torch.cuda.synchronize()
    # spin-kernel clock: cycles per us
    torch.cuda._sleep(1000)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(20_000_000)
    b.record()
    b.synchronize()
    cyc_per_us = 20_000_000 / (a.elapsed_time(b) * 1e3)

    def eager_step() -> None:
        with trange("step"):
            wl.step()

    res: dict = {"variant": args.inner, "cycles_per_us": cyc_per_us}
    if "eager" in args.modes:
        res["eager"] = _measure(
            torch, eager_step, args.steps_eager, args.steps_eager_gpu, args.repeats, cyc_per_us,
            session,
        )  # fmt: skip
    if "graph" in args.modes:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            eager_step()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g), trange("step"):
            wl.step()
        torch.cuda.synchronize()
        res["graph"] = _measure(
            torch, g.replay, args.replays, args.replays_gpu, args.repeats, cyc_per_us, session
        )
    if session is not None:
        t = time.perf_counter()
        session.stop()
        res["stop_s"] = time.perf_counter() - t
        from decodescope.tracer.capture import read_chunks

        raw = read_chunks(session.out)
        counts = {r["name"]: r["value"] for r in raw["count"].to_pylist()} if "count" in raw else {}
        res["session"] = {
            "dropped": counts.get("dropped_records", 0),
            "buffers_completed": counts.get("buffers_completed", 0),
            "records": counts.get("records_delivered", 0),
            "callback_errors": counts.get("callback_errors", 0),
            "kernel_rows": raw["kernel"].num_rows if "kernel" in raw else 0,
            "marker_rows": raw["marker"].num_rows if "marker" in raw else 0,
            "launch_rows": raw["launch"].num_rows if "launch" in raw else 0,
            "errors": session.errors[:5],
        }
    print(json.dumps(res))


# ---------------------------------------------------------------------------------------------
# outer


def run_variant(variant: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ)
    env.pop("NVTX_INJECTION64_PATH", None)
    if (VARIANTS[variant] or {}).get("inject"):
        from decodescope.tracer.capture import libcupti_path

        lib = libcupti_path()
        if lib:
            env["NVTX_INJECTION64_PATH"] = lib
    cmd = [sys.executable, __file__, "--inner", variant, "--workload", args.workload,
           "--modes", args.modes, "--replays", str(args.replays), "--repeats", str(args.repeats),
           "--replays-gpu", str(args.replays_gpu),
           "--steps-eager", str(args.steps_eager), "--steps-eager-gpu", str(args.steps_eager_gpu)]  # fmt: skip
    for o in args.opt:
        cmd += ["--opt", o]
    t = time.perf_counter()
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout} s"}
    if r.returncode != 0:
        tail = " | ".join(r.stderr.strip().splitlines()[-3:])
        return {"error": f"exit {r.returncode}: {tail[-400:]}"}
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["process_s"] = time.perf_counter() - t
    return out


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(results: dict) -> dict:
    """Overheads of every variant against ``off``, and the verdicts on the default variant."""
    base = results["variants"].get("off", {})
    summary: dict = {}
    for mode in results["modes_measured"]:
        b = base.get(mode)
        rows = {}
        for v, r in results["variants"].items():
            m = r.get(mode)
            if not m:
                rows[v] = {"error": r.get("error", "not measured")}
                continue
            row = {f: _med(m[f"{f}_us"]) for f in ("natural", "gpu", "host")}
            if b:
                for f in ("natural", "gpu", "host"):
                    ref = _med(b[f"{f}_us"])
                    row[f"{f}_overhead"] = row[f] / ref - 1 if ref else float("nan")
            row.update(
                hidden=m["hidden"],
                launch_rows_per_step=m["launch_rows_per_step"],
                buffers_completed_timed=m["buffers_completed_timed"],
                buffer_callback_ms_timed=m["buffer_callback_ms_timed"],
            )
            rows[v] = row
        summary[mode] = rows
    modes = {}
    for mode in results["modes_measured"]:
        d = summary[mode].get(DEFAULT_VARIANT, {})
        f = VERDICT_ON[mode]
        ov = d.get(f"{f}_overhead")
        if ov is None:
            modes[mode] = {"verdict": "error", "figure": f}
            continue
        modes[mode] = {
            "figure": f,
            "off_us": summary[mode]["off"][f],
            "on_us": d[f],
            "overhead": ov,
            "target": TARGETS[mode],
            "verdict": "ok" if ov <= TARGETS[mode] else "over",
            "host_overhead": d.get("host_overhead"),
            "off_host_us": summary[mode]["off"]["host"],
            "on_host_us": d["host"],
        }
    return {"summary": summary, "modes": modes}


def _cell(row: dict, k: str, is_base: bool) -> str:
    ov = row.get(f"{k}_overhead")
    o = "" if ov is None or is_base else f" ({ov:+.1%})"
    return f"{row[k]:.1f}{o}"


def print_table(results: dict) -> None:
    s = results["summary"]
    for mode in results["modes_measured"]:
        f = VERDICT_ON[mode]
        print(f"\n  {mode}: us per step (overhead vs off); verdict on '{f}', target "
              f"{TARGETS[mode]:.0%}")  # fmt: skip
        print(f"  {'variant':<26} {'gpu':>17} {'host':>18} {'natural':>18} {'launch/step':>11} "
              f"{'bufs':>4} {'cb ms':>6} hidden")  # fmt: skip
        for v, row in s[mode].items():
            label = LABELS.get(v, v)
            if "error" in row:
                print(f"  {label:<26} error: {row['error']}")
                continue
            gpu, host, nat = (_cell(row, k, v == "off") for k in ("gpu", "host", "natural"))
            print(f"  {label:<26} {gpu:>17} {host:>18} {nat:>18} "
                  f"{row['launch_rows_per_step']:>11.1f} {row['buffers_completed_timed']:>4} "
                  f"{row['buffer_callback_ms_timed']:>6.1f} {row['hidden']}")  # fmt: skip
    print()
    for mode, m in results["modes"].items():
        if m.get("verdict") == "error":
            print(f"  verdict {mode}: error")
            continue
        print(f"  verdict {mode} ({m['figure']}): {m['off_us']:.1f} -> {m['on_us']:.1f} us, "
              f"{m['overhead']:+.1%} (target {m['target']:.0%}): {m['verdict']}; host per step "
              f"{m['off_host_us']:.1f} -> {m['on_host_us']:.1f} us")  # fmt: skip


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workload", default="toy")
    ap.add_argument("--opt", action="append", default=[])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--modes", default="graph,eager")
    ap.add_argument("--replays", type=int, default=100, help="graph replays per timed loop")
    ap.add_argument(
        "--replays-gpu", type=int, default=50,
        help="graph replays behind the spin (kept small: the launch queue must not fill)",
    )  # fmt: skip
    ap.add_argument("--steps-eager", type=int, default=50, help="eager steps per natural loop")
    ap.add_argument(
        "--steps-eager-gpu", type=int, default=10,
        help="eager steps behind the spin (kept small: the launch queue must not fill)",
    )  # fmt: skip
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="5 repeats (about 10-15 s a variant)")
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds per variant process")
    ap.add_argument("--out", default=None)
    ap.add_argument("--range-api", action="store_true")
    ap.add_argument("--inner", choices=list(VARIANTS), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats = min(args.repeats, 5)
    if args.inner:
        inner(args)
        return 0
    if args.range_api:
        res = range_api()
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=2)
        return 0
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    if "off" not in variants:
        variants.insert(0, "off")
    results: dict = {
        "workload": args.workload,
        "opts": args.opt,
        "replays": args.replays,
        "replays_gpu": args.replays_gpu,
        "steps_eager": args.steps_eager,
        "steps_eager_gpu": args.steps_eager_gpu,
        "repeats": args.repeats,
        "modes_measured": [m for m in args.modes.split(",") if m],
        "variants": {},
    }
    for v in variants:
        r = run_variant(v, args)
        results["variants"][v] = r
        msg = r.get("error") or f"{r.get('process_s', 0):.0f} s"
        se = r.get("session") or {}
        if se:
            msg += (f"; kernel rows {se.get('kernel_rows')}, markers {se.get('marker_rows')}, "
                    f"launch rows {se.get('launch_rows')}, buffers {se.get('buffers_completed')}, "
                    f"dropped {se.get('dropped')}, callback errors {se.get('callback_errors')}, "
                    f"stop {r.get('stop_s', 0):.2f} s")  # fmt: skip
            for e in se.get("errors") or []:
                msg += f"\n      note: {e}"
        print(f"  {LABELS.get(v, v)}: {msg}", flush=True)
    results.update(summarize(results))
    print_table(results)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2, default=str)
        print(f"  -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
