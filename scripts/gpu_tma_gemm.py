"""H200 check and timing of the TMA skinny GEMM (:mod:`decodescope.kernels.specialized.tma_gemm`)
against cuBLAS on the projections of one rank.

For each TP shape, token count and op (KDA ``in_proj``, ``o_proj`` with its residual epilogue,
MLA ``q_b``, the dense MLP's ``gate_up`` and ``down`` as plain GEMMs): correctness first, on
fresh random inputs with the output poisoned with NaN, against :func:`tma_gemm.tma_gemm_ref`
(rel. L2 under 1e-2, twice in a row: the split-K counters must come back to zero); then each
tiling alone and cuBLAS (``torch.mm`` / ``torch.addmm``, what the step runs today from 32
tokens) on the same inputs, timed by CUDA-graph replay over weight copies rotated past the 50 MB
L2, medians of ``--replays`` replays. Bytes are the weight plus activations in and out; the
floor is those bytes over the copy bandwidth measured in the same process. Prints a markdown
table and writes ``OUT/tma_gemm.json``. Nothing is asserted about speed.

    python scripts/gpu_tma_gemm.py --out $OUT/tma [--tp 8 16] [--tokens 16 32 64]
        [--ops in_proj o_proj q_b gate_up down] [--sweep]

``--profile``: no timing; after the checks, one launch of each tiling (and of cuBLAS) inside the
CUDA profiler window, for ``DS_NCU_PROG=scripts/gpu_tma_gemm.py scripts/gpu/ncu_profile.sh``.

``--sweep``: instead of the default plan, the tilings of :data:`SWEEP` (each with the splits
that fill one wave at its occupancy unless given): the split-K reduced in the cluster
(``-cl``), the packed weight, the copy warp of its own (``-ws``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from decodescope.kernels.config import get_config
from decodescope.kernels.specialized import tma_gemm as tm
from decodescope.kernels.timing import graph_time_us

BF16 = torch.bfloat16
DEV = "cuda"  # the tests run the script on the CPU with the kernel replaced
L2_BYTES = 50 * 2**20
TOL = 1e-2


def shapes(cfg) -> dict[str, tuple[int, int, bool]]:
    """op -> (weight rows n, k, residual epilogue)."""
    return {
        "in_proj": (cfg.kda_in_proj_out, cfg.hidden, False),
        "o_proj": (cfg.hidden, cfg.kda_dim, True),
        "q_b": (cfg.mla_q_b_out, cfg.mla.q_lora_rank, False),
        "gate_up": (2 * cfg.dense_inter, cfg.hidden, False),
        "down": (cfg.hidden, cfg.dense_inter, False),
    }


SWEEP = [dict(csplit=True, stages=4), dict(csplit=True, stages=4, wsp=True),
         dict(bm=64, bk=64, stages=8, packed=True), dict(stages=8, packed=True, wsp=True),
         dict(csplit=True, stages=6, packed=True), dict(csplit=True, stages=6, packed=True, wsp=True),
         dict(stages=4, wsp=True)]  # fmt: skip


def variants(p: tm.TmaPlan, sweep: bool) -> list[dict]:
    """The default plan, or (``--sweep``) tile rows x K per stage x stages, each with the splits
    that fill one wave at its occupancy (:func:`tma_gemm.plan`)."""
    if not sweep:
        return [{}]
    return [v for v in SWEEP if p.k % v.get("bk", 64) == 0 and p.bn >= 8 * v.get("cm", 1)]


def timed(fns, args) -> float:
    return graph_time_us(fns, args.replays)[0]


def profiled(fn) -> None:
    """One launch of ``fn`` inside the CUDA profiler window (warmed up outside it)."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tp", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--ops", nargs="+", default=["in_proj", "o_proj", "q_b", "gate_up", "down"])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--profile", action="store_true", help="one profiled launch, no timing")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    from decodescope.kernels.bandwidth import copy_bandwidth_tbs

    bw = copy_bandwidth_tbs()
    print(f"copy bandwidth {bw:.2f} TB/s", flush=True)
    rows: list[dict] = []
    ok_all = True
    for tp in args.tp:
        cfg = get_config("kimi-k3", tp)
        for op in args.ops:
            n, k, res = shapes(cfg)[op]
            copies = max(2, -(-2 * L2_BYTES // (n * k * 2)))
            g = torch.Generator(device=DEV).manual_seed(1000 * tp + n)
            ws = [(torch.randn(n, k, device=DEV, generator=g) * k**-0.5).to(BF16)
                  for _ in range(copies)]  # fmt: skip
            packs: dict = {}
            for m in args.tokens:
                x = torch.randn(m, k, device=DEV, generator=g).to(BF16)
                e = torch.randn(m, n, device=DEV, generator=g).to(BF16) if res else None
                nbytes = n * k * 2 + m * k * 2 + m * n * 2 * (2 if res else 1)
                floor = nbytes / bw / 1e6
                base = tm.plan(m, k, n, residual_epilogue=res)
                ref = tm.tma_gemm_ref(x, ws[0], e)
                out = torch.empty(m, n, device=DEV, dtype=BF16)
                for kw in variants(base, args.sweep):
                    p = tm.plan(m, k, n, residual_epilogue=res, **kw)
                    wv = ws
                    if p.packed:  # the same copies in the packed form (made once per tiling)
                        key = (p.bm, p.cm)
                        if key not in packs:
                            packs[key] = [tm.pack_weight(w, p.bm, p.cm) for w in ws]
                        wv = packs[key]
                    row = {"tp": tp, "op": op, "m": m, "n": n, "k": k, "bm": p.bm, "bk": p.bk, "rot": p.rotate, "cm": p.cm, "packed": p.packed, "csplit": p.csplit, "wsp": p.wsp,
                           "splits": p.splits, "stages": p.stages, "ctas": p.ctas,
                           "mbytes": nbytes / 1e6, "floor_us": floor}  # fmt: skip
                    try:
                        errs = []
                        for _ in range(2):
                            out.fill_(float("nan"))
                            tm.tma_gemm(x, wv[0], out, e, **kw)
                            torch.cuda.synchronize()
                            errs.append(rel(out, ref) if torch.isfinite(out.float()).all()
                                        else float("inf"))  # fmt: skip
                        row["err"] = max(errs)
                        row["status"] = "PASS" if row["err"] < TOL else "FAIL"
                        ok_all &= row["status"] == "PASS"
                        fns = [(lambda w=w, x=x, o=out, e=e, kw=kw: tm.tma_gemm(x, w, o, e, **kw))
                               for w in wv]  # fmt: skip
                        row["us"] = profiled(fns[0]) if args.profile else timed(fns, args)
                    except Exception as ex:  # noqa: BLE001 - a failing tiling is a row
                        row["status"] = f"ERROR {type(ex).__name__}: {str(ex)[:100]}"
                        ok_all = False
                    rows.append(row)
                    print(row, flush=True)
                if res:
                    fns = [
                        (lambda w=w, x=x, o=out, e=e: torch.addmm(e, x, w.t(), out=o)) for w in ws
                    ]
                else:
                    fns = [(lambda w=w, x=x, o=out: torch.mm(x, w.t(), out=o)) for w in ws]
                cub = {"tp": tp, "op": op, "m": m, "n": n, "k": k, "bm": 0, "splits": 0,
                       "stages": 0, "ctas": 0, "mbytes": nbytes / 1e6, "floor_us": floor,
                       "status": "cublas",
                       "us": profiled(fns[0]) if args.profile else timed(fns, args)}  # fmt: skip
                rows.append(cub)
                print(cub, flush=True)
                (args.out / "tma_gemm.json").write_text(json.dumps({"copy_tbs": bw, "rows": rows}))
            del ws, packs
            torch.cuda.empty_cache()
    lines = ["| tp | op | m | kernel | packed | cm | bm | bk | splits | stages | CTAs | us | floor us | x floor | "
             "err | status |", "|---" * 16 + "|"]  # fmt: skip
    for r in rows:
        us = r.get("us")
        usf = "" if us is None else f"{us:.2f}"
        xf = "" if us is None else f"{us / r['floor_us']:.2f}"
        kern = "cuBLAS" if r["status"] == "cublas" else "tma"
        kern += "-cl" if r.get("csplit") else ""
        kern += "-ws" if r.get("wsp") else ""
        lines.append(
            f"| {r['tp']} | {r['op']} | {r['m']} | {kern} | {int(r.get('packed', 0))} | {r.get('cm', 0)} | {r['bm']} | {r.get('bk', 0)} | {r['splits']} | "
            f"{r['stages']} | {r['ctas']} | {usf} | {r['floor_us']:.2f} | {xf} | "
            f"{r.get('err', float('nan')):.1e} | {r['status']} |"
        )
    table = "\n".join(lines)
    (args.out / "table.md").write_text(table + "\n")
    print(table)
    print("ALL PASS" if ok_all else "SOME FAILED")
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
