"""ptxas report of the tile back end (``back_tile.BackTile``), no GPU: compiles for sm_90a on the
CPU (``CUTE_DSL_ARCH=sm_90a``), keeps the PTX and runs ``ptxas -arch=sm_90a -v`` (registers,
spills), beside the shared memory per CTA, the grid and the shared-memory vector accesses.

    python scripts/ptxas_back_tile.py [--tokens 8 32 64] [--knobs stages=3,splits=4 ...]
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


def report(T: int, kv: dict, L: int = 3584, H: int = 7168) -> str:
    import cutlass.cute as cute

    from decodescope.kernels.specialized import back_tile as bt

    bp = bt.BackPlan(m=T, k=L, n=H, eps=1e-5, **kv)
    t = bp.tile
    d = tempfile.mkdtemp(prefix="ptxas_back_tile_")
    cute.compile(bt.BackTile(bp), *bt._fake_args(bp),
                 options=f"--enable-tvm-ffi --keep-ptx --dump-dir={d}")  # fmt: skip
    (path,) = glob.glob(f"{d}/**/*.ptx", recursive=True)
    with open(path) as f:
        ptx = f.read()
    r = subprocess.run(["ptxas", "-arch=sm_90a", "-v", path, "-o", os.path.join(d, "k.cubin")],
                       capture_output=True, text=True, check=False)  # fmt: skip
    if r.returncode:
        return f"ptxas failed: {r.stderr.strip()[-300:]}"
    regs = int(re.search(r"Used (\d+) registers", r.stderr).group(1))
    spills = sum(int(s) for s in re.findall(r"(\d+) bytes spill stores", r.stderr))
    per_sm = min(228 * 1024 // (bp.smem_bytes + 1024), 65536 // (regs * t.threads))
    counts = {k: len(re.findall(k, ptx)) for k in (r"ld\.shared\.v2", r"ld\.shared\.v4",
              r"st\.shared\.v2", r"ld\.shared\.[fbu]", r"cp\.async\.cg", r"mma\.sync")}  # fmt: skip
    return (
        f"stages={t.stages} splits={t.splits} warps={t.warps} grid={t.row_ctas}x{t.splits} "
        f"chunks={t.chunks} regs={regs} spill_stores={spills} smem={bp.smem_bytes} "
        f"ctas/SM~{per_sm} ptx={counts}"
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[8, 32, 64])
    ap.add_argument("--knobs", nargs="+", default=[""], help="e.g. stages=3,splits=4 warps=8")
    a = ap.parse_args()
    for T in a.tokens:
        for ks in a.knobs:
            pairs = (x.split("=") for x in ks.split(",") if x)
            kv = {k: int(v) if v.isdigit() else v for k, v in pairs}
            print(f"T={T:<3} {ks or 'defaults':<20} {report(T, kv)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
