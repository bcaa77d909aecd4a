"""ptxas / SASS report of the grouped route kernel (``moe_grouped.GroupedRoute``), no GPU.

Compiles each route variant for sm_90a on the CPU (``CUTE_DSL_ARCH=sm_90a``), keeps the PTX,
runs ``ptxas -arch=sm_90a -v`` (registers, spills, stack) and, where ``cuobjdump`` is found
(``--cuobjdump`` or PATH; e.g. ``pip install --target /tmp/nvtools nvidia-cuda-cuobjdump``),
counts SASS instructions: the total, the global loads issued before the first sigmoid
(``MUFU.EX2``: 1 means the logit loads are serialized behind the sigmoids), shuffles, ballots,
shared-memory atomics, GPU-scope membars, strong (acquire / relaxed.gpu) loads and L1
invalidations (``CCTL.IVALL``). Variants: ``one`` / ``split`` (rounds top-k) and ``thresh``.

    python scripts/ptxas_route.py [--tp 8 16] [--tokens 8 64] [--modes one split thresh]
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


def build(tp: int, T: int, mode: str):
    from decodescope.kernels.config import get_config
    from decodescope.kernels.specialized import moe_grouped as mg

    cfg = get_config("kimi-k3", tp)
    e = cfg.moe
    topk = "thresh" if mode == "thresh" else "rounds"
    return mg._build_route(T, e.num_experts, e.top_k, cfg.expert_dim, cfg.shared_inter, 1.0,
                           cfg.model.situ_beta, cfg.model.situ_linear_beta, True,
                           mode != "one", topk)  # fmt: skip


def sass_counts(sass: str) -> dict:
    ops = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if m:
            ops.append(re.sub(r"^@!?U?P[T0-9]+\s+", "", m.group(1).strip()))
    first_ex2 = next((i for i, o in enumerate(ops) if o.startswith("MUFU.EX2")), len(ops))
    return {
        "sass": len(ops),
        "ldg_before_1st_sigmoid": sum(o.startswith("LDG") for o in ops[:first_ex2]),
        "shfl": sum(o.startswith("SHFL") for o in ops),
        "vote": sum(o.startswith("VOTE") for o in ops),
        "atoms": sum(o.startswith("ATOMS") for o in ops),
        "membar_gpu": sum(o.startswith("MEMBAR.ALL.GPU") for o in ops),
        "ldg_strong": sum(o.startswith("LDG.E.STRONG") for o in ops),
        "cctl_ivall": sum(o.startswith("CCTL.IVALL") for o in ops),
    }


def report(tp: int, T: int, mode: str, cuobjdump: str | None) -> str:
    import cutlass.cute as cute

    op, args = build(tp, T, mode)
    d = tempfile.mkdtemp(prefix="ptxas_route_")
    cute.compile(op, *args, options=f"--enable-tvm-ffi --keep-ptx --dump-dir={d}")
    (path,) = glob.glob(f"{d}/**/*.ptx", recursive=True)
    cubin = os.path.join(d, "route.cubin")
    r = subprocess.run(["ptxas", "-arch=sm_90a", "-v", path, "-o", cubin],
                       capture_output=True, text=True, check=False)  # fmt: skip
    if r.returncode:
        return f"ptxas failed: {r.stderr.strip()[-300:]}"
    regs = re.search(r"Used (\d+) registers", r.stderr)
    spills = sum(int(s) for s in re.findall(r"(\d+) bytes spill stores", r.stderr))
    stack = re.search(r"(\d+) bytes stack frame", r.stderr)
    out = (f"grid={op.grid} threads={op.NT} regs={regs.group(1) if regs else '?'} "
           f"spill_stores={spills} stack={stack.group(1) if stack else '?'}")  # fmt: skip
    if cuobjdump:
        s = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True,
                           check=False)  # fmt: skip
        if s.returncode:
            return out + f" cuobjdump failed: {s.stderr.strip()[-200:]}"
        out += " " + " ".join(f"{k}={v}" for k, v in sass_counts(s.stdout).items())
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, nargs="+", default=[8])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--modes", nargs="+", default=["one", "split", "thresh"],
                    choices=["one", "split", "thresh"])  # fmt: skip
    ap.add_argument("--cuobjdump", default=shutil.which("cuobjdump"))
    a = ap.parse_args()
    if a.cuobjdump and not os.path.exists(a.cuobjdump):
        print(f"ptxas_route: --cuobjdump {a.cuobjdump}: no such file", file=sys.stderr)
        return 2
    if not a.cuobjdump:
        print("(no cuobjdump: ptxas numbers only)")
    for tp in a.tp:
        for T in a.tokens:
            for mode in a.modes:
                print(f"TP{tp} T={T:<3} {mode:<6} {report(tp, T, mode, a.cuobjdump)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
