"""The tiled cp.async GEMM (:mod:`.tile_gemm`, issue #5) on the H200: checks, then timings.

    python scripts/gpu_tile_gemm.py --out $OUT/tile [--tp 8] [--ms 1 8 32 64]
        [--gemms in_proj qkv_a_g q_b o_proj] [--replays 30] [--no-timing] [--budget 200]

One child process per GEMM (a hang or CUDA error loses that GEMM only; children compile and
check at the same time, then take turns on a lock for their timings). Per GEMM:

- checks (fresh random inputs, outputs and the new residual poisoned with NaN, vs the torch
  reference with the kernel's rounding points in FP32 math): the tile kernel at 1, 8, 33, 64
  tokens, and at 64 tokens with forced split / stage / warp counts;
- timings at each ``--ms`` (CUDA-graph replay medians per launch, weights rotated over enough
  copies to pass 3x the L2): ``tile`` (norm launch + GEMM where the projection has a norm),
  ``tile GEMM only`` (input already normalized), a few split / stage variants, ``default``
  (what the layers run now: :func:`.splitk_gemm.project`), and ``cuBLAS`` (``torch.mm``, no
  norm or epilogue), with the bytes floor (weights + activations at the copy bandwidth).

Writes ``results.json`` (rewritten as results arrive) and ``table.md`` under ``--out``; prints
the table last (PASS/FAIL per check).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import sys
import time
import traceback
from pathlib import Path

GEMMS = ("in_proj", "qkv_a_g", "q_b", "o_proj")
L2_BYTES = 50 * 2**20
TOL = 2e-2  # max |err| / max |ref| over an output (BF16 outputs, FP32 sums in another order)
CHECK_MS = (1, 8, 33, 64)
VARIANTS = (  # forced tilings checked at 64 tokens and timed at every M
    {"stages": 3},
    {"stages": 6},
    {"warps": 2},
)


def child(name: str, a: dict, lock, barrier, out_path: str) -> None:
    import torch

    from decodescope.kernels.config import get_config
    from decodescope.kernels.specialized import splitk_gemm as sk
    from decodescope.kernels.specialized import tile_gemm as tg
    from decodescope.kernels.specialized.skinny_gemm import skinny_gemm_ref

    dev = torch.device("cuda")
    cfg = get_config("kimi-k3", a["tp"])
    kw = tg.attention_cases(cfg)[name]
    K, segs = kw["k"], kw["segments"]
    res: list[dict] = []

    def rec(**r) -> None:
        r.update(gemm=name, tp=a["tp"])
        res.append(r)
        print(" ".join(f"{k}={v}" for k, v in r.items() if k != "trace"), flush=True)
        Path(out_path).write_text(json.dumps(res, indent=1))

    def guarded(what: str, fn) -> None:
        try:
            fn()
        except Exception as e:
            rec(what=what, status="error", error=f"{type(e).__name__}: {e}"[:300],
                trace=traceback.format_exc())  # fmt: skip
            torch.cuda.synchronize()

    def rnd(*shape, std=1.0):
        return (torch.randn(*shape, device=dev) * std).to(torch.bfloat16)

    def inputs(m: int, wlist: list):
        ldx = kw.get("x_stride", 0) or K
        x = rnd(m, ldx)[:, :K]
        args = {"eps": kw.get("eps", 1e-5)}
        if kw.get("norm"):
            args["norm_weight"] = (1 + 0.1 * torch.randn(K, device=dev)).to(torch.bfloat16)
        if kw.get("add_residual"):
            args["residual"] = rnd(m, K)
            args["residual_out"] = torch.empty(m, K, dtype=torch.bfloat16, device=dev)
        if kw.get("residual_epilogue"):
            args["epilogue_residual"] = rnd(m, segs[0])
        outs = [torch.empty(m, n, dtype=torch.bfloat16, device=dev) for n in segs]
        return x, args, outs

    def check(m: int, force: dict) -> None:
        ws = [rnd(n, K, std=K**-0.5) for n in segs]
        x, args, outs = inputs(m, ws)
        for t in outs + ([args["residual_out"]] if "residual_out" in args else []):
            t.fill_(float("nan"))
        tg.tile_gemm(x, ws, outs, **args, **force)
        torch.cuda.synchronize()
        refs, rref = skinny_gemm_ref(x, ws, **{k: v for k, v in args.items()
                                               if k != "residual_out"})  # fmt: skip
        err = 0.0
        for o, r in zip(outs, refs, strict=True):
            if not torch.isfinite(o.float()).all():
                err = math.inf
                break
            err = max(err, ((o.float() - r.float()).abs().max() / r.float().abs().max()).item())
        if rref is not None and not torch.equal(args["residual_out"], rref):
            err = math.inf
        p = tg.plan_of(x, ws, **{k: v for k, v in args.items() if k != "residual_out"}, **force)
        rec(what=f"check M{m} {force or 'plan'} (S{p.splits} w{p.warps} st{p.stages})",
            err=f"{err:.2e}", status="PASS" if err < TOL else "FAIL")  # fmt: skip

    for m in CHECK_MS:
        guarded(f"check M{m}", lambda m=m: check(m, {}))
    for f in VARIANTS + ({"splits": 1},):
        guarded(f"check M64 {f}", lambda f=f: check(64, f))
    if a["no_timing"]:
        return
    ok_checks = not any(r.get("status") in ("FAIL", "error") for r in res)
    if not ok_checks:
        rec(what="timing", status="info", error="skipped: a check failed")
        barrier.abort()
        return

    from decodescope.kernels.bandwidth import copy_bandwidth_tbs

    wbytes = sum(n * K * 2 for n in segs)
    ncopy = max(2, math.ceil(3 * L2_BYTES / wbytes))
    wsets = [[rnd(n, K, std=K**-0.5) for n in segs] for _ in range(ncopy)]

    def graph_us(fns: list, replays: int) -> float:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for f in fns:
                f()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for f in fns:
                f()
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        ts = []
        for _ in range(replays):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            g.replay()
            e1.record()
            e1.synchronize()
            ts.append(e0.elapsed_time(e1) * 1e3 / len(fns))
        ts.sort()
        return ts[len(ts) // 2]

    # every timed launch list is built and run once (compiles) before the lock is taken
    jobs = []  # (what, m, floor, fns)
    for m in a["ms"]:
        x, args, outs = inputs(m, wsets[0])
        floor = (wbytes + 2 * m * K * (3 if kw.get("add_residual") else 1)
                 + 2 * m * sum(segs))  # bytes; over the copy bandwidth below  # fmt: skip
        gargs = {k: v for k, v in args.items()
                 if k not in ("norm_weight", "residual", "residual_out")}  # fmt: skip
        pargs = {k: v for k, v in args.items() if k != "residual_out"}
        xn = torch.randn(m, K, device=dev).to(torch.bfloat16)
        p0 = tg.plan_of(x, wsets[0], **pargs)

        def add(what, one, m=m, floor=floor):
            jobs.append((what, m, floor, [(lambda i=i: one(i)) for i in range(ncopy)]))

        add(
            f"tile (S{p0.splits})",
            lambda i, x=x, args=args, outs=outs: tg.tile_gemm(x, wsets[i], outs, **args),
        )
        if kw.get("norm"):
            add(
                "tile GEMM only",
                lambda i, xn=xn, g=gargs, outs=outs: tg.tile_gemm(xn, wsets[i], outs, **g),
            )
            add(
                "tile norm launch only",
                lambda i, x=x, args=args, p0=p0: tg.norm_launch(
                    p0, x, args["norm_weight"], args.get("residual"), args.get("residual_out")
                ),
            )
        if m == max(a["ms"]):
            divs = [d for d in range(1, p0.nch + 1) if p0.nch % d == 0 and d != p0.splits]
            near = sorted(divs, key=lambda d: abs(math.log(d / p0.splits)))[:2]
            for f in [{"splits": d} for d in near] + list(VARIANTS):
                add(
                    f"tile {f}",
                    lambda i, x=x, args=args, f=f, outs=outs: tg.tile_gemm(
                        x, wsets[i], outs, **args, **f
                    ),
                )
        add(
            "default (splitk_gemm.project)",
            lambda i, x=x, args=args, outs=outs: sk.project(x, wsets[i], outs, **args),
        )
        add(
            "cuBLAS torch.mm (no norm/epilogue)",
            lambda i, xn=xn, outs=outs: [
                torch.mm(xn, wsets[i][s].t(), out=outs[s]) for s in range(len(segs))
            ],
        )
    ready = []
    for what, m, floor, fns in jobs:

        def warm(fns=fns):
            for f in fns:
                f()
            torch.cuda.synchronize()
            return True

        ok = []
        guarded(f"warm {what} M{m}", lambda warm=warm, ok=ok: ok.append(warm()))
        if ok:
            ready.append((what, m, floor, fns))

    try:  # nobody times while another child still compiles or checks
        barrier.wait(timeout=a["budget"] * 0.6)
    except Exception as e:
        rec(what="barrier", status="info", error=f"{type(e).__name__} (timing anyway)")
    with lock:  # one child times at a time
        bw = copy_bandwidth_tbs()
        rec(what="copy_bw_tbs", value=f"{bw:.3f}", status="info")
        for what, m, nbytes, fns in ready:

            def run(what=what, m=m, floor=nbytes / (bw * 1e6), fns=fns):
                us = graph_us(fns, a["replays"])
                rec(what=what, M=m, us=f"{us:.1f}", floor_us=f"{floor:.1f}",
                    span_floor=f"{us / floor:.2f}", status="time")  # fmt: skip

            guarded(f"time {what} M{m}", run)


def table(results: list[dict]) -> str:
    lines = ["| gemm | M | what | us | floor us | span/floor |", "|---|---|---|---|---|---|"]
    for r in results:
        if r.get("status") == "time":
            lines.append(f"| {r['gemm']} | {r['M']} | {r['what']} | {r['us']} | {r['floor_us']} "
                         f"| {r['span_floor']} |")  # fmt: skip
    lines.append("")
    for r in results:
        if r.get("status") in ("PASS", "FAIL", "error"):
            lines.append(f"- {r['status']} {r['gemm']} {r['what']} {r.get('err', '')} "
                         f"{r.get('error', '')}")  # fmt: skip
    n_ok = sum(r.get("status") == "PASS" for r in results)
    n_bad = sum(r.get("status") in ("FAIL", "error") for r in results)
    lines.append(f"\nchecks: {n_ok} PASS, {n_bad} FAIL/error")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results/tile_gemm")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--gemms", nargs="+", default=list(GEMMS), choices=GEMMS)
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--budget", type=float, default=200, help="seconds for all children")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    ctx = mp.get_context("spawn")
    lock = ctx.Lock()
    barrier = ctx.Barrier(len(a.gemms))
    args = {"tp": a.tp, "ms": a.ms, "replays": a.replays, "no_timing": a.no_timing,
            "budget": a.budget}  # fmt: skip
    procs = {}
    for name in a.gemms:
        path = out / f"child_{name}.json"
        path.unlink(missing_ok=True)
        p = ctx.Process(target=child, args=(name, args, lock, barrier, str(path)), name=name)
        p.start()
        procs[name] = (p, path)
    t0 = time.time()
    results: list[dict] = []
    for name, (p, path) in procs.items():
        p.join(max(1.0, a.budget - (time.time() - t0)))
        if p.is_alive():
            p.kill()
            p.join()
            results.append({"gemm": name, "what": "child", "status": "error",
                            "error": f"timed out after {a.budget:.0f} s (killed)"})  # fmt: skip
        elif p.exitcode != 0:
            results.append({"gemm": name, "what": "child", "status": "error",
                            "error": f"exit code {p.exitcode}"})  # fmt: skip
        if path.exists():
            results.extend(json.loads(path.read_text()))
        (out / "results.json").write_text(json.dumps(results, indent=1))
    t = table(results)
    (out / "table.md").write_text(t + "\n")
    print(t)
    return 0 if not any(r.get("status") in ("FAIL", "error") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
