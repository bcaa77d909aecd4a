"""Device copy bandwidth and BF16 GEMM rate, measured in the process that runs a workload
(DESIGN.md section 7).

The bytes floor of a layer is ``layer_bytes / copy_bw``; both are recorded in every run of ours.
An op's compute floor is its tensor-core FLOPs over ``gemm_tflops`` (:mod:`.flops`), recorded
beside the copy bandwidth since session 38.
"""

from __future__ import annotations

import functools
import statistics


def _median_s(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` on the current stream: three warm-up calls, then ``repeats``
    calls each between two CUDA events."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    return statistics.median(times)


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
    t = _median_s(functools.partial(dst.copy_, src), repeats)
    moved = 2 * src.numel() * src.element_size()
    del src, dst
    torch.cuda.empty_cache()
    return moved / t / 1e12


def gemm_tflops(n: int = 8192, repeats: int = 20) -> float:
    """Median BF16 GEMM rate in TFLOP/s: cuBLAS's ``[n, n] x [n, n]`` product (FP32
    accumulation, ``2 n^3`` FLOPs) timed with CUDA events after a warm-up, in the process that
    runs the workload, as the copy bandwidth is. The compute floor of an op is its tensor-core
    FLOPs over this rate (:mod:`decodescope.kernels.flops`)."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("the GEMM rate needs a CUDA device")
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(n, n, device="cuda", generator=g).to(torch.bfloat16)
    b = torch.randn(n, n, device="cuda", generator=g).to(torch.bfloat16)
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    t = _median_s(functools.partial(torch.mm, a, b, out=c), repeats)
    del a, b, c
    torch.cuda.empty_cache()
    return 2 * n**3 / t / 1e12
