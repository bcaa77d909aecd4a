"""One decode step of a workload under Nsight Compute: where each kernel's time goes.

Builds the ``standard`` or ``specialized`` workload, runs ``--warmup`` eager steps (compiles the
CuTe DSL kernels, fills the caches of the step), then opens the CUDA profiler API window around
one more eager step. Run it under ``ncu --profile-from-start off`` so that only that step's
kernels are profiled; ncu replays each kernel with its caches flushed (the bytes-floor condition:
the weights come from HBM), serialized (no PDL overlap), so each kernel's figures are its own.

    ncu --profile-from-start off --clock-control none --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \\
        --section WarpStateStats -o $OUT/spec_b64 \\
        python scripts/gpu_ncu.py --backend specialized --tp 8 --batch 64 --layers kda

Without ncu the profiler window is a no-op: the script then only checks that the step runs.
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("standard", "specialized"), required=True)
    ap.add_argument("--preset", default="kimi-k3")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=1, help="tokens per sequence")
    ap.add_argument("--layers", default="kda")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)

    import torch

    from decodescope.kernels.workloads import WORKLOADS

    if a.backend == "specialized":
        import decodescope.kernels.specialized.step  # noqa: F401  (registers the workload)
    opts = dict(preset=a.preset, tp_shape=a.tp, batch=a.batch, tokens_per_seq=a.tokens,
                layers=a.layers, seed=a.seed)  # fmt: skip
    t0 = time.perf_counter()
    wl = WORKLOADS[a.backend](**opts)
    for _ in range(a.warmup):
        if wl.refresh is not None:
            wl.refresh()
        wl.step()
    torch.cuda.synchronize()
    print(f"built and warmed {a.backend} {opts} in {time.perf_counter() - t0:.1f} s", flush=True)
    if wl.refresh is not None:
        wl.refresh()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    wl.step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("profiled one step", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
