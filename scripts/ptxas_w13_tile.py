"""ptxas report of ``grouped_w13_tile.GroupedW13Tile`` at its sweep points (CPU, no GPU).

Compiles each tiling for sm_90a (``CUTE_DSL_ARCH=sm_90a``), keeps the PTX, runs ``ptxas
-arch=sm_90a -v`` and prints one line per tiling: registers, spill stores, shared memory per
CTA, the CTAs per SM those allow (H200: 65536 registers, 228 KB of shared memory with 1 KB
reserved per CTA, at most 32 CTAs / 64 warps), weight bytes in flight per SM
(``(stages - 1) * 2R * BK * 2`` per CTA) and instruction counts in the PTX.

    python scripts/ptxas_w13_tile.py [--tp 8 16] [--tokens 64]
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

# the GPU script's grouped_w13tile variants
# (rows, bk, stages, rt, persist CTAs per SM or 0)
POINTS = [(64, 128, 3, 1, 0), (64, 64, 4, 1, 0), (32, 128, 3, 1, 0), (32, 128, 4, 1, 0),
          (128, 64, 3, 2, 0), (128, 64, 3, 1, 0), (64, 64, 2, 1, 0), (32, 256, 3, 1, 0),
          (64, 128, 3, 1, 2), (64, 64, 4, 1, 3), (32, 128, 3, 1, 3)]  # fmt: skip


def report(tp: int, T: int, point) -> str:
    import cutlass.cute as cute

    from decodescope.kernels.config import get_config
    from decodescope.kernels.specialized import grouped_w13_tile as gt
    from decodescope.kernels.specialized import interface as itf  # noqa: F401 (arch first)

    cfg = get_config("kimi-k3", tp)
    e = cfg.moe
    try:
        c = gt.TileConfig(*point)
        op, args = gt.build(T, e.num_experts, e.top_k, cfg.expert_dim, cfg.expert_inter,
                            cfg.shared_inter, 4.0, 25.0, True, 132, c)  # fmt: skip
    except ValueError as ex:
        return f"not built: {ex}"
    d = tempfile.mkdtemp(prefix="ptxas_w13t_")
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
    smem = c.smem_bytes
    by_regs = 65536 // (max(regs, 1) * op.NT) if regs else 32
    by_smem = (228 * 1024) // (smem + 1024)
    ctas = min(by_regs, by_smem, 32, 64 // op.NW)
    inflight = ctas * (c.stages - 1) * c.stage_w_bytes
    return (f"regs={regs:>3} spill_stores={spills} warps={op.NW} smem={smem // 1024}KB "
            f"ctas/SM={ctas} (regs {by_regs}, smem {by_smem}) inflight/SM={inflight // 1024}KB "
            f"items/expert={op.NRT} chunks={op.NCH} grid={op.grid} "
            f"cp.async={ptx.count('cp.async.cg')} mma={ptx.count('mma.sync')} "
            f"ld.shared.v4={ptx.count('ld.shared.v4')} bar={ptx.count('bar.sync')}")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--tokens", type=int, nargs="+", default=[64])
    a = ap.parse_args()
    for tp in a.tp:
        for T in a.tokens:
            for p in POINTS:
                name = "r{}_k{}_s{}_t{}_p{}".format(*p)
                print(f"TP{tp} T={T} {name}: {report(tp, T, p)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
