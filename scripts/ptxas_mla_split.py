"""ptxas report of the three-phase MLA decode (``mla_decode_split.MLADecodeSplit``), no GPU:
compiles for sm_90a on the CPU (``CUTE_DSL_ARCH=sm_90a``), keeps the PTX and runs ``ptxas
-arch=sm_90a -v`` (registers, spills) beside the plan (items per phase, shared memory, CTAs/SM).

    python scripts/ptxas_mla_split.py [--tp 8] [--batch 1 8 32] [--knobs splits=8,nbuf=2 ...]

Knobs: splits, achunks, vrows, nbuf (the plan's ``*_force`` fields), or any other plan field by
its name (``uvfast=1``, ``l2pre=1``, ``trace=1``).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import re
import subprocess
import sys
import tempfile

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


def report(tp: int, batch: int, kv: dict) -> str:
    import cutlass.cute as cute

    from decodescope.kernels.config import get_config
    from decodescope.kernels.specialized import mla_decode_split as ms

    p = ms.plan_for(get_config("kimi-k3", tp), batch, 1)
    names = {f.name for f in dataclasses.fields(p)}
    p = dataclasses.replace(p, **{(k if k in names else f"{k}_force"): v for k, v in kv.items()})
    d = tempfile.mkdtemp(prefix="ptxas_mla_split_")
    cute.compile(ms.MLADecodeSplit(p), *ms._fake_args(p),
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
    counts = {k: len(re.findall(k, ptx)) for k in (r"ldmatrix", r"cp\.async\.cg", r"mma\.sync",
              r"ld\.global\.cg")}  # fmt: skip
    return (
        f"splits={p.splits} blk_max={p.blk_max} nbuf={p.nbuf} achunks={p.achunks} "
        f"vchunks={p.vchunks} vrows={p.vrows} items={p.n_abs}+{p.n_att}+{p.n_uv}={p.grid} "
        f"smem={p.smem_bytes} ctas/SM={p.ctas_per_sm} regs={regs} spill_stores={spills} "
        f"ptx={counts}"
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--knobs", nargs="+", default=[""], help="e.g. splits=8,nbuf=2")
    a = ap.parse_args()
    for b in a.batch:
        for ks in a.knobs:
            kv = {k: int(v) for k, v in (x.split("=") for x in ks.split(",") if x)}
            print(f"TP{a.tp} {b}x1 {ks or 'defaults':<20} {report(a.tp, b, kv)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
