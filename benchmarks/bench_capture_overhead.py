"""What the capture costs: the same decode step with and without a CUPTI session.

    python benchmarks/bench_capture_overhead.py [--workload toy] [--opt k=v ...]
        [--replays 200] [--repeats 7] [--out overhead.json]
    python benchmarks/bench_capture_overhead.py --range-api      # CPU: the range API alone

Each configuration (graph | eager) x (capture off | on) runs in its own process (CUPTI is
per process); per-step time is GPU time of ``replays`` back-to-back steps between two CUDA
events, median over ``repeats``. The capture-on process starts the session exactly as the
capture child does (launch callbacks, graph-node callbacks, kernel/memop/marker/overhead
activity) and NVTX_INJECTION64_PATH names its libcupti. Targets (issue 3): graph <= 2%,
eager <= 10%. Prints a table; writes JSON.
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


def inner(args: argparse.Namespace) -> None:
    session = None
    if args.capture:
        from decodescope.tracer.capture import Session

        session = Session(
            tempfile.mkdtemp(prefix="ds-bench-"), launch_records=args.launch_records
        ).start()
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
    if args.inner == "graph":
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g), trange("step"):
            wl.step()

        def one() -> None:
            g.replay()
    else:

        def one() -> None:
            with trange("step"):
                wl.step()

    for _ in range(20):
        one()
    torch.cuda.synchronize()
    per_step = []
    host = []
    for _ in range(args.repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        a.record()
        for _ in range(args.replays):
            one()
        b.record()
        host.append((time.perf_counter() - t) / args.replays * 1e6)
        b.synchronize()
        per_step.append(a.elapsed_time(b) * 1e3 / args.replays)
        if session is not None:
            session.discard(keep=())  # keep the buffers from growing between repeats
    dropped = launches = 0
    if session is not None:
        session.stop()
        from decodescope.tracer.capture import read_chunks

        raw = read_chunks(session.out)
        counts = raw["count"].to_pylist() if "count" in raw else []
        dropped = sum(r["value"] for r in counts if r["name"] == "dropped_records")
        launches = raw["launch"].num_rows if "launch" in raw else 0
    print(
        json.dumps(
            {
                "per_step_us": per_step,
                "host_us": host,
                "dropped": dropped,
                "launch_rows_last_repeat": launches,
            }
        )
    )


def run_config(
    mode: str, capture: bool, args: argparse.Namespace, launch_records: str = "callback"
) -> dict:
    env = dict(os.environ)
    if capture:
        from decodescope.tracer.capture import libcupti_path

        lib = libcupti_path()
        if lib:
            env["NVTX_INJECTION64_PATH"] = lib
    else:
        env.pop("NVTX_INJECTION64_PATH", None)
    cmd = [sys.executable, __file__, "--inner", mode, "--capture", str(int(capture)), "--workload", args.workload,
           "--replays", str(args.replays), "--repeats", str(args.repeats), "--launch-records", launch_records]  # fmt: skip
    for o in args.opt:
        cmd += ["--opt", o]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        tail = " | ".join(r.stderr.strip().splitlines()[-4:])
        return {"error": f"exit {r.returncode}: {tail}"}
    return json.loads(r.stdout.strip().splitlines()[-1])


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


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workload", default="toy")
    ap.add_argument("--opt", action="append", default=[])
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--modes", default="graph,eager")
    ap.add_argument("--out", default=None)
    ap.add_argument("--range-api", action="store_true")
    ap.add_argument("--inner", choices=["graph", "eager"], help=argparse.SUPPRESS)
    ap.add_argument("--capture", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument(
        "--launch-records",
        default="callback",
        help="callback (a Python callback per launch API call, the default) | activity (native API "
        "records of the launch APIs only) | both (measure each)",
    )
    args = ap.parse_args()
    if args.inner:
        inner(args)
        return
    if args.range_api:
        res = range_api()
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=2)
        return
    results = {
        "workload": args.workload,
        "opts": args.opt,
        "replays": args.replays,
        "repeats": args.repeats,
        "modes": {},
    }
    variants = ["callback", "activity"] if args.launch_records == "both" else [args.launch_records]
    print(
        f"{'mode':<16} {'capture off us':>15} {'capture on us':>14} {'overhead':>9} {'target':>7}  verdict"
    )
    for mode in args.modes.split(","):
        off = run_config(mode, False, args)
        for i, lr in enumerate(variants):
            key = mode if i == 0 else f"{mode}/{lr}"
            label = f"{mode} ({lr})"
            on = run_config(mode, True, args, lr)
            row = {"off": off, "on": on, "launch_records": lr}
            if "error" in off or "error" in on:
                row["verdict"] = "error"
                print(f"{label:<16} {'error':>15}  {off.get('error') or on.get('error')}")
            else:
                a, b = statistics.median(off["per_step_us"]), statistics.median(on["per_step_us"])
                ov = b / a - 1
                row.update(
                    off_us=a,
                    on_us=b,
                    overhead=ov,
                    target=TARGETS[mode],
                    verdict="ok" if ov <= TARGETS[mode] else "over",
                )
                print(f"{label:<16} {a:>15.2f} {b:>14.2f} {ov:>8.1%} {TARGETS[mode]:>7.0%}  {row['verdict']}"
                      f"  (host {statistics.median(off['host_us']):.1f} / {statistics.median(on['host_us']):.1f} us,"
                      f" dropped {on.get('dropped', 0)}, launch rows {on.get('launch_rows_last_repeat')})")  # fmt: skip
            results["modes"][key] = row
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
        print(f"-> {args.out}")


if __name__ == "__main__":
    main()
