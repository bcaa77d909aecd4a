"""Every GPU check of the capture (issue 3) in one call, for the H200.

    python scripts/gpu_capture.py --out OUT [--only a,b] [--skip a,b] [--quick]

Steps (each isolated: one failing step never stops the others; each has its own timeout):

  env         versions, the libcupti NVTX must inject, cupti-python names the session uses
  eager       toy workload, 20 eager steps: every op of both layers has kernels, every step alike
  eager_activity  the same with launch records from native per-API activity records
              (activity_enable_runtime_api / _driver_api for the launch cbids; no Python callback)
  graph       toy workload captured once, replayed 50 times: every replay's kernels in the right
              layer and op (graph-node map), 50 steps numbered, the same kernels per op as eager
  cli         `decodescope capture --workload toy --graph` end to end (the CLI path)
  program     `decodescope capture -- python prog.py`: a program's own NVTX ranges
              (torch.cuda.nvtx, the nvtx package) attribute its eager and graph kernels
  modules     `--modules` on a small nn.Module program: module paths as ranges, graph too
  cuda_error  a program that hits a device-side assert: partial run, one clear line
  hang        a program that hangs after GPU work: stopped at the timeout, partial run with the
              kernels flushed before the hang
  validate    the toy eager run against torch.profiler (Kineto) in a separate process
  overhead    benchmarks/bench_capture_overhead.py --workload toy: default capture vs off,
              GPU-side, host-side and natural figures (graph verdict on GPU-side <= 2%, eager on natural <= 10%)
  chrome      Chrome-trace export of the graph run (open in ui.perfetto.dev)

Writes OUT/runs/<step>/ (run folders; toy_eager and toy_graph are the small real runs for
data/runs/), OUT/logs/<step>.txt, OUT/results.json, and prints a table at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import textwrap
import time
import traceback
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS = [
    "env",
    "eager",
    "graph",
    "cli",
    "program",
    "modules",
    "cuda_error",
    "hang",
    "validate",
    "overhead",
    "chrome",
]
REQUIRED_CUPTI = [
    "activity_register_callbacks", "activity_enable", "activity_disable", "activity_flush_all",
    "activity_flush_period", "activity_get_num_dropped_records", "subscribe", "unsubscribe",
    "enable_callback", "get_timestamp", "get_graph_node_id", "set_thread_id_type", "ResourceData",
    "GraphData", "CallbackData", "ActivityKind", "ActivityFlag", "CallbackDomain",
    "CallbackIdResource", "ApiCallbackSite", "ActivityThreadIdType",
]  # fmt: skip
# names that changed between cupti-python releases: any one of each group will do
# (13.0.1 on the H200 spells the cbid enums runtime_api_trace_cbid / driver_api_trace_cbid)
REQUIRED_CUPTI_ANY = [
    ("RuntimeApiTraceCbid", "runtime_api_trace_cbid"),
    ("DriverApiTraceCbid", "driver_api_trace_cbid"),
]


class Ctx:
    def __init__(self, out: Path, quick: bool) -> None:
        self.out = out
        self.quick = quick
        self.runs = out / "runs"
        self.logs = out / "logs"
        self.progs = out / "progs"
        for d in (self.runs, self.logs, self.progs):
            d.mkdir(parents=True, exist_ok=True)
        self.results: dict[str, dict] = {}
        self.shared: dict[str, object] = {}


def ov(run) -> dict[str, int]:
    return {r["kind"]: r["count"] for r in run.overheads.to_pylist() if r["count"] is not None}


def toy_expected() -> list[str]:
    from decodescope.kernels.toy import reference_ops

    return [name for _, _, name, _ in reference_ops(2)]


def capture(ctx: Ctx, name: str, spec: dict, *, command=None, timeout=300):
    from decodescope.tracer.capture import run_capture

    t = time.time()
    res = run_capture(
        spec, out=ctx.runs / name, timeout=timeout, command=command, keep_child_dir=False
    )
    print(f"  capture {name}: {time.time() - t:.1f} s, ok={res.ok}, rc={res.returncode}, "
          f"{res.run.kernels.num_rows} kernels, {res.run.ranges.num_rows} ranges, "
          f"dropped={res.run.meta.dropped_records}")  # fmt: skip
    if res.message:
        print(f"  message: {res.message}")
    if res.stderr_tail:
        print("  child stderr (tail):\n    " + "\n    ".join(res.stderr_tail[-25:]))
    notes = ctx.runs / name / "capture-notes.txt"
    if notes.exists():
        print("  session notes:\n    " + "\n    ".join(notes.read_text().splitlines()[:20]))
    return res


def per_op_table(run) -> str:
    """op -> kernels per step, kernel names, launch APIs (from the first step)."""
    from decodescope.tracer.validate import attributed, leaf

    k = attributed(run).kernels.to_pylist()
    steps = sorted({x["step"] for x in k if x["step"] is not None})
    if not steps:
        return "  (no steps)"
    first = [x for x in k if x["step"] == steps[0]]
    rows: dict[str, list] = {}
    for x in first:
        r = rows.setdefault(leaf(x["range_path"]), [0, Counter(), Counter()])
        r[0] += 1
        r[1][(x["name"] or "")[:60]] += 1
        r[2][x["launch_api"] or "-"] += 1
    lines = [f"  {'range':<28} {'n':>3}  {'launch api':<34} kernels"]
    for op, (n, names, apis) in rows.items():
        lines.append(f"  {op:<28} {n:>3}  {','.join(apis):<34} {'; '.join(names)}")
    return "\n".join(lines)


# --- steps ----------------------------------------------------------------------------------


def step_env(ctx: Ctx) -> tuple[bool, str]:
    from importlib.metadata import version

    from decodescope.tracer.capture import libcupti_path

    info = {}
    for pkg in (
        "torch",
        "triton",
        "cupti-python",
        "nvtx",
        "nvidia-cutlass-dsl",
        "cuda-bindings",
        "cuda-pathfinder",
    ):
        try:
            info[pkg] = version(pkg)
        except Exception:
            info[pkg] = None
    import torch
    from cupti import cupti

    info["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    info["libcupti"] = libcupti_path()
    info["NVTX_INJECTION64_PATH (parent env)"] = os.environ.get("NVTX_INJECTION64_PATH")
    from decodescope.tracer.capture import (
        DRIVER_LAUNCH_PREFIXES,
        RUNTIME_LAUNCH_PREFIXES,
        _members,
        launch_cbids,
    )

    missing = [n for n in REQUIRED_CUPTI if not hasattr(cupti, n)]
    missing += ["|".join(g) for g in REQUIRED_CUPTI_ANY if not any(hasattr(cupti, n) for n in g)]
    info["cupti_missing"] = missing
    info["cbid_enums"] = [n for g in REQUIRED_CUPTI_ANY for n in g if hasattr(cupti, n)]
    rt = launch_cbids(_members(cupti, *REQUIRED_CUPTI_ANY[0]), RUNTIME_LAUNCH_PREFIXES)
    drv = launch_cbids(_members(cupti, *REQUIRED_CUPTI_ANY[1]), DRIVER_LAUNCH_PREFIXES)
    info["launch_apis"] = sorted(set(rt.values()) | set(drv.values()))
    if not rt or not drv:
        missing.append("launch cbids (runtime and driver)")
    try:
        info["GRAPHNODE_CREATED"] = int(cupti.CallbackIdResource.GRAPHNODE_CREATED)
        info["flush_forced"] = int(cupti.ActivityFlag.FLUSH_FORCED)
    except Exception as e:
        info["enum_error"] = repr(e)
    for k, v in info.items():
        print(f"  {k}: {v}")
    ctx.shared["env"] = info
    ok = not missing and info["gpu"] is not None and info["libcupti"] is not None
    return ok, f"gpu={info['gpu']}, cupti-python={info['cupti-python']}, missing={missing}"


def step_eager(ctx: Ctx) -> tuple[bool, str]:
    from decodescope.tracer.validate import check_attribution

    res = capture(ctx, "toy_eager", {"workload": "toy", "graph": False, "steps": 20, "warmup": 3})
    run = res.run
    print(per_op_table(run))
    chk = check_attribution(run, toy_expected())
    o = ov(run)
    ranges_ok = run.ranges.num_rows > 0
    nolaunch = o.get("kernels_without_launch", 0)
    print(f"  check: {chk['problems'] or 'all ops present, steps alike'}; kernels/step={chk['kernels_per_step']}, "
          f"ranges={run.ranges.num_rows}, kernels_without_launch={nolaunch}")  # fmt: skip
    ctx.shared["eager_per_op"] = chk["per_op"]
    ok = (
        res.ok
        and chk["ok"]
        and ranges_ok
        and nolaunch == 0
        and (run.meta.dropped_records or 0) == 0
    )
    return (
        ok,
        f"{chk['steps']} steps x {chk['kernels_per_step']} kernels; NVTX ranges={run.ranges.num_rows}; {chk['problems']}",
    )


def step_eager_activity(ctx: Ctx) -> tuple[bool, str]:
    from decodescope.tracer.validate import check_attribution

    spec = {
        "workload": "toy",
        "graph": False,
        "steps": 20,
        "warmup": 3,
        "launch_records": "activity",
    }
    res = capture(ctx, "toy_eager_activity", spec)
    run = res.run
    print(per_op_table(run))
    chk = check_attribution(run, toy_expected())
    nolaunch = ov(run).get("kernels_without_launch", 0)
    print(
        f"  check: {chk['problems'] or 'all ops present, steps alike'}; kernels_without_launch={nolaunch}"
    )
    ok = res.ok and chk["ok"] and nolaunch == 0
    return (
        ok,
        f"{chk['steps']} steps x {chk['kernels_per_step']} kernels; kernels_without_launch={nolaunch}; {chk['problems']}",
    )


def _graph_checks(run, steps: int) -> tuple[bool, str, dict]:
    from decodescope.tracer.validate import check_attribution

    print(per_op_table(run))
    chk = check_attribution(run, toy_expected())
    o = ov(run)
    k = run.kernels
    graph_k = k.num_rows - k.column("graph_node_id").null_count
    unmapped = o.get("graph_kernels_unmapped", 0)
    eager = _shared.get("eager_per_op")
    same = None
    if eager:
        same = {op: len(v) for op, v in chk["per_op"].items()} == {
            op: len(v) for op, v in eager.items()
        }
        if not same:
            print(
                f"  per-op counts differ from eager:\n    graph {chk['per_op']}\n    eager {eager}"
            )
    print(f"  check: {chk['problems'] or 'every replay attributed'}; graph kernels={graph_k}/{k.num_rows}, "
          f"unmapped={unmapped}, steps={chk['steps']}, same per-op counts as eager={same}")  # fmt: skip
    # same-as-eager is informative only: cuBLAS may pick other kernels under capture
    ok = chk["ok"] and unmapped == 0 and graph_k == k.num_rows and chk["steps"] == steps
    return (
        ok,
        f"{chk['steps']} replays x {chk['kernels_per_step']} kernels, unmapped={unmapped}, same-as-eager={same}; {chk['problems']}",
        chk,
    )


_shared: dict = {}


def step_graph(ctx: Ctx) -> tuple[bool, str]:
    _shared.update(ctx.shared)
    res = capture(ctx, "toy_graph", {"workload": "toy", "graph": True, "steps": 50, "warmup": 3})
    ok, detail, _ = _graph_checks(res.run, 50)
    return ok and res.ok, detail


def step_cli(ctx: Ctx) -> tuple[bool, str]:
    from decodescope.tracer import read_run

    out = ctx.runs / "cli_toy_graph"
    cmd = [sys.executable, "-m", "decodescope.ui.cli", "capture", "--workload", "toy", "--graph", "--steps", "10",
           "--out", str(out), "--timeout", "300"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    print(textwrap.indent(r.stdout + r.stderr, "  "))
    if r.returncode != 0:
        return False, f"exit {r.returncode}"
    _shared.update(ctx.shared)
    ok, detail, _ = _graph_checks(read_run(out), 10)
    return ok, detail


PROG_NVTX = """
import torch, nvtx
x = torch.randn(1, 512, device="cuda"); w = torch.randn(512, 512, device="cuda")
def body():
    torch.cuda.nvtx.range_push("blockA")
    y = x @ w
    torch.cuda.nvtx.range_pop()
    with nvtx.annotate("blockB", domain="myapp"):
        z = torch.relu(y) + 1
    return z
for _ in range(3):
    torch.cuda.nvtx.range_push("eager_iter"); body(); torch.cuda.nvtx.range_pop()
torch.cuda.synchronize()
s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    body()
torch.cuda.current_stream().wait_stream(s)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    torch.cuda.nvtx.range_push("captured"); body(); torch.cuda.nvtx.range_pop()
for _ in range(10):
    g.replay()
torch.cuda.synchronize()
print("program done")
"""

PROG_MODULES = """
import torch
class Attn(torch.nn.Module):
    def __init__(s): super().__init__(); s.q = torch.nn.Linear(256, 256); s.o = torch.nn.Linear(256, 256)
    def forward(s, x): return s.o(torch.relu(s.q(x)))
class Layer(torch.nn.Module):
    def __init__(s): super().__init__(); s.self_attn = Attn(); s.mlp = torch.nn.Linear(256, 256)
    def forward(s, x): return x + s.mlp(s.self_attn(x))
class Model(torch.nn.Module):
    def __init__(s): super().__init__(); s.layers = torch.nn.ModuleList([Layer(), Layer()])
    def forward(s, x):
        for l in s.layers: x = l(x)
        return x
m = Model().cuda(); x = torch.randn(1, 256, device="cuda")
with torch.no_grad():
    for _ in range(3): m(x)
    torch.cuda.synchronize()
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s): m(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g): y = m(x)
    for _ in range(5): g.replay()
torch.cuda.synchronize()
"""

PROG_CUDA_ERROR = """
import torch
a = torch.zeros(4, device="cuda")
b = a * 2
torch.cuda.synchronize()
idx = torch.tensor([10], device="cuda")
c = a[idx]
torch.cuda.synchronize()
print("unreachable")
"""

PROG_HANG = """
import time, torch
a = torch.randn(1024, 1024, device="cuda")
for _ in range(50):
    a = a @ a / 1024
torch.cuda.synchronize()
print("gpu work done, now hanging", flush=True)
time.sleep(3600)
"""


def _prog(ctx: Ctx, name: str, text: str) -> str:
    p = ctx.progs / f"{name}.py"
    p.write_text(text)
    return str(p)


def step_program(ctx: Ctx) -> tuple[bool, str]:
    from decodescope.tracer.validate import attributed

    res = capture(
        ctx,
        "program_nvtx",
        {"program": True},
        command=["python", _prog(ctx, "prog_nvtx", PROG_NVTX)],
        timeout=300,
    )
    run = attributed(res.run)
    k = run.kernels.to_pylist()
    graph = [x for x in k if x["graph_node_id"] is not None]
    eager = [x for x in k if x["graph_node_id"] is None]
    gp = Counter(x["range_path"] for x in graph)
    ep = Counter(x["range_path"] for x in eager)
    print(f"  graph kernel paths: {dict(gp)}\n  eager kernel paths: {dict(ep)}")
    names = Counter((r["domain"], r["name"]) for r in run.ranges.to_pylist())
    print(f"  ranges: {dict(names)}")
    g_ok = bool(graph) and all(
        p and p.startswith("captured/") and p.split("/")[-1] in ("blockA", "blockB") for p in gp
    )
    e_ok = any(p and p.endswith("blockA") for p in ep) and any(
        p and p.endswith("blockB") for p in ep
    )
    ok = res.ok and g_ok and e_ok and len(graph) >= 10
    return (
        ok,
        f"{len(graph)} graph kernels under captured/blockA|blockB={g_ok}; eager under blockA/blockB={e_ok}",
    )


def step_modules(ctx: Ctx) -> tuple[bool, str]:
    from decodescope.tracer.validate import attributed

    cmd = ["python", _prog(ctx, "prog_modules", PROG_MODULES)]
    from decodescope.tracer.capture import run_capture

    res = run_capture(
        {"program": True, "modules": True},
        out=ctx.runs / "program_modules",
        timeout=300,
        command=cmd,
    )
    print(f"  ok={res.ok} message={res.message} kernels={res.run.kernels.num_rows}")
    run = attributed(res.run)
    k = run.kernels.to_pylist()
    graph = [x for x in k if x["graph_node_id"] is not None]
    paths = Counter(x["range_path"] for x in graph)
    print(f"  graph kernel paths: {dict(paths)}")
    ok = res.ok and bool(graph) and all(p and "model.layers." in p for p in paths)
    return ok, f"{len(graph)} graph kernels, all under model.layers.* = {ok}"


def step_cuda_error(ctx: Ctx) -> tuple[bool, str]:
    t = time.time()
    res = capture(
        ctx,
        "cuda_error",
        {"program": True},
        command=["python", _prog(ctx, "prog_cuda_error", PROG_CUDA_ERROR)],
        timeout=120,
    )
    dt = time.time() - t
    ok = (not res.ok) and res.run.meta.partial and res.message is not None and dt < 150
    return ok, f"{dt:.0f} s; message: {res.message}"


def step_hang(ctx: Ctx) -> tuple[bool, str]:
    t = time.time()
    res = capture(
        ctx,
        "hang",
        {"program": True},
        command=["python", _prog(ctx, "prog_hang", PROG_HANG)],
        timeout=45,
    )
    dt = time.time() - t
    n = res.run.kernels.num_rows
    ok = (not res.ok) and res.run.meta.partial and dt < 90 and n >= 50
    return ok, f"{dt:.0f} s; {n} kernels flushed before the hang; message: {res.message}"


def step_validate(ctx: Ctx) -> tuple[bool, str]:
    from decodescope.tracer.validate import validate_against_kineto

    run_dir = ctx.runs / "toy_eager"
    if not run_dir.exists():
        return False, "no toy_eager run (eager step failed?)"
    s = validate_against_kineto(run_dir, {"workload": "toy", "steps": 20, "warmup": 3})
    print(json.dumps(s, indent=2, default=str)[:4000])
    return bool(s.get("ok")), (
        f"per-layer counts equal={s['counts_equal']}; {s['kernels_within_tolerance']}/{s['kernels_compared']} kernels "
        f"within 5%, median ratio {s['median_ratio']}"
    )


def step_overhead(ctx: Ctx) -> tuple[bool, str]:
    """benchmarks/bench_capture_overhead.py on the toy step (one child per variant: off blocks,
    then one session); verdicts: graph on GPU-side time (target 2%), eager on natural (10%)."""
    out = ctx.out / "overhead"
    bench = str(ROOT / "benchmarks" / "bench_capture_overhead.py")
    budget = "90" if ctx.quick else "180"
    r = subprocess.run([sys.executable, bench, "--workload", "toy", "--batch", "1", "--budget-s", budget,
                        "--out", str(out)], capture_output=True, text=True, timeout=600)  # fmt: skip
    print(textwrap.indent(r.stdout + r.stderr[-3000:], "  "))
    js = out.with_suffix(".json")
    if not js.exists():
        return False, f"benchmark exit {r.returncode}"
    res = json.loads(js.read_text())
    parts, ok = [], True
    for name, summ in res.get("summaries", {}).items():
        for mode, v in summ.get("verdicts", {}).items():
            if "default" not in v:
                parts.append(f"{name} {mode}: not measured")
                ok = False
                continue
            parts.append(f"{name} {mode} ({v['figure']}): {v['default']:+.1%} "
                         f"({'ok' if v['ok'] else 'over'} {v['target']:.0%})")  # fmt: skip
            ok = ok and bool(v["ok"])
    errors = [c for cs in res.get("cases", {}).values() for c in cs if c.get("error")]
    parts += [f"{c.get('variant')}: error: {c['error']}" for c in errors]
    return ok and bool(parts) and not errors, "; ".join(parts) or "no verdicts"


def step_chrome(ctx: Ctx) -> tuple[bool, str]:
    from decodescope.tracer import read_run
    from decodescope.tracer.chrome import write_chrome_trace

    src = ctx.runs / "toy_graph"
    if not src.exists():
        return False, "no toy_graph run"
    out = ctx.out / "toy_graph.trace.json.gz"
    n = write_chrome_trace(read_run(src), out)
    return n > 0, f"{n} events -> {out.name} ({out.stat().st_size // 1024} KiB)"


# --- driver -----------------------------------------------------------------------------------


class Tee(io.TextIOBase):
    def __init__(self, *streams):
        self.streams = streams

    def write(self, s):
        for st in self.streams:
            st.write(s)
            st.flush()
        return len(s)

    def flush(self):
        for st in self.streams:
            st.flush()


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default="")
    ap.add_argument("--skip", default="")
    ap.add_argument("--quick", action="store_true", help="shorter overhead benchmark")
    args = ap.parse_args()
    ctx = Ctx(Path(args.out).resolve(), args.quick)
    only = [s for s in args.only.split(",") if s]
    skip = {s for s in args.skip.split(",") if s}
    todo = [s for s in STEPS if (not only or s in only) and s not in skip]
    t0 = time.time()
    for name in todo:
        fn = globals()[f"step_{name}"]
        print(f"\n=== {name} ===", flush=True)
        log = open(ctx.logs / f"{name}.txt", "w")  # noqa: SIM115
        t = time.time()
        with contextlib.redirect_stdout(Tee(sys.__stdout__, log)):
            try:
                ok, detail = fn(ctx)
            except Exception as e:
                traceback.print_exc(file=sys.stdout)
                ok, detail = False, f"{type(e).__name__}: {e}"
        log.close()
        ctx.results[name] = {"ok": bool(ok), "detail": detail, "seconds": round(time.time() - t, 1)}
        print(
            f"--> {name}: {'PASS' if ok else 'FAIL'} ({time.time() - t:.0f} s): {detail}",
            flush=True,
        )
        (ctx.out / "results.json").write_text(
            json.dumps(
                {"results": ctx.results, "env": ctx.shared.get("env")}, indent=2, default=str
            )
        )
    print(f"\n{'step':<11} {'result':<6} {'s':>5}  detail")
    for name, r in ctx.results.items():
        print(f"{name:<11} {'PASS' if r['ok'] else 'FAIL':<6} {r['seconds']:>5.0f}  {r['detail']}")
    print(f"total {time.time() - t0:.0f} s; runs in {ctx.runs}, logs in {ctx.logs}")
    return 0 if all(r["ok"] for r in ctx.results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
