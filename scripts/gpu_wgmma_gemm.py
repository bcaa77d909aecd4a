"""The tile GEMM's warpgroup MMAs (``TilePlan.wgmma``) against its ``mma.sync`` path on the H200:
checks first, then timings (issue #5).

    python scripts/gpu_wgmma_gemm.py --out $OUT/wgmma [--tp 8 16] [--ms 8 32 64] [--replays 30]

Cases (one rank's shapes): the LatentMoE front (router + latent down + shared gate/up, FP32 out,
``front_mma.front_tile``'s plan), MLA qkv_a + g_proj (after its RMSNorm launch), q_b with the
norm folded (``rms_fold``), o_proj (residual epilogue), KDA in_proj (norm launch + GEMM), and
the LatentMoE back (``back_tile``: latent RMSNorm + latent up + shared add, its ``ldsm`` plan
from 33 tokens; at fewer tokens its plan has no wgmma variant and the case is skipped).

- checks: fresh random inputs, outputs poisoned with NaN, both paths vs the torch reference with
  the kernel's rounding points (max |err| / max |ref| under 2e-2; the FP32 front under 1e-3),
  at every ``--ms`` plus 1 and 33 tokens;
- timings: CUDA-graph replay medians per launch (:func:`decodescope.kernels.timing.
  graph_time_us`), weights rotated over enough copies to pass 3x the L2, ``mma.sync`` /
  ``wgmma`` / ``torch.mm`` (cuBLAS, the GEMM alone: no norm or epilogue), and the bytes floor
  (weights + activations at the copy bandwidth measured in the same process).

Writes ``results.json`` (rewritten as rows arrive) and ``table.md`` under ``--out``; prints the
table last. A case that raises is recorded as an error row; the others go on.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import traceback
from pathlib import Path

L2_BYTES = 50 * 2**20
TOL = 2e-2
TOL_F32 = 1e-3
CASES = ("front", "back", "qkv_a_g", "q_b", "o_proj", "in_proj")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results/wgmma_gemm")
    ap.add_argument("--tp", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--ms", type=int, nargs="+", default=[8, 32, 64])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument(
        "--device", default="cuda", help="cpu: the CPU test's dry run (kernels patched)"
    )
    a = ap.parse_args(argv)

    import torch

    from decodescope.kernels.config import get_config
    from decodescope.kernels.specialized import tile_gemm as tg
    from decodescope.kernels.specialized.skinny_gemm import skinny_gemm_ref
    from decodescope.kernels.timing import graph_time_us

    dev = torch.device(a.device)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def empty_cache() -> None:
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []

    def rec(**r) -> None:
        rows.append(r)
        print(" ".join(f"{k}={v}" for k, v in r.items() if k != "trace"), flush=True)
        (out / "results.json").write_text(json.dumps(rows, indent=1))

    # copy bandwidth in this process (the floor's denominator; DESIGN.md section 7)
    from decodescope.kernels.bandwidth import copy_bandwidth_tbs

    bw = copy_bandwidth_tbs()
    rec(what="copy_bw", tbs=f"{bw:.2f}")

    def rnd(*shape, std=1.0):
        return (torch.randn(*shape, device=dev) * std).to(torch.bfloat16)

    def back_case(tp: int, cfg) -> None:
        from decodescope.kernels.specialized import back_tile as bt

        L, H = cfg.expert_dim, cfg.hidden

        def inputs(m: int):
            acc = torch.randn(m, L, device=dev)
            nw = (1 + 0.1 * torch.randn(L, device=dev)).to(torch.bfloat16)
            sh = torch.randn(m, H, device=dev)
            return acc, nw, sh, torch.empty(m, H, dtype=torch.bfloat16, device=dev)

        ms = [m for m in sorted({33, *a.ms}) if m > bt.LDSM_ABOVE]
        for m in ms:
            for wg in (False, True):
                try:
                    acc, nw, sh, o = inputs(m)
                    up = rnd(H, L, std=L**-0.5)
                    o.fill_(float("nan"))
                    bt.back_tile(acc, nw, up, sh, o, cfg.eps, wgmma=wg)
                    sync()
                    sp = bt.plan_for(m, L, H, cfg.eps).tile.splits
                    ref = bt.back_tile_ref(acc, nw, up, sh, cfg.eps, splits=sp).float()
                    err = math.inf if not torch.isfinite(o).all() else (
                        (o.float() - ref).norm() / ref.norm()).item()  # fmt: skip
                    rec(what="check", tp=tp, case="back", m=m, wgmma=wg, err=f"{err:.2e}",
                        status="PASS" if err < 2e-3 else "FAIL")  # fmt: skip
                except Exception as ex:  # noqa: BLE001
                    rec(what="check", tp=tp, case="back", m=m, wgmma=wg, status="error",
                        error=f"{type(ex).__name__}: {ex}"[:300], trace=traceback.format_exc())  # fmt: skip
                    sync()
        wbytes = H * L * 2
        copies = max(1, math.ceil(3 * L2_BYTES / wbytes))
        ups = [rnd(H, L, std=L**-0.5) for _ in range(copies)]
        for m in [m for m in a.ms if m > bt.LDSM_ABOVE]:
            acc, nw, sh, o = inputs(m)
            floor = (wbytes + m * L * 4 + m * H * 6) / (bw * 1e12) * 1e6
            row = dict(
                what="time", tp=tp, case="back", m=m, copies=copies, floor_us=round(floor, 2)
            )
            for wg in (False, True):
                fns = [lambda u=u, wg=wg, acc=acc, nw=nw, sh=sh, o=o: bt.back_tile(
                    acc, nw, u, sh, o, cfg.eps, wgmma=wg) for u in ups]  # fmt: skip
                try:
                    row["wgmma_us" if wg else "mma_us"] = round(graph_time_us(fns, a.replays)[0], 2)
                except Exception as ex:  # noqa: BLE001
                    row["wgmma_us" if wg else "mma_us"] = f"error: {type(ex).__name__}: {ex}"[:200]
                    sync()
            xa = acc.to(torch.bfloat16)
            cb = [lambda u=u, xa=xa: torch.mm(xa, u.T) for u in ups]
            row["cublas_us"] = round(graph_time_us(cb, a.replays)[0], 2)
            rec(**row)
        del ups
        empty_cache()

    for tp in a.tp:
        cfg = get_config("kimi-k3", tp)
        cases = tg.attention_cases(cfg)
        e = cfg.moe
        cases["front"] = dict(k=cfg.hidden, segments=(e.num_experts + cfg.expert_dim
                                                      + 2 * cfg.shared_inter,), out_f32=True)  # fmt: skip
        for name in a.cases:
            if name == "back":
                back_case(tp, cfg)
                continue
            kw = cases[name]
            K, segs = kw["k"], kw["segments"]
            fold = name == "q_b"

            def build(m: int, wlist: list, kw=kw, K=K, segs=segs, fold=fold):
                ldx = kw.get("x_stride", 0) or K
                x = rnd(m, ldx)[:, :K]
                args: dict = {"eps": kw.get("eps", 1e-5)}
                if kw.get("norm"):
                    args["norm_weight"] = (1 + 0.1 * torch.randn(K, device=dev)).to(torch.bfloat16)
                if kw.get("add_residual"):
                    args["residual"] = rnd(m, K)
                    args["residual_out"] = torch.empty(m, K, dtype=torch.bfloat16, device=dev)
                if kw.get("residual_epilogue"):
                    args["epilogue_residual"] = rnd(m, segs[0])
                dt = torch.float32 if kw.get("out_f32") else torch.bfloat16
                outs = [torch.empty(m, n, dtype=dt, device=dev) for n in segs]
                folded = None
                if fold:
                    folded = [tg.fold_norm_weight(w, args["norm_weight"]) for w in wlist]
                return x, args, outs, folded

            def launch(x, ws, outs, args, folded, wg: bool, fold=fold):
                if fold:
                    tg.tile_gemm(x, folded, outs, rms_fold=True, eps=args["eps"], wgmma=wg)
                else:
                    tg.tile_gemm(x, ws, outs, **args, wgmma=wg)

            def check(
                m: int, wg: bool, name=name, K=K, segs=segs, build=build, launch=launch, tp=tp
            ):
                ws = [rnd(n, K, std=K**-0.5) for n in segs]
                x, args, outs, folded = build(m, ws)
                for t in outs + ([args["residual_out"]] if "residual_out" in args else []):
                    t.fill_(float("nan"))
                launch(x, ws, outs, args, folded, wg)
                sync()
                refs, rref = skinny_gemm_ref(x, ws, **{k: v for k, v in args.items()
                                                       if k != "residual_out"})  # fmt: skip
                f32 = outs[0].dtype == torch.float32
                if f32:  # the FP32 sums themselves
                    refs = [x.float() @ w.float().T for w in ws]
                err = 0.0
                for o, r in zip(outs, refs, strict=True):
                    if not torch.isfinite(o).all():
                        err = math.inf
                        break
                    err = max(err, ((o.float() - r.float()).abs().max()
                                    / r.float().abs().max()).item())  # fmt: skip
                if rref is not None and not torch.equal(args["residual_out"], rref):
                    err = math.inf
                tol = TOL_F32 if f32 else TOL
                rec(what="check", tp=tp, case=name, m=m, wgmma=wg, err=f"{err:.2e}",
                    status="PASS" if err < tol else "FAIL")  # fmt: skip

            for m in sorted({1, 33, *a.ms}):
                for wg in (False, True):
                    try:
                        check(m, wg)
                    except Exception as ex:  # noqa: BLE001 (recorded; the others go on)
                        rec(what="check", tp=tp, case=name, m=m, wgmma=wg, status="error",
                            error=f"{type(ex).__name__}: {ex}"[:300], trace=traceback.format_exc())  # fmt: skip
                        sync()

            wbytes = sum(n * K * 2 for n in segs)
            copies = max(1, math.ceil(3 * L2_BYTES / wbytes))
            wsets = [[rnd(n, K, std=K**-0.5) for n in segs] for _ in range(copies)]
            for m in a.ms:
                floor = (wbytes + m * K * 2) / (bw * 1e12) * 1e6
                x, args, outs, _ = build(m, wsets[0])
                row = dict(what="time", tp=tp, case=name, m=m, copies=copies,
                           floor_us=round(floor, 2))  # fmt: skip
                for wg in (False, True):
                    try:
                        fl = ([tg.fold_norm_weight(w, args["norm_weight"]) for w in ws]
                              for ws in wsets) if fold else (None for _ in wsets)  # fmt: skip
                        fns = [lambda ws=ws, f=f, wg=wg, x=x, o=outs, ar=args: launch(x, ws, o, ar, f, wg)
                               for ws, f in zip(wsets, fl, strict=True)]  # fmt: skip
                        med, lo, hi = graph_time_us(fns, a.replays)
                        row["wgmma_us" if wg else "mma_us"] = round(med, 2)
                    except Exception as ex:  # noqa: BLE001
                        row["wgmma_us" if wg else "mma_us"] = f"error: {type(ex).__name__}: {ex}"[
                            :200
                        ]
                        sync()
                xa = x.contiguous()
                cb = [lambda ws=ws, xa=xa: [torch.mm(xa, w.T) for w in ws] for ws in wsets]
                row["cublas_us"] = round(graph_time_us(cb, a.replays)[0], 2)
                rec(**row)
            del wsets
            empty_cache()

    lines = ["| tp | case | m | mma.sync us | wgmma us | cuBLAS us (GEMM alone) | floor us |",
             "|---:|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        if r["what"] == "time":
            lines.append(f"| {r['tp']} | {r['case']} | {r['m']} | {r.get('mma_us')} | "
                         f"{r.get('wgmma_us')} | {r['cublas_us']} | {r['floor_us']} |")  # fmt: skip
    checks = [r for r in rows if r["what"] == "check"]
    bad = [r for r in checks if r["status"] != "PASS"]
    lines.append("")
    lines.append(f"checks: {len(checks) - len(bad)} PASS, {len(bad)} not: "
                 + ", ".join(f"TP{r['tp']} {r['case']} M{r['m']} wgmma={r['wgmma']} {r['status']}"
                             f" {r.get('err', r.get('error', ''))}" for r in bad))  # fmt: skip
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
