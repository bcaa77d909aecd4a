"""CUDA-graph timing for the GPU check scripts (``scripts/gpu_*.py``): the medians their tables
print. Needs a CUDA GPU when called; importing it does not."""

from __future__ import annotations

import torch


def graph_time_us(fns: list, replays: int) -> tuple[float, float, float]:
    """Median / min / max us of one element of ``fns``: each runs once on a side stream (warm-up:
    compiles and allocates outside capture), then all of them are captured into one CUDA graph,
    replayed 3 times, then ``replays`` times between CUDA events; each replay's time is divided
    by ``len(fns)`` (``fns`` are usually the same work on rotated weight copies, to defeat L2)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / len(fns))
    ts.sort()
    return ts[len(ts) // 2], ts[0], ts[-1]
