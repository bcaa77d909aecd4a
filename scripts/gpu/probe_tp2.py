"""Two-GPU probe: NCCL all-reduce and torch symmetric memory inside a CUDA graph.

    torchrun --nproc-per-node 2 scripts/gpu/probe_tp2.py

Prints, per rank: torch/NCCL versions, whether symmetric memory rendezvous works, and the CUDA-graph
replay median of an all-reduce of [batch, 7168] bf16 (NCCL; torch's one-shot symmetric-memory
all-reduce where it exists) at batch 1 and 64. Multicast stays off (env set before torch loads).
"""

import os

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import statistics  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def graph_median_us(fn, replays: int = 200, inner: int = 20) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(inner):
            fn()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / inner)
    return statistics.median(times)


def main() -> None:
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    print(f"rank {rank}: torch {torch.__version__} nccl {torch.cuda.nccl.version()}", flush=True)
    symm = None
    try:
        import torch.distributed._symmetric_memory as symm_mem

        buf = symm_mem.empty(64 * 7168, dtype=torch.bfloat16, device=f"cuda:{rank}")
        h = symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
        symm = (symm_mem, buf, h)
        print(f"rank {rank}: symm_mem ok, world {h.world_size}, peers {len(h.buffer_ptrs)}")
    except Exception as e:  # report, go on
        print(f"rank {rank}: symm_mem FAILED: {type(e).__name__}: {e}")
    for b in (1, 64):
        x = torch.randn(b, 7168, device="cuda", dtype=torch.bfloat16)
        ref = x.float() * 2 if False else None  # noqa: F841
        us = graph_median_us(lambda x=x: dist.all_reduce(x))
        print(f"rank {rank}: nccl all_reduce batch {b}: {us:.1f} us (graph, median)")
        if symm is not None:
            symm_mem, buf, h = symm
            try:
                inp = buf[: b * 7168].view(b, 7168)
                inp.normal_()
                want = inp.float().clone()
                dist.all_reduce(want)
                got = torch.ops.symm_mem.one_shot_all_reduce(
                    inp, "sum", dist.group.WORLD.group_name
                )
                err = (got.float() - want).norm() / want.norm()
                us = graph_median_us(
                    lambda inp=inp: torch.ops.symm_mem.one_shot_all_reduce(
                        inp, "sum", dist.group.WORLD.group_name
                    )
                )
                print(f"rank {rank}: one_shot batch {b}: {us:.1f} us (graph), rel err {err:.2e}")
            except Exception as e:
                print(f"rank {rank}: one_shot batch {b} FAILED: {type(e).__name__}: {e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
