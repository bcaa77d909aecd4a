"""SiTU-and-mul of a gate/up product: ``act[m, d] = bf16(situ(gu[m, d], gu[m, Dn + d]))``.

The dense MLP's activation where the gate/up GEMM runs on cuBLAS over all of a chunked step's
tokens (:class:`.dense_mlp.DenseMLPAllTokens`, issue #5): ``gu [M, 2*Dn]`` is the BF16 product
of ``h`` and ``dense_w13`` (gate rows first, then up rows, vLLM's merged ``gate_up``), so the
rounding points are those of the fused tile and skinny kernels, ``bf16(situ(bf16(g),
bf16(u)))`` (:func:`situ_mul_ref`), and of the standard path's GEMM + activation.

One thread per 8 output columns of one row: a 16-byte load of 8 gate values and one of the 8
matching up values, SiTU in FP32 (:func:`.moe_common.situ`), one 16-byte store. Grid (column
blocks of ``THREADS * 8``, rows). Memory-bound: 6 bytes per output element (TP8 at 512 tokens:
6.5 MB read, 4.3 MB written).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32

from decodescope.kernels.reference import situ_ref
from decodescope.kernels.specialized import interface as itf
from decodescope.kernels.specialized.moe_common import situ
from decodescope.kernels.specialized.utils import load_vec8, pdl_begin, pdl_enabled, store_vec8

THREADS = 128
VEC = 8


@dataclass(frozen=True)
class SituPlan:
    m: int  # rows (tokens)
    dn: int  # output columns; the input has 2 * dn (gate, then up)
    beta: float
    lbeta: float
    pdl: bool = field(default_factory=pdl_enabled)

    def __post_init__(self) -> None:
        if self.m < 1:
            raise ValueError(f"situ_mul: rows must be >= 1, got {self.m}")
        if self.dn < VEC or self.dn % VEC:
            raise ValueError(
                f"situ_mul: columns must be a positive multiple of {VEC}, got {self.dn}"
            )

    @property
    def col_blocks(self) -> int:
        return (self.dn // VEC + THREADS - 1) // THREADS


class SituMul:
    def __init__(self, plan: SituPlan):
        self.p = plan

    @cute.jit
    def __call__(self, mGU: cute.Tensor, mA: cute.Tensor, stream: cuda.CUstream):
        self.kernel(mGU, mA).launch(
            grid=[self.p.col_blocks, self.p.m, 1],
            block=[THREADS, 1, 1],
            stream=stream,
            use_pdl=self.p.pdl,
        )

    @cute.kernel
    def kernel(self, mGU: cute.Tensor, mA: cute.Tensor):
        p = self.p
        tidx, _, _ = cute.arch.thread_idx()
        bx, m, _ = cute.arch.block_idx()
        if cutlass.const_expr(p.pdl):
            pdl_begin()
        v = bx * THREADS + tidx
        if v < p.dn // VEC:
            rg = cute.make_rmem_tensor((VEC,), BFloat16)
            ru = cute.make_rmem_tensor((VEC,), BFloat16)
            ra = cute.make_rmem_tensor((VEC,), BFloat16)
            load_vec8(mGU[m, None], v * VEC, rg)
            load_vec8(mGU[m, None], p.dn + v * VEC, ru)
            for e in cutlass.range_constexpr(VEC):
                ra[e] = situ(rg[e].to(Float32), ru[e].to(Float32), p.beta, p.lbeta).to(BFloat16)
            store_vec8(ra, mA[m, None], v * VEC)


def compile_plan(p: SituPlan):
    """Compile (cached) ``p``'s kernel for contiguous ``gu [m, 2 dn]`` and ``act [m, dn]``."""
    bf = torch.bfloat16

    def build():
        return SituMul(p), (itf.fake(bf, (p.m, 2 * p.dn)), itf.fake(bf, (p.m, p.dn)),
                            itf.env_stream())  # fmt: skip

    return itf.compiled(("situ_mul", p), build)


def _check(gu: torch.Tensor, act: torch.Tensor) -> None:
    if gu.dtype != torch.bfloat16 or act.dtype != torch.bfloat16:
        raise ValueError(f"situ_mul: BF16 tensors only, got {gu.dtype} and {act.dtype}")
    if gu.dim() != 2 or act.dim() != 2 or gu.shape != (act.shape[0], 2 * act.shape[1]):
        raise ValueError(f"situ_mul: gu {tuple(gu.shape)} must be [M, 2 * Dn] for act "
                         f"{tuple(act.shape)} [M, Dn]")  # fmt: skip
    if not (gu.is_contiguous() and act.is_contiguous()):
        raise ValueError("situ_mul: gu and act must be contiguous")


def situ_mul(gu: torch.Tensor, act: torch.Tensor, betas: tuple[float, float]) -> None:
    """``act = bf16(situ(gu[:, :Dn], gu[:, Dn:]))``, one launch (``betas``: SiTU's ``beta``
    and linear ``beta``)."""
    _check(gu, act)
    p = SituPlan(int(act.shape[0]), int(act.shape[1]), float(betas[0]), float(betas[1]))
    compile_plan(p)(gu, act)


def situ_mul_ref(gu: torch.Tensor, betas: tuple[float, float]) -> torch.Tensor:
    """The kernel's torch reference: FP32 math on the BF16 inputs, one BF16 rounding."""
    dn = gu.shape[1] // 2
    g, u = gu[:, :dn].float(), gu[:, dn:].float()
    return situ_ref(g, u, betas[0], betas[1]).to(torch.bfloat16)
