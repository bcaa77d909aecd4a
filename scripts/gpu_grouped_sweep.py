"""The grouped expert kernels' knobs at a chunked verify step's token counts, on the H200.

The grouped route / w13 + SiTU / w2 kernels were tuned at 8-64 tokens (notes/specialized_moe.md);
since session 20 they also run once over a verify step's 256 or 512 tokens, where the standard
path's Triton fused MoE streams the same experts faster (session 21, TP8 32x8: 1438 us against
about 1362 per layer). This builds one specialized MoE layer of the real step (its attention half
first, so that the routing is the step's, not uniform: about 660 experts at 256 tokens), then
for each knob variant (``DECODESCOPE_MOE_W13T_*`` / ``DECODESCOPE_MOE_W2T_*``, read at each
call and part of each kernel's compile key) runs the three expert launches, checks the routed
latent sum and the shared output against the default's (rel L2), and times them by CUDA-graph
replay (median over ``--replays``). A variant that does not compile or fails its check is a row
with its error; the run goes on until ``--budget-s``.

    python scripts/gpu_grouped_sweep.py --out $OUT/sweep [--tp 8] [--batch 32] [--tokens 8]
        [--variants base w13_s4 ...] [--replays 20] [--budget-s 420] [--best-env FILE]

After the variants, the fastest passing w13 and w2 variants together (row ``combo``, where
both beat the defaults). ``--best-env FILE``: ``export`` lines of the fastest passing row if it
beats the defaults by ``GAIN`` (else an empty file), for a whole-step A/B in the same call.

Results: ``results.json`` (rewritten after every variant) and ``table.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

W13 = "DECODESCOPE_MOE_W13T_"
W2 = "DECODESCOPE_MOE_W2T_"
VARIANTS: dict[str, dict[str, str]] = {
    "base": {},
    "w13_s4": {W13 + "STAGES": "4"},
    "w13_s2": {W13 + "STAGES": "2"},
    "w13_bk64_s6": {W13 + "BK": "64", W13 + "STAGES": "6"},
    "w13_mt4": {W13 + "MT": "4"},
    "w13_p1": {W13 + "PERSIST": "1"},
    "w13_r32": {W13 + "ROWS": "32"},
    "w2_mt2": {W2 + "MT": "2"},
    "w2_s2": {W2 + "STAGES": "2"},
    "w2_s3": {W2 + "STAGES": "3"},
    "w2_bk64": {W2 + "BK": "64"},
    "w2_w8": {W2 + "WARPS": "8"},
    "w2_rt2": {W2 + "RT": "2"},
    "w2_bulk": {W2 + "LOAD": "bulk"},
    "w2_mt2_s3": {W2 + "MT": "2", W2 + "STAGES": "3"},
    "w13_s4_p1": {W13 + "STAGES": "4", W13 + "PERSIST": "1"},
    "w2_block": {W2 + "ORDER": "block"},
    "w2_spread": {W2 + "SHARED": "spread"},
    "w2_bk32": {W2 + "BK": "32"},
}
GAIN = 0.02  # --best-env: a variant must beat the defaults by this fraction
TOL = 1e-3  # a knob changes the schedule, not the math: the same sums to FP32 reordering


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--best-env", type=Path, default=None)
    args = ap.parse_args(argv)
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}")
    t0 = time.time()
    import torch

    from decodescope.kernels.reference import rel_l2
    from decodescope.kernels.specialized import step as S
    from decodescope.kernels.timing import graph_time_us

    for k in [k for k in os.environ if k.startswith((W13, W2))]:
        del os.environ[k]  # the base row is the defaults
    args.out.mkdir(parents=True, exist_ok=True)
    p = S.plan(preset="kimi-k3", tp_shape=args.tp, batch=args.batch,
               tokens_per_seq=args.tokens, layers="kda")  # fmt: skip
    m = S.SpecializedModel(p.cfg, p.specs, args.batch, args.tokens, seed=0, device="cuda")
    m.warmup()
    torch.cuda.synchronize()
    blk = m.moe[0]
    ids = blk.topk_ids.long()
    n_sel = int(torch.unique(ids).numel())
    info = {"tp": args.tp, "tokens": blk.N, "experts_selected": n_sel,
            "pairs_per_expert": round(ids.numel() / n_sel, 2),
            "gpu": torch.cuda.get_device_name(), "setup_s": round(time.time() - t0, 1)}  # fmt: skip
    print(f"sweep: {info}", flush=True)
    blk.experts()
    torch.cuda.synchronize()
    ref_acc, ref_sh = blk.acc.clone(), blk.shared_out.clone()
    rows: list[dict] = []

    def write() -> None:
        (args.out / "results.json").write_text(json.dumps({"info": info, "rows": rows}, indent=1))

    def best(prefix: str) -> dict | None:
        ok = [r for r in rows if r["variant"].startswith(prefix) and r.get("ok")]
        return min(ok, key=lambda r: r["us"]) if ok else None

    def base_us() -> float | None:
        return next((r["us"] for r in rows if r["variant"] == "base" and "us" in r), None)

    todo = [(n, VARIANTS[n]) for n in args.variants]
    while todo:
        name, env = todo.pop(0)
        if time.time() - t0 > args.budget_s:
            rows.append({"variant": name, "error": "skipped: --budget-s spent"})
            continue
        os.environ.update(env)
        t1 = time.time()
        row: dict = {"variant": name, "env": env}
        try:
            blk.acc.fill_(float("nan"))
            blk.shared_out.fill_(float("nan"))
            blk.experts()
            torch.cuda.synchronize()
            row["compile_run_s"] = round(time.time() - t1, 1)
            row["acc_rel"] = rel_l2(blk.acc, ref_acc)
            row["shared_rel"] = rel_l2(blk.shared_out, ref_sh)
            row["ok"] = bool(row["acc_rel"] < TOL and row["shared_rel"] < TOL)
            med, lo, hi = graph_time_us([blk.experts], args.replays)
            row.update(us=med, min=lo, max=hi)
        except Exception as e:  # noqa: BLE001 - a variant that fails is a row, not a stop
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            torch.cuda.synchronize()
        finally:
            for k in env:
                os.environ.pop(k, None)
        rows.append(row)
        print(f"  {name}: {row.get('us', row.get('error'))}", flush=True)
        write()
        if not todo and name != "combo":  # the fastest w13 and w2 variants together
            b13, b2, b0 = best("w13_"), best("w2_"), base_us()
            if b13 and b2 and b0 and b13["us"] < b0 and b2["us"] < b0:
                todo.append(("combo", {**b13["env"], **b2["env"]}))
    base = base_us()
    lines = [
        f"TP{args.tp}, {blk.N} tokens, {n_sel} experts selected "
        f"({info['pairs_per_expert']} pairs each); route + w13 + w2, CUDA-graph medians",
        "",
        "| variant | env | us | min | max | vs base | acc rel | shared rel | check |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        env = " ".join(f"{k.split('_MOE_')[1]}={v}" for k, v in r.get("env", {}).items())
        if "us" not in r:
            lines.append(f"| {r['variant']} | {env} | {r.get('error', '-')} |||||||")
            continue
        vs = f"{r['us'] / base:.3f}" if base else "-"
        lines.append(
            f"| {r['variant']} | {env} | {r['us']:.1f} | {r['min']:.1f} | {r['max']:.1f} | {vs} "
            f"| {r['acc_rel']:.1e} | {r['shared_rel']:.1e} | {'PASS' if r['ok'] else 'FAIL'} |"
        )
    table = "\n".join(lines)
    (args.out / "table.md").write_text(table + "\n")
    write()
    if args.best_env is not None:
        top = best("")
        env = top["env"] if top and base and top["us"] < base * (1 - GAIN) else {}
        args.best_env.write_text("".join(f"export {k}={v}\n" for k, v in env.items()))
        print(f"best-env: {env or 'none (no variant beats the defaults by 2%)'}")
    print(table)
    return 0 if all(r.get("ok", True) for r in rows if "us" in r) else 1


if __name__ == "__main__":
    sys.exit(main())
