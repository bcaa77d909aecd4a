"""``toy``: a small two-layer decode step for testing the capture, not a model.

Each layer runs several ops, each in its own range (DESIGN.md section 6), mixing the three ways
kernels get launched:

- torch ops (cuBLAS GEMMs, elementwise kernels; the runtime's ``cudaLaunchKernel``),
- one Triton kernel (``silu_mul``; the driver's ``cuLaunchKernel``),
- one CuTe DSL kernel (``residual_add``, compiled with ``--enable-tvm-ffi`` so it takes torch
  tensors and launches on torch's current stream; the driver's ``cuLaunchKernelEx``),

so that a capture proves attribution for every launch path, eager and under CUDA-graph replay.
The step is capturable: no host sync, no allocation whose address changes after warm-up
(outputs of the CuTe and Triton ops are preallocated; torch's own temporaries live in the
graph's private pool).

Ranges per layer i (kind alternates kda, mla): ``layer.{i}.attn.norm``, ``layer.{i}.attn.qkv_proj``,
``layer.{i}.attn.gate`` (Triton), ``layer.{i}.attn.o_proj``, ``layer.{i}.attn.residual`` (CuTe),
``layer.{i}.moe.router``, ``layer.{i}.moe.experts``, ``layer.{i}.moe.residual`` (CuTe).
"""

# no "from __future__ import annotations": CuTe DSL evaluates kernel annotations at compile time

import json
import os
from typing import Any

from decodescope.kernels.workloads import Workload, register
from decodescope.tracer import range as trange

# ops in launch order, with the implementation each uses: the tests' ground truth
OPS: list[tuple[str, str, str]] = [
    ("attn", "norm", "torch"),
    ("attn", "qkv_proj", "torch"),
    ("attn", "gate", "triton:decodescope"),
    ("attn", "o_proj", "torch"),
    ("attn", "residual", "cute:decodescope"),
    ("moe", "router", "torch"),
    ("moe", "experts", "torch"),
    ("moe", "residual", "cute:decodescope"),
]
KINDS = ("kda", "mla")

_cute_cache: dict[int, Any] = {}


def _cute_add(n: int):
    """A compiled CuTe DSL ``c = a + b`` over ``n`` fp32 elements (TVM-FFI, env stream)."""
    if n in _cute_cache:
        return _cute_cache[n]
    if not _has_cuda():
        os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # compile-only on a CPU machine
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    threads = 128

    @cute.kernel
    def add_kernel(mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        i = bidx * threads + tidx
        if i < cute.size(mA):
            mC[i] = mA[i] + mB[i]

    @cute.jit
    def residual_add(mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, stream):
        blocks = (cute.size(mA) + threads - 1) // threads
        add_kernel(mA, mB, mC).launch(grid=(blocks, 1, 1), block=(threads, 1, 1), stream=stream)

    fakes = [make_fake_compact_tensor(cutlass.Float32, (n,), assumed_align=16) for _ in range(3)]
    fn = cute.compile(
        residual_add,
        *fakes,
        make_fake_stream(use_tvm_ffi_env_stream=True),
        options="--enable-tvm-ffi",
    )
    _cute_cache[n] = fn
    return fn


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


try:  # Triton resolves names through the kernel's module globals: define it at module level
    import triton
    import triton.language as tl
except ImportError:  # a CPU machine without Triton: the toy cannot run there anyway
    triton = None

if triton is not None:

    @triton.jit
    def silu_mul_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = col < n
        g = tl.load(x_ptr + row * 2 * n + col, mask=mask)
        u = tl.load(x_ptr + row * 2 * n + n + col, mask=mask)
        tl.store(out_ptr + row * n + col, g * tl.sigmoid(g) * u, mask=mask)


def _silu_mul():
    """The Triton op: ``out = silu(x[:, :n]) * x[:, n:]`` for a [B, 2n] fp32 input."""
    if triton is None:
        raise RuntimeError("the toy workload needs Triton")

    def silu_mul(x, out):
        b, n = out.shape
        block = 1024
        silu_mul_kernel[(b, triton.cdiv(n, block))](x, out, n, BLOCK=block)

    return silu_mul


def reference_ops(layers: int = 2) -> list[tuple[int, str, str, str]]:
    """(layer, kind, range name, impl) in launch order: what a capture must attribute to."""
    out = []
    for i in range(layers):
        for block, op, impl in OPS:
            out.append((i, KINDS[i % 2], f"layer.{i}.{block}.{op}", impl))
    return out


@register("toy")
def make_toy(batch: int | str = 1, hidden: int | str = 1024, inter: int | str = 2048, layers: int | str = 2,
             seed: int | str = 0, **_: Any) -> Workload:  # fmt: skip
    import torch

    b, h, f, nl = int(batch), int(hidden), int(inter), int(layers)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(int(seed))

    def w(*shape):
        return torch.randn(*shape, device=dev, generator=gen) / shape[0] ** 0.5

    params = [
        {
            "norm": torch.ones(h, device=dev),
            "qkv": w(h, 2 * f),
            "o": w(f, h),
            "router": w(h, 64),
            "experts": w(h, h),
        }
        for _ in range(nl)
    ]
    x = torch.randn(b, h, device=dev, generator=gen)
    gate_out = torch.empty(b, f, device=dev)
    add = _cute_add(b * h)
    silu_mul = _silu_mul()

    def refresh() -> None:
        x.normal_(generator=gen)

    def step() -> None:
        for i, p in enumerate(params):
            with trange(f"layer.{i}:{KINDS[i % 2]}"):
                with trange(f"layer.{i}.attn.norm"):
                    hn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * p["norm"]
                with trange(f"layer.{i}.attn.qkv_proj"):
                    qkv = hn @ p["qkv"]
                with trange(f"layer.{i}.attn.gate"):
                    silu_mul(qkv, gate_out)
                with trange(f"layer.{i}.attn.o_proj"):
                    o = gate_out @ p["o"]
                with trange(f"layer.{i}.attn.residual"):
                    add(x.view(-1), o.view(-1), x.view(-1))
                with trange(f"layer.{i}.moe.router"):
                    probs = torch.softmax(x @ p["router"], dim=-1)
                with trange(f"layer.{i}.moe.experts"):
                    e = torch.relu(x @ p["experts"]) * probs[:, :1]
                with trange(f"layer.{i}.moe.residual"):
                    add(x.view(-1), e.view(-1), x.view(-1))

    config = {
        "hidden": h,
        "inter": f,
        "layers": nl,
        "op_impl": {name: impl for _, _, name, impl in reference_ops(nl)},
    }
    meta = {
        "workload": "toy",
        "backend": "other",
        "preset": "toy",
        "batch": b,
        "tp_shape": 1,
        "tp_world": 1,
        "config_json": json.dumps(config),
        "notes": "capture test workload: torch ops, one Triton and one CuTe DSL kernel per layer",
    }
    return Workload(name="toy", step=step, refresh=refresh, meta=meta)
