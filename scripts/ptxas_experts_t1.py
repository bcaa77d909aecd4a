"""ptxas report of the ``DECODESCOPE_MOE_T1=t1`` kernels (``experts_t1.W13T1`` / ``W2T1``) on the
CPU: compiles each for sm_90a, keeps the PTX, runs ``ptxas -arch=sm_90a -v`` and prints
registers, spill stores, shared memory per CTA, the CTAs per SM those allow (H200: 65536
registers, 228 KB of shared memory with 1 KB reserved per CTA), the grid, and where the PDL wait
sits relative to the first ``cp.async`` (the pre-wait copies: shared down / w2 weights); also
the persistent w2 (``w2_t1_persist.W2T1Persist``) per ``--w2p warps,stages,per_sm``.

    python scripts/ptxas_experts_t1.py [--tp 8 16] [--rows 16 32] [--stages 6 5]
        [--w2p 2,5,3 4,4,2] [--kw 2,128,6 4,64,8]

``--kw kw,bk,stages``: W13T1 with ``kw`` warps splitting each item's K chunks
(``DECODESCOPE_MOE_T1_KW``), 16 rows, that K chunk and those stages.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import tempfile

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


def _ptxas(op, args, threads: int) -> str:
    import cutlass.cute as cute

    d = tempfile.mkdtemp(prefix="ptxas_t1_")
    cute.compile(op, *args, options=f"--enable-tvm-ffi --keep-ptx --dump-dir={d}")
    (path,) = glob.glob(f"{d}/**/*.ptx", recursive=True)
    with open(path) as f:
        ptx = f.read()
    r = subprocess.run(["ptxas", "-arch=sm_90a", "-v", path, "-o", os.devnull],
                       capture_output=True, text=True, check=False)  # fmt: skip
    if r.returncode:
        return f"ptxas failed: {r.stderr.strip()[-300:]}"
    regs = int(re.search(r"Used (\d+) registers", r.stderr).group(1))
    spills = sum(int(s) for s in re.findall(r"(\d+) bytes spill stores", r.stderr))
    smem = int(m.group(1)) if (m := re.search(r"(\d+) bytes smem", r.stderr)) else 0
    wait = ptx.find("griddepcontrol.wait")
    first_cp = ptx.find("cp.async.cg")
    by_regs = 65536 // (max(regs, 1) * threads)
    return (
        f"regs={regs} spill_stores={spills} static_smem={smem} by_regs={by_regs} "
        f"cp.async={ptx.count('cp.async.cg')} mma={ptx.count('mma.sync')} "
        f"bar={ptx.count('bar.sync')} shfl={ptx.count('shfl.sync')} "
        f"cp.async_before_wait={0 <= first_cp < wait}"
    )


def main() -> int:
    from decodescope.kernels.config import get_config
    from decodescope.kernels.specialized import experts_t1 as t1
    from decodescope.kernels.specialized import grouped_w13_tile as gt
    from decodescope.kernels.specialized import interface as itf  # noqa: F401 (arch first)
    from decodescope.kernels.specialized import w2_t1_persist as wp

    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--rows", type=int, nargs="+", default=[t1.ROWS_DEFAULT])
    ap.add_argument("--stages", type=int, nargs="+", default=[t1.STAGES_DEFAULT])
    ap.add_argument("--w2p", type=lambda v: tuple(int(x) for x in v.split(",")), nargs="*",
                    default=[(2, 5, 3)],
                    help="persistent w2 tilings warps,stages,per_sm (none: skip)")  # fmt: skip
    ap.add_argument("--kw", type=lambda v: tuple(int(x) for x in v.split(",")), nargs="*",
                    default=[], help="W13T1 K-split forms kw,bk,stages")  # fmt: skip
    a = ap.parse_args()
    for tp in a.tp:
        cfg = get_config("kimi-k3", tp)
        e = cfg.moe
        dims = (1, e.num_experts, e.top_k, cfg.expert_dim, cfg.expert_inter, cfg.hidden,
                cfg.shared_inter)  # fmt: skip
        for rows in a.rows:
            for st in a.stages:
                c = gt.TileConfig(rows=rows, bk=t1.BK_DEFAULT, stages=st, rt=1)
                op, args = t1.build_w13(*dims, 4.0, 25.0, True, 132, c)
                smem = c.smem_bytes + dims[0] * cfg.shared_inter * 2
                print(f"TP{tp} w13 r{rows} s{st}: grid={op.grid} shared rows/CTA={op.RPC} "
                      f"smem={smem} ctas/SM(smem)={(228 * 1024) // (smem + 1024)} "
                      f"{_ptxas(op, args, op.NT)}", flush=True)  # fmt: skip
        for kw, bk, st in a.kw:
            c = gt.TileConfig(rows=t1.ROWS_DEFAULT, bk=bk, stages=st, rt=1)
            op, args = t1.build_w13(*dims, 4.0, 25.0, True, 132, c, True, kw)
            smem = c.smem_bytes + dims[0] * cfg.shared_inter * 2
            print(f"TP{tp} w13 kw{kw} k{bk} s{st}: grid={op.grid} threads={op.NT} "
                  f"smem={smem} ctas/SM(smem)={(228 * 1024) // (smem + 1024)} "
                  f"{_ptxas(op, args, op.NT)}", flush=True)  # fmt: skip
        op, args = t1.build_w2(*dims)
        print(f"TP{tp} w2: grid={op.grid} smem={op.smem} "
              f"ctas/SM(smem)={(228 * 1024) // (op.smem + 384 + 1024)} "
              f"{_ptxas(op, args, op.NT)}", flush=True)  # fmt: skip
        for pw, ps, pm in a.w2p:  # DECODESCOPE_MOE_T1_W2=persist (w2_t1_persist.W2T1Persist)
            pk = wp.PersistKnobs(warps=pw, stages=ps, per_sm=pm)
            op, args = wp.build(*dims, pk=pk)
            print(f"TP{tp} w2p w{pw} s{ps} m{pm}: grid={op.grid} units={op.units} "
                  f"units/CTA<={op.UPC} R={op.R} smem={op.smem} "
                  f"ctas/SM(smem)={(228 * 1024) // (op.smem + 384 + 1024)} "
                  f"{_ptxas(op, args, op.NT)}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
