"""The tiled cp.async GEMM (:mod:`.tile_gemm`, issue #5) on the H200: checks, then timings.

    python scripts/gpu_tile_gemm.py --out $OUT/tile [--tp 8] [--ms 1 8 32 64]
        [--gemms in_proj qkv_a_g q_b o_proj] [--replays 30] [--no-timing] [--budget 200]
        [--no-base-variants]

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

Session 10 rows (helper qb): the RMSNorm folded into the GEMM (``fold``: one launch on the
derived weight ``bf16(W * norm weight)``, ``TilePlan.rms_fold``; in_proj / qkv_a_g with the
residual add folded in too, ``residual_out`` checked exactly; q_b: checked against the
reference with vLLM's rounding at 1 / 8 / 33 / 64 tokens and each fold variant at 64; timed
at every ``--ms``, two variants from 32 tokens, all at the largest); o_proj's split-K epilogue
knobs (``epi_hoist``: the residual loads issued with the partials'; ``epi_batch``; ``ldsm``;
split counts), checked at 64, two timed from 32 tokens, all at the largest. ``--no-base-variants`` drops round 4's
split / stage / warp rows of the plain plan.

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

from decodescope.kernels.timing import graph_time_us

GEMMS = ("in_proj", "qkv_a_g", "q_b", "o_proj")
L2_BYTES = 50 * 2**20
TOL = 2e-2  # max |err| / max |ref| over an output (BF16 outputs, FP32 sums in another order)
CHECK_MS = (1, 8, 33, 64)
VARIANTS = (  # forced tilings checked at 64 tokens and timed at the largest M
    {"stages": 3},
    {"stages": 6},
    {"warps": 2},
)
# session 10: the folded norm (q_b; {} is the fold's own plan) and o_proj's epilogue knobs,
# each checked at VAR_CHECK_MS and timed at the largest M; the first VAR_WIDE of each also at
# every M from VAR_MIN_M (few compiles: the run stays near 2 minutes)
FOLD_VARIANTS = (
    {},
    {"ldsm": True},
    {"ldsm": True, "epi_batch": 8},
    {"epi_batch": 8},
    {"splits": 4},
    {"splits": 6},
    {"warps": 2},
    {"ldsm": True, "warps": 2},
    {"warps": 2, "splits": 3},
    {"warps": 1},
)
FOLD_RES_VARIANTS = (  # in_proj / qkv_a + g with the residual add folded in too (fold_all)
    {},
    {"res_regs": True},  # r by registers one chunk ahead: 4 stages at 64 tokens, 2 CTAs/SM
    {"ldsm": True},
    {"stages": 4},  # 4 stages: one CTA per SM at 64 tokens (the plan takes 3 there)
    {"warps": 2},  # 64-row CTAs: 4 stages fit two CTAs per SM at 64 tokens
)
EPI_VARIANTS = (  # s10/r2 at 64 tokens: tile 17.9, hoist 15.0, hoist b8 14.6, hoist ldsm 13.0
    {"epi_hoist": False, "ldsm": False},  # the plan before the s10/r2 defaults
    {"epi_hoist": True, "ldsm": True},  # the default from 32 tokens (hoist alone below)
    {"epi_hoist": True, "ldsm": True, "epi_batch": 8},
    {"epi_hoist": True, "ldsm": False},
    {"epi_hoist": False, "ldsm": True},
    {"epi_hoist": True, "ldsm": False, "epi_batch": 8},
    {"epi_hoist": True, "ldsm": True, "splits": 4},
    {"epi_hoist": True, "ldsm": True, "splits": 2},
    {"epi_hoist": True, "ldsm": True, "warps": 2},
)
VAR_CHECK_MS = (64,)
VAR_MIN_M = 8
VAR_WIDE = 3


def label(f: dict) -> str:
    """A variant's short name: ``hoist b8 ldsm S4 w2``."""
    short = {"epi_hoist": "hoist", "ldsm": "ldsm", "res_regs": "rregs"}
    parts = []
    for k, v in f.items():
        if k in short:
            parts.append(short[k] if v else "no" + short[k])
        else:
            parts.append(
                {"epi_batch": "b", "splits": "S", "warps": "w", "stages": "st"}[k] + str(v)
            )
    return " ".join(parts) or "plan"


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
    fold_vars = ()
    if kw.get("norm"):
        fold_vars = FOLD_RES_VARIANTS if kw.get("add_residual") else FOLD_VARIANTS
    epi_vars = EPI_VARIANTS if kw.get("residual_epilogue") else ()

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

    def run_fold(x, ws, outs, args, force):
        """q_b with the norm folded: one launch on the derived weights."""
        wf = [tg.fold_norm_weight(w, args["norm_weight"]) for w in ws]
        rargs = {k: args[k] for k in ("residual", "residual_out") if k in args}
        tg.tile_gemm(x, wf, outs, rms_fold=True, eps=args["eps"], **rargs, **force)

    def check(m: int, force: dict, fold: bool = False) -> None:
        ws = [rnd(n, K, std=K**-0.5) for n in segs]
        x, args, outs = inputs(m, ws)
        for t in outs + ([args["residual_out"]] if "residual_out" in args else []):
            t.fill_(float("nan"))
        if fold:
            run_fold(x, ws, outs, args, force)
        else:
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
        if fold:
            p = tg.plan_of(x, ws, eps=args["eps"], rms_fold=True, residual=args.get("residual"),
                           **force)  # fmt: skip
            what = f"check M{m} fold {label(force)}"
        else:
            p = tg.plan_of(x, ws, **{k: v for k, v in args.items() if k != "residual_out"},
                           **force)  # fmt: skip
            what = f"check M{m} {label(force)}"
        rec(what=f"{what} (S{p.splits} w{p.warps} st{p.stages} b{p.epi_batch})",
            err=f"{err:.2e}", status="PASS" if err < TOL else "FAIL")  # fmt: skip

    for m in CHECK_MS:
        guarded(f"check M{m}", lambda m=m: check(m, {}))
    if not a["no_base_variants"]:
        for f in VARIANTS + ({"splits": 1},):
            guarded(f"check M64 {f}", lambda f=f: check(64, f))
    for m in CHECK_MS if fold_vars else ():  # the fold's own plan at every check size
        guarded(f"check M{m} fold", lambda m=m: check(m, {}, True))
    for f in fold_vars[1:] + (({"splits": 1},) if fold_vars else ()):
        for m in VAR_CHECK_MS:
            guarded(f"check M{m} fold {f}", lambda m=m, f=f: check(m, f, True))
    for f in epi_vars:
        for m in VAR_CHECK_MS:
            guarded(f"check M{m} {f}", lambda m=m, f=f: check(m, f))
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
        return graph_time_us(fns, replays)[0]  # the median

    if fold_vars:  # the folded weights of every copy (one norm weight: timing only)
        gf = (1 + 0.1 * torch.randn(K, device=dev)).to(torch.bfloat16)
        wfs = [[tg.fold_norm_weight(w, gf) for w in wl] for wl in wsets]
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
        if fold_vars:
            for f in (
                fold_vars if m == max(a["ms"]) else fold_vars[: VAR_WIDE if m >= VAR_MIN_M else 1]
            ):
                rargs = {k: args[k] for k in ("residual", "residual_out") if k in args}
                pf = tg.plan_of(x, wfs[0], eps=args["eps"], rms_fold=True,
                                residual=rargs.get("residual"), **f)  # fmt: skip
                add(
                    f"fold {label(f)} (S{pf.splits} w{pf.warps} st{pf.stages}, 1 launch)",
                    lambda i, x=x, outs=outs, f=f, wfs=wfs, eps=args["eps"], rargs=rargs: (
                        tg.tile_gemm(x, wfs[i], outs, rms_fold=True, eps=eps, **rargs, **f)
                    ),
                )
        for f in epi_vars if m == max(a["ms"]) else epi_vars[:VAR_WIDE] if m >= VAR_MIN_M else ():
            pf = tg.plan_of(x, wsets[0], **pargs, **f)
            add(
                f"tile {label(f)} (S{pf.splits} w{pf.warps})",
                lambda i, x=x, args=args, f=f, outs=outs: tg.tile_gemm(
                    x, wsets[i], outs, **args, **f
                ),
            )
        if m == max(a["ms"]) and not a["no_base_variants"]:
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
        if name == "q_b":  # the standard path's two kernels: q_a / kv_a norms, then cuBLAS
            xa = rnd(m, kw["x_stride"])
            kv_n = torch.empty(m, kw["x_stride"] - K - cfg.mla.qk_rope_head_dim,
                               dtype=torch.bfloat16, device=dev)  # fmt: skip
            q_n = torch.empty(m, K, dtype=torch.bfloat16, device=dev)
            kvw = (1 + 0.1 * torch.randn(kv_n.shape[1], device=dev)).to(torch.bfloat16)

            def std_qb(i, xa=xa, kv_n=kv_n, q_n=q_n, kvw=kvw, args=args, outs=outs):
                from decodescope.kernels.standard import triton_kernels as tk

                tk.rmsnorm2(xa, 0, K, args["norm_weight"], q_n, K, kv_n.shape[1], kvw, kv_n,
                            args["eps"])  # fmt: skip
                torch.mm(q_n, wsets[i][0].t(), out=outs[0])

            add("standard: triton rmsnorm2 + cuBLAS (2 launches)", std_qb)
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
    ap.add_argument("--no-base-variants", action="store_true",
                    help="skip round 4's split / stage / warp variants of the plain plan")  # fmt: skip
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    ctx = mp.get_context("spawn")
    lock = ctx.Lock()
    barrier = ctx.Barrier(len(a.gemms))
    args = {"tp": a.tp, "ms": a.ms, "replays": a.replays, "no_timing": a.no_timing,
            "budget": a.budget, "no_base_variants": a.no_base_variants}  # fmt: skip
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
