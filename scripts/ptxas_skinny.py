"""ptxas report of the skinny GEMM's attention plans, register loads vs the cp.async ring.

Compiles each plan for sm_90a on the CPU (``CUTE_DSL_ARCH=sm_90a``, no GPU), keeps the PTX,
runs ``ptxas -arch=sm_90a -v`` on it and prints one line per plan: registers, spill stores,
the ``cp.async.cg`` / ``cp.async.wait_group`` instruction counts, chunks per warp, runtime
rounds, ring bytes and grid. Shapes: kimi-k3 KDA norm+in_proj, o_proj + residual, MLA
norm+qkv_a+g (two segments), q_b (norm, strided input), at TP8 / TP16 and M = 1, 2, 8; the
dense MLP's gate_up (SiTU, two row tiles per CTA) and down where they are skinny plans.

    python scripts/ptxas_skinny.py [--load regs ring] [--stages 4] [--unroll 32] [-k in_proj]
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


def plans(tp: int, m: int, **kw) -> dict:
    import dataclasses

    from decodescope.kernels.config import get_config
    from decodescope.kernels.specialized import dense_mlp as dm
    from decodescope.kernels.specialized import skinny_gemm as sg

    cfg = get_config("kimi-k3", tp)
    dense = {"dense_gate_up": dm.gate_up_plan(cfg, m), "dense_down": dm.down_plan(cfg, m)}
    dense = {n: dataclasses.replace(p, **kw) for n, p in dense.items()
             if isinstance(p, sg.GemmPlan)}  # fmt: skip
    return dense | {
        "in_proj": sg.GemmPlan(m=m, k=cfg.hidden, segments=(cfg.kda_in_proj_out,), norm=True,
                               add_residual=True, eps=cfg.eps, **kw),
        "o_proj": sg.GemmPlan(m=m, k=cfg.kda_dim, segments=(cfg.hidden,),
                              residual_epilogue=True, **kw),
        "qkv_a_g": sg.GemmPlan(m=m, k=cfg.hidden, segments=(cfg.mla_qkv_a_out, cfg.mla_v_dim),
                               norm=True, add_residual=True, eps=cfg.eps, **kw),
        "q_b": sg.GemmPlan(m=m, k=cfg.mla.q_lora_rank, segments=(cfg.mla_q_b_out,), norm=True,
                           x_stride=cfg.mla_qkv_a_out, eps=cfg.eps, **kw),
    }  # fmt: skip


def report(plan) -> str:
    import cutlass.cute as cute

    from decodescope.kernels.specialized import skinny_gemm as sg

    d = tempfile.mkdtemp(prefix="ptxas_skinny_")
    opts = f"--enable-tvm-ffi --keep-ptx --dump-dir={d}"
    cute.compile(sg.SkinnyGemm(plan), *sg._fake_args(plan), options=opts)
    (path,) = glob.glob(f"{d}/**/*.ptx", recursive=True)
    with open(path) as f:
        ptx = f.read()
    r = subprocess.run(["ptxas", "-arch=sm_90a", "-v", path, "-o", os.devnull],
                       capture_output=True, text=True, check=False)  # fmt: skip
    if r.returncode:
        return f"ptxas failed: {r.stderr.strip()[-300:]}"
    regs = re.search(r"Used (\d+) registers", r.stderr)
    spills = sum(int(s) for s in re.findall(r"(\d+) bytes spill stores", r.stderr))
    return (f"regs={regs.group(1) if regs else '?':>3} spill_stores={spills} "
            f"cp.async.cg={ptx.count('cp.async.cg')} wait_group={ptx.count('cp.async.wait_group')} "
            f"chunks/warp={plan.chunks_per_warp} rounds={plan.ring_rounds} "
            f"ring_bytes={plan.ring_bytes} grid={plan.grid}")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--load", nargs="+", default=["regs", "ring"], choices=["regs", "ring"])
    ap.add_argument("--tp", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 2, 8])
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--unroll", type=int, default=32, help="GemmPlan.ring_unroll")
    ap.add_argument("-k", default="", help="only shapes whose name contains this")
    a = ap.parse_args()
    for tp in a.tp:
        for m in a.m:
            for load in a.load:
                kw = dict(load=load, stages=a.stages, ring_unroll=a.unroll)
                for name, plan in plans(tp, m, **kw).items():
                    if a.k in name:
                        print(f"tp{tp} {name:8s} m{m} {load:4s} {report(plan)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
