"""ptxas report of the persistent w13 at one token (``w13_t1_persist.W13T1Persist``) on the CPU,
beside W13T1 (its default tiling): compiles each for sm_90a at kimi-k3 TP8 / TP16, runs
``ptxas -arch=sm_90a -v`` (:func:`ptxas_experts_t1._ptxas`) and prints registers, spill stores,
the grid, units, shared memory per CTA and the CTAs per SM it allows.

    python scripts/ptxas_w13_t1_persist.py [--tp 8 16] [--w13p 1,16,1 1,8,2 1,6,3 1,16,1,4]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


def main() -> int:
    from decodescope.kernels.config import get_config
    from decodescope.kernels.specialized import experts_t1 as t1
    from decodescope.kernels.specialized import interface as itf  # noqa: F401 (arch first)
    from decodescope.kernels.specialized import w13_t1_persist as w13p

    spec = importlib.util.spec_from_file_location(
        "ptxas_experts_t1", Path(__file__).with_name("ptxas_experts_t1.py")
    )
    px = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(px)
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--w13p", type=lambda v: tuple(int(x) for x in v.split(",")), nargs="*",
                    default=[(1, 16, 1)], help="tilings warps,stages,per_sm[,sdrows]")  # fmt: skip
    ap.add_argument("--no-tile", action="store_true", help="skip W13T1")
    a = ap.parse_args()
    for tp in a.tp:
        cfg = get_config("kimi-k3", tp)
        e = cfg.moe
        dims = (1, e.num_experts, e.top_k, cfg.expert_dim, cfg.expert_inter, cfg.hidden,
                cfg.shared_inter)  # fmt: skip
        hs = cfg.shared_inter * 2
        if not a.no_tile:
            op, args = t1.build_w13(*dims, 4.0, 25.0)
            smem = op.cfg.smem_bytes + hs
            print(f"TP{tp} w13 tile: grid={op.grid} shared rows/CTA={op.RPC} smem={smem} "
                  f"ctas/SM(smem)={(228 * 1024) // (smem + 1024)} {px._ptxas(op, args, op.NT)}",
                  flush=True)  # fmt: skip
        for q in a.w13p:
            qw, qs, qm, sd = (*q, 1)[:4]
            pk = w13p.PersistKnobs(warps=qw, stages=qs, per_sm=qm, sd=sd)
            op, args = w13p.build(*dims, 4.0, 25.0, pk=pk)
            smem = op.cfg.smem_bytes + hs
            print(f"TP{tp} w13p w{qw} s{qs} m{qm} sd{sd}: grid={op.grid} units={op.units} "
                  f"units/CTA<={op.UPC} R={op.R} shared rows/CTA={op.RPC} smem={smem} "
                  f"ctas/SM(smem)={(228 * 1024) // (smem + 1024)} {px._ptxas(op, args, op.NT)}",
                  flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
