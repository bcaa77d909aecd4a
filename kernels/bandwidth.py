"""Device copy bandwidth, measured in the process that runs a workload (DESIGN.md section 7).

The bytes floor of a layer is ``layer_bytes / copy_bw``; both are recorded in every run of ours.
"""

from __future__ import annotations

import statistics


def copy_bandwidth_tbs(nbytes: int = 1 << 30, repeats: int = 20) -> float:
    """Median device-to-device copy bandwidth in TB/s, counting bytes read plus bytes written.

    Copies one buffer into another (each ``nbytes``, far past the L2) with CUDA events around
    each copy, after a warm-up, and returns the median.
    """
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("copy bandwidth needs a CUDA device")
    n = nbytes // 2
    src = torch.randn(n, device="cuda", dtype=torch.float32).to(torch.bfloat16)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    moved = 2 * src.numel() * src.element_size()
    del src, dst
    torch.cuda.empty_cache()
    return moved / statistics.median(times) / 1e12
