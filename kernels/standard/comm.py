"""The standard path's cross-rank sum: NCCL (``dist.all_reduce``) or a one-shot all-reduce
through torch symmetric memory, chosen by the workload option ``allreduce``.

- ``nccl``: ``torch.distributed.all_reduce`` in place on the default process group (NCCL on a
  GPU, gloo on a CPU for tests); it captures into the CUDA graph like any kernel.
- ``oneshot``: what vLLM's custom all-reduce does on one NVLink node: every rank reads all peers'
  buffers and sums them in one kernel (``torch.ops.symm_mem.one_shot_all_reduce_out``). The
  tensors the layer reduces are allocated in symmetric memory (:meth:`Comm.buffer`), so the GEMM
  before the reduction writes straight into the peers' view and the reduction reads it in place,
  writing the sum into a plain buffer beside it (one kernel, as vLLM's in CUDA graphs where its
  input buffers are registered). A tensor not allocated here is first copied into a symmetric
  staging buffer (one copy kernel more; the first call must come before graph capture).

Reusing a symmetric buffer is safe under graph replay: a rank writes a buffer again only a whole
step later, after it has passed the barriers of the layer's other all-reduces, which a peer
reaches only after it has finished reading that buffer.

Multicast (NVLS) stays off in every process (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1: tracer/distributed.py sets them before torch starts); the one-shot
kernel does not use multicast.
"""

from __future__ import annotations

import torch

ALLREDUCE_IMPLS = ("nccl", "oneshot")


class Comm:
    """Sum over the ranks of the default process group."""

    def __init__(self, impl: str = "nccl", device: torch.device | str | None = None) -> None:
        import torch.distributed as dist

        if impl not in ALLREDUCE_IMPLS:
            raise ValueError(f"allreduce must be one of {', '.join(ALLREDUCE_IMPLS)}, got {impl!r}")
        if not dist.is_initialized():
            raise RuntimeError(
                "tp_world > 1 needs torch.distributed initialised (run through "
                "decodescope.tracer.distributed, which starts one process per rank)"
            )
        self.impl = impl
        self.world = dist.get_world_size()
        self.rank = dist.get_rank()
        self.device = torch.device(device) if device is not None else None
        self.group_name = dist.group.WORLD.group_name
        self._out: dict[int, torch.Tensor] = {}  # symmetric buffer data_ptr -> its sum buffer
        self._stage: dict[tuple, torch.Tensor] = {}  # staging buffers for other tensors
        if impl == "oneshot":
            if self.device is None or self.device.type != "cuda":
                raise ValueError("allreduce=oneshot needs CUDA devices (symmetric memory)")
            import torch.distributed._symmetric_memory as symm_mem

            self._symm = symm_mem
            self._op = torch.ops.symm_mem.one_shot_all_reduce_out

    @property
    def impl_name(self) -> str:
        """What ``op_impl`` records for the all-reduce ops."""
        if self.impl == "nccl":
            import torch.distributed as dist

            return f"torch.distributed:{dist.get_backend()}"
        return "torch:symm_mem.one_shot_all_reduce_out"

    def _symmetric(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = self._symm.empty(shape, dtype=dtype, device=self.device)
        self._symm.rendezvous(t, self.group_name)  # collective: every rank, same order
        return t

    def buffer(self, *shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """A tensor the layer will reduce: symmetric memory for ``oneshot``, plain otherwise.
        Allocate on every rank in the same order (the symmetric allocation is collective)."""
        if self.impl != "oneshot":
            return torch.empty(shape, dtype=dtype, device=self.device)
        t = self._symmetric(tuple(shape), dtype)
        self._out[t.data_ptr()] = torch.empty(shape, dtype=dtype, device=self.device)
        return t

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks; returns the tensor that holds the sum (``t`` itself for
        ``nccl``; for ``oneshot`` the sum buffer paired with ``t``, or ``t`` after staging)."""
        if self.impl == "nccl":
            import torch.distributed as dist

            dist.all_reduce(t)
            return t
        out = self._out.get(t.data_ptr())
        if out is not None and out.shape == t.shape:
            self._op(t, "sum", self.group_name, out)
            return out
        key = (tuple(t.shape), t.dtype, t.data_ptr())
        stage = self._stage.get(key)
        if stage is None:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "allreduce=oneshot: the first reduction of a tensor not allocated by "
                    "Comm.buffer ran inside graph capture (run one eager step first)"
                )
            stage = self._stage[key] = self._symmetric(tuple(t.shape), t.dtype)
        stage.copy_(t)
        self._op(stage, "sum", self.group_name, t)
        return t


def init_from_env(tp_world: int) -> tuple[int, torch.device]:
    """Join the process group the launcher set up (tracer/distributed.py): RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR, MASTER_PORT. Selects the GPU LOCAL_RANK (NCCL) or runs on the CPU
    (gloo) when there is no GPU. Returns ``(rank, device)``; a no-op when already joined."""
    import os

    import torch.distributed as dist

    for k, v in (
        ("NCCL_NVLS_ENABLE", "0"),
        ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
        ("NVSHMEM_DISABLE_NVLS", "1"),
    ):
        os.environ[k] = v  # the launcher set them already; never multicast, whatever the caller
    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    if cuda:
        torch.cuda.set_device(local)
    dev = torch.device("cuda", local) if cuda else torch.device("cpu")
    if dist.is_initialized():
        if dist.get_world_size() != tp_world:
            raise ValueError(
                f"tp_world={tp_world} but the process group has {dist.get_world_size()} ranks"
            )
        return dist.get_rank(), dev
    missing = [
        k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ
    ]
    if missing:
        raise RuntimeError(
            f"tp_world={tp_world} needs one process per rank: {', '.join(missing)} not set "
            "(decodescope capture --tp-world N starts them)"
        )
    world = int(os.environ["WORLD_SIZE"])
    if world != tp_world:
        raise ValueError(f"tp_world={tp_world} but WORLD_SIZE={world}")
    import datetime

    dist.init_process_group(
        "nccl" if cuda else "gloo",
        rank=int(os.environ["RANK"]),
        world_size=world,
        timeout=datetime.timedelta(seconds=float(os.environ.get("DECODESCOPE_DIST_TIMEOUT", 300))),
        device_id=dev if cuda else None,
    )
    import atexit

    atexit.register(_leave)
    return dist.get_rank(), dev


def _leave() -> None:
    """Destroy the process group this module joined, at interpreter exit. Left to the
    interpreter's teardown, a live gloo group's threads could abort the process after its work
    was done ("terminate called without an active exception", SIGABRT: a failed rank to the
    launcher); torch asks for an explicit destroy."""
    import torch.distributed as dist

    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - exit path: the work and its outputs are already done
        pass
