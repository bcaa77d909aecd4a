"""ptxas report of the streaming GEMV (:mod:`.gemv_stream`) on the attention projections.

Compiles each plan for sm_90a on the CPU (``CUTE_DSL_ARCH=sm_90a``, no GPU), keeps the PTX,
runs ``ptxas -arch=sm_90a -v`` and prints per plan: registers, spill stores, 16-byte global
loads (``ld.global.v4``) and how many precede ``griddepcontrol.wait``, bulk L2 prefetches,
grid, CTAs per SM (by registers / threads / shared memory) and whether the grid is resident
at once on 132 SMs.

    python scripts/ptxas_gemv.py [--tp 8 16] [-m 1 2 4] [-k in_proj o_proj] [--cfg w8r2g2d2]
        [--l2-all]
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


def cases(tp: int) -> dict:
    from decodescope.kernels.config import get_config

    cfg = get_config("kimi-k3", tp)
    return {
        "in_proj": dict(k=cfg.hidden, segments=(cfg.kda_in_proj_out,), norm=True,
                        add_residual=True, eps=cfg.eps),
        "qkv_a_g": dict(k=cfg.hidden, segments=(cfg.mla_qkv_a_out, cfg.mla_v_dim), norm=True,
                        add_residual=True, eps=cfg.eps),
        "q_b": dict(k=cfg.mla.q_lora_rank, segments=(cfg.mla_q_b_out,), norm=True,
                    x_stride=cfg.mla_qkv_a_out, eps=cfg.eps),
        "o_proj": dict(k=cfg.kda_dim, segments=(cfg.hidden,), residual_epilogue=True),
    }  # fmt: skip


def ptx_of(plan) -> str:
    import cutlass.cute as cute

    from decodescope.kernels.specialized import gemv_stream as gs

    d = tempfile.mkdtemp(prefix="ptxas_gemv_")
    cute.compile(gs.GemvStream(plan), *gs._fake_args(plan),
                 options=f"--enable-tvm-ffi --keep-ptx --dump-dir={d}")  # fmt: skip
    (path,) = glob.glob(f"{d}/**/*.ptx", recursive=True)
    with open(path) as f:
        return path, f.read()


def report(plan) -> str:
    path, ptx = ptx_of(plan)
    wait = ptx.find("griddepcontrol.wait")
    pat = r"ld\.global[.\w:]*\.v4"
    loads = len(re.findall(pat, ptx))
    early = len(re.findall(pat, ptx[: max(wait, 0)]))
    pf = ptx.count("cp.async.bulk.prefetch.L2")
    r = subprocess.run(["ptxas", "-arch=sm_90a", "-v", path, "-o", os.devnull],
                       capture_output=True, text=True)  # fmt: skip
    if r.returncode:
        return f"ptxas failed: {r.stderr.strip()[-300:]}"
    regs = int(re.search(r"Used (\d+) registers", r.stderr).group(1))
    spill = re.search(r"(\d+) bytes spill stores", r.stderr)
    per_sm = plan.resident_estimate(regs)
    res = "yes" if plan.grid <= 132 * per_sm else "no"
    return (
        f"regs {regs:3d} spill {spill.group(1) if spill else '?'} ld.v4 {loads} "
        f"(before wait {early}) bulk-pf {pf} grid {plan.grid} ctas/SM {per_sm} "
        f"resident {res} in-flight regs {plan.in_flight_regs()}"
    )


def main() -> int:
    from decodescope.kernels.specialized import gemv_stream as gs

    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, nargs="+", default=[8, 16])
    ap.add_argument("-m", type=int, nargs="+", default=[1])
    ap.add_argument("-k", nargs="+", default=["in_proj", "qkv_a_g", "q_b", "o_proj"])
    ap.add_argument(
        "--cfg",
        nargs="+",
        default=["auto"],
        help="wWrRgGdD or auto, suffixes n (nc loads) / x (prologue in registers)",
    )
    ap.add_argument("--l2-all", action="store_true")
    a = ap.parse_args()
    for tp in a.tp:
        cs = cases(tp)
        for name in a.k:
            for m in a.m:
                for c in a.cfg:
                    segs = cs[name]["segments"]
                    w, r, g, d = gs.parse_cfg(c) or gs.auto_cfg(segs, m)
                    plan = gs.GemvPlan(m=m, warps=w, rows=r, group=g, depth=d,
                                       ld=gs.parse_ld(c), xload=gs.parse_xload(c),
                                       l2_all=a.l2_all, **cs[name])  # fmt: skip
                    tag = f"{c}=w{w}r{r}g{g}d{d}" if c.startswith("auto") else c
                    print(f"tp{tp} {name:8s} M{m} {tag}: {report(plan)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
