"""ptxas report of the tile w2 kernel (``grouped_w2_tile.GroupedW2Tile``), no GPU: compiles for
sm_90a on the CPU (``CUTE_DSL_ARCH=sm_90a``), keeps the PTX and runs ``ptxas -arch=sm_90a -v``
(registers, spills), beside the shared memory per CTA and the CTAs per SM it allows.

    python scripts/ptxas_w2_tile.py [--tp 8 16] [--tokens 8 64] [--knobs warps=4,rt=1 ...]
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


def report(tp: int, T: int, kv: dict) -> str:
    import cutlass.cute as cute

    from decodescope.kernels.config import get_config
    from decodescope.kernels.specialized import grouped_w2_tile as gt

    cfg = get_config("kimi-k3", tp)
    e = cfg.moe
    kn = gt.TileKnobs(**kv)
    op, args = gt.build(T, e.num_experts, e.top_k, cfg.expert_dim, cfg.expert_inter, cfg.hidden,
                        cfg.shared_inter, True, 132, kn)  # fmt: skip
    d = tempfile.mkdtemp(prefix="ptxas_w2t_")
    cute.compile(op, *args, options=f"--enable-tvm-ffi --keep-ptx --dump-dir={d}")
    (path,) = glob.glob(f"{d}/**/*.ptx", recursive=True)
    r = subprocess.run(["ptxas", "-arch=sm_90a", "-v", path, "-o", os.path.join(d, "k.cubin")],
                       capture_output=True, text=True, check=False)  # fmt: skip
    if r.returncode:
        return f"ptxas failed: {r.stderr.strip()[-300:]}"
    regs = int(re.search(r"Used (\d+) registers", r.stderr).group(1))
    spills = sum(int(s) for s in re.findall(r"(\d+) bytes spill stores", r.stderr))
    smem = op.smem + 256 + 1024  # + alignment slack + the per-CTA reserve
    per_sm = min(228 * 1024 // smem, 65536 // (regs * op.NT), 64 * 32 // op.NT, 32)
    return (
        f"load={op.load} R={op.R} BK={op.BK} stages={op.stages} bufs={op.nbuf} MT={op.MT} threads={op.NT} "
        f"regs={regs} spill_stores={spills} smem={op.smem} ctas/SM~{per_sm} grid={op.grid}"
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--knobs", nargs="+", default=[""], help="e.g. warps=4,rt=2 bk=64,stages=3")
    a = ap.parse_args()
    for tp in a.tp:
        for T in a.tokens:
            for ks in a.knobs:
                kv = {k: v if k in ("load", "order", "shared") else int(v)
                      for k, v in (x.split("=") for x in ks.split(",") if x)}  # fmt: skip
                print(f"TP{tp} T={T:<3} {ks or 'defaults':<20} {report(tp, T, kv)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
