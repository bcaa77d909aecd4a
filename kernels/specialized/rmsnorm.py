"""RMSNorm of the residual stream for the MoE block's input: ``h = bf16(bf16(r * rstd) * w)``.

A stop-gap launch: the specialized MoE block's first kernel takes the normalized ``h``; once it
recomputes the rstd in its own prologue (as :mod:`.norm_qkv_proj` does) this launch goes away
(notes/specialized.md). One CTA per token, 128 threads, 16-byte loads and stores.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32

from decodescope.kernels.specialized import interface as itf
from decodescope.kernels.specialized.utils import (
    block_sum,
    load_vec8,
    pdl_begin,
    pdl_enabled,
    store_vec8,
)

THREADS = 128


@dataclass(frozen=True)
class NormPlan:
    m: int
    n: int
    eps: float = 1e-5
    pdl: bool = field(default_factory=pdl_enabled)


class RMSNorm:
    def __init__(self, plan: NormPlan):
        if plan.n % 8:
            raise ValueError("n must be a multiple of 8")
        self.p = plan

    @cute.jit
    def __call__(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, stream: cuda.CUstream):
        @cute.struct
        class Smem:
            red: cute.struct.MemRange[Float32, 8]

        self.smem_cls = Smem
        self.kernel(mX, mW, mY).launch(
            grid=[self.p.m, 1, 1],
            block=[THREADS, 1, 1],
            smem=Smem.size_in_bytes(),
            stream=stream,
            use_pdl=self.p.pdl,
        )

    @cute.kernel
    def kernel(self, mX, mW, mY):
        p = self.p
        tidx, _, _ = cute.arch.thread_idx()
        m, _, _ = cute.arch.block_idx()
        if cutlass.const_expr(p.pdl):
            pdl_begin()
        st = cutlass.memory.SmemAllocator().allocate(self.smem_cls)
        sRed = st.red.get_tensor(cute.make_layout(8))
        nvec = p.n // 8
        per = (nvec + THREADS - 1) // THREADS
        rx = cute.make_rmem_tensor(cute.make_layout((per, 8), stride=(8, 1)), BFloat16)
        ss = Float32(0.0)
        for i in cutlass.range_constexpr(per):
            v = tidx + i * THREADS
            if v < nvec:
                load_vec8(mX[m, None], v * 8, rx[i, None])
                for e in cutlass.range_constexpr(8):
                    f = rx[i, e].to(Float32)
                    ss = ss + f * f
        ss = block_sum(ss, sRed, THREADS // 32)
        rstd = cute.math.rsqrt(ss / Float32(p.n) + Float32(p.eps))
        for i in cutlass.range_constexpr(per):
            v = tidx + i * THREADS
            if v < nvec:
                wv = cute.make_rmem_tensor((8,), BFloat16)
                yv = cute.make_rmem_tensor((8,), BFloat16)
                load_vec8(mW, v * 8, wv)
                for e in cutlass.range_constexpr(8):
                    t = (rx[i, e].to(Float32) * rstd).to(BFloat16).to(Float32)
                    yv[e] = (t * wv[e].to(Float32)).to(BFloat16)
                store_vec8(yv, mY[m, None], v * 8)


def compile_plan(p: NormPlan):
    bf = torch.bfloat16
    return itf.compiled(
        ("rmsnorm", p),
        lambda: (
            RMSNorm(p),
            (itf.fake(bf, (p.m, p.n)), itf.fake(bf, (p.n,)), itf.fake(bf, (p.m, p.n)),
             itf.env_stream()),
        ),
    )  # fmt: skip


def rmsnorm(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, eps: float) -> None:
    compile_plan(NormPlan(int(x.shape[0]), int(x.shape[1]), float(eps)))(x, w, y)


def rmsnorm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    t = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(torch.bfloat16)
    return (t.float() * w.float()).to(torch.bfloat16)
