"""RMSNorm of the residual stream, ``h = bf16(bf16(r * rstd) * w)``, optionally after the
residual add ``r = bf16(x + r_in)`` (written out as the new residual).

Two uses: the MoE block's input (its first kernel takes the normalized ``h``; once it
recomputes the rstd in its own prologue this launch goes away), and, at more than
``FUSED_NORM_MAX_M`` tokens, the attention input: there the skinny GEMM's fused prologue would
make each of its CTAs read ``x`` and ``r`` twice (M x K x 8 bytes per CTA, 1.4 GB of L2 reads
at 64 tokens), so one launch normalizes once and the GEMM reads ``h`` only
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
    residual: bool = False  # r = x + r_in first (written to r_out), then the norm of r
    # FP32 input (the MoE latent sum of a chunked step's all-tokens back end): the output is
    # ``bf16(x * rstd * w)``, one rounding, as ``up_proj_shared_add_ref`` normalizes
    x_f32: bool = False
    # a side cast in the same launch (``DECODESCOPE_WIDE_BACK=addmm``): each row's CTA also
    # writes ``side_out[m] = bf16(side_in[m])`` (FP32 in, ``side`` wide; 0: none), the MoE
    # shared experts' FP32 sum rounded into the layer's output, which the up-projection's
    # cuBLAS GEMM then adds to in its epilogue
    side: int = 0


class RMSNorm:
    def __init__(self, plan: NormPlan):
        if plan.n % 8:
            raise ValueError("n must be a multiple of 8")
        if plan.x_f32 and plan.residual:
            raise ValueError("rmsnorm: an FP32 input takes no residual add")
        if plan.side % 8 or plan.side < 0:
            raise ValueError(f"rmsnorm: a side cast {plan.side} wide (a multiple of 8)")
        self.p = plan

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,  # [M, N]
        mR: cute.Tensor,  # [M, N] residual in (plan.residual) else a placeholder
        mRout: cute.Tensor,  # [M, N] new residual out (plan.residual) else a placeholder
        mW: cute.Tensor,  # [N]
        mY: cute.Tensor,  # [M, N]
        mS: cute.Tensor,  # [M, side] FP32 side input (plan.side) else a placeholder
        mSo: cute.Tensor,  # [M, side] BF16 side output (plan.side) else a placeholder
        stream: cuda.CUstream,
    ):
        @cute.struct
        class Smem:
            red: cute.struct.MemRange[Float32, 8]

        self.smem_cls = Smem
        self.kernel(mX, mR, mRout, mW, mY, mS, mSo).launch(
            grid=[self.p.m, 1, 1],
            block=[THREADS, 1, 1],
            smem=Smem.size_in_bytes(),
            stream=stream,
            use_pdl=self.p.pdl,
        )

    @cute.kernel
    def kernel(self, mX, mR, mRout, mW, mY, mS, mSo):
        p = self.p
        tidx, _, _ = cute.arch.thread_idx()
        m, _, _ = cute.arch.block_idx()
        if cutlass.const_expr(p.pdl):
            pdl_begin()
        st = cutlass.memory.SmemAllocator().allocate(self.smem_cls)
        sRed = st.red.get_tensor(cute.make_layout(8))
        nvec = p.n // 8
        per = (nvec + THREADS - 1) // THREADS
        xdt = Float32 if cutlass.const_expr(p.x_f32) else BFloat16
        rx = cute.make_rmem_tensor(cute.make_layout((per, 8), stride=(8, 1)), xdt)
        rw = cute.make_rmem_tensor(cute.make_layout((per, 8), stride=(8, 1)), BFloat16)
        ss = Float32(0.0)
        for i in cutlass.range_constexpr(per):
            v = tidx + i * THREADS
            if v < nvec:
                load_vec8(mX[m, None], v * 8, rx[i, None])
                load_vec8(mW, v * 8, rw[i, None])  # with x: one round trip, not two
                if cutlass.const_expr(p.residual):
                    rv = cute.make_rmem_tensor((8,), BFloat16)
                    load_vec8(mR[m, None], v * 8, rv)
                    for e in cutlass.range_constexpr(8):
                        rx[i, e] = (rx[i, e].to(Float32) + rv[e].to(Float32)).to(BFloat16)
                    store_vec8(rx[i, None], mRout[m, None], v * 8)
                for e in cutlass.range_constexpr(8):
                    f = rx[i, e].to(Float32)
                    ss = ss + f * f
        if cutlass.const_expr(p.side > 0):  # its loads in flight beside the row's
            nside = p.side // 8
            for i in cutlass.range_constexpr((nside + THREADS - 1) // THREADS):
                v = tidx + i * THREADS
                if v < nside:
                    rs = cute.make_rmem_tensor((8,), Float32)
                    load_vec8(mS[m, None], v * 8, rs)
                    ro = cute.make_rmem_tensor((8,), BFloat16)
                    for e in cutlass.range_constexpr(8):
                        ro[e] = rs[e].to(BFloat16)
                    store_vec8(ro, mSo[m, None], v * 8)
        ss = block_sum(ss, sRed, THREADS // 32)
        rstd = cute.math.rsqrt(ss / Float32(p.n) + Float32(p.eps))
        for i in cutlass.range_constexpr(per):
            v = tidx + i * THREADS
            if v < nvec:
                yv = cute.make_rmem_tensor((8,), BFloat16)
                for e in cutlass.range_constexpr(8):
                    if cutlass.const_expr(p.x_f32):
                        yv[e] = (rx[i, e] * rstd * rw[i, e].to(Float32)).to(BFloat16)
                    else:
                        t = (rx[i, e].to(Float32) * rstd).to(BFloat16).to(Float32)
                        yv[e] = (t * rw[i, e].to(Float32)).to(BFloat16)
                store_vec8(yv, mY[m, None], v * 8)


_PH = (16, 16)


def _fake_args(p: NormPlan, ldx: int | None = None) -> tuple:
    """The compile-time arguments of ``p``'s kernel (``ldx``: :func:`compile_plan`'s)."""
    bf = torch.bfloat16
    mn = (p.m, p.n) if p.residual else _PH
    ms = (p.m, p.side) if p.side else _PH
    xdt = torch.float32 if p.x_f32 else bf
    x = (
        itf.fake(xdt, (p.m, p.n))
        if ldx in (None, p.n)
        else itf.fake_strided(xdt, (p.m, p.n), (ldx, 1))
    )
    return (
        x,
        itf.fake(bf, mn),
        itf.fake(bf, mn),
        itf.fake(bf, (p.n,)),
        itf.fake(bf, (p.m, p.n)),
        itf.fake(torch.float32, ms),
        itf.fake(bf, ms),
        itf.env_stream(),
    )


def compile_plan(p: NormPlan, ldx: int | None = None):
    """Compile (cached) ``p``'s kernel; ``ldx``: the input's row stride where it is a column
    slice of a wider tensor (MLA's ``q_a``), else contiguous rows."""
    key = ("rmsnorm", p) if ldx in (None, p.n) else ("rmsnorm", p, ldx)
    return itf.compiled(key, lambda: (RMSNorm(p), _fake_args(p, ldx)))


def no_side(device) -> tuple[torch.Tensor, torch.Tensor]:
    """The side cast's two arguments of a plan without one (placeholders it does not read)."""
    return itf.placeholder(device, _PH, torch.float32), itf.placeholder(device, _PH, torch.bfloat16)


def rmsnorm(
    x: torch.Tensor,
    w: torch.Tensor,
    y: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    side_in: torch.Tensor | None = None,
    side_out: torch.Tensor | None = None,
) -> None:
    """``y = rmsnorm(x (+ residual)) * w``; with ``residual``, ``residual_out = x + residual``
    (may alias ``residual``: each element is read and written by the same thread). With
    ``side_in [M, S] fp32``, the same launch writes ``side_out [M, S] = bf16(side_in)``
    (:attr:`NormPlan.side`)."""
    if (side_in is None) != (side_out is None):
        raise ValueError("rmsnorm: a side cast takes side_in and side_out")
    side = 0
    if side_in is not None:
        m = int(x.shape[0])
        if side_in.dtype != torch.float32 or side_out.dtype != torch.bfloat16:
            raise ValueError(f"rmsnorm: side cast {side_in.dtype} -> {side_out.dtype}, expected "
                             "float32 -> bfloat16")  # fmt: skip
        if side_in.shape != side_out.shape or side_in.dim() != 2 or side_in.shape[0] != m:
            raise ValueError(f"rmsnorm: side cast {tuple(side_in.shape)} -> "
                             f"{tuple(side_out.shape)} for {m} rows")  # fmt: skip
        for t in (side_in, side_out):
            if not t.is_contiguous() or t.data_ptr() % 16:
                raise ValueError("rmsnorm: the side cast's tensors must be contiguous, 16-byte "
                                 "aligned")  # fmt: skip
        side = int(side_in.shape[1])
    plan = NormPlan(int(x.shape[0]), int(x.shape[1]), float(eps), residual=residual is not None,
                    x_f32=x.dtype == torch.float32, side=side)  # fmt: skip
    if x.stride(1) != 1:
        raise ValueError(f"rmsnorm: x must have unit column stride, got {tuple(x.stride())}")
    if residual is None:
        residual = residual_out = itf.placeholder(x.device, _PH, y.dtype)
    if side_in is None:
        side_in, side_out = no_side(x.device)
    compile_plan(plan, int(x.stride(0)))(x, residual, residual_out, w, y, side_in, side_out)


def rmsnorm_ref(
    x: torch.Tensor, w: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """``rmsnorm(x (+ residual)) * w`` with the kernel's rounding points (the residual sum is
    ``bf16(x + residual)``; an FP32 ``x`` is rounded once, after the weight)."""
    if x.dtype == torch.float32 and residual is None:
        xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return (xn * w.float()).to(torch.bfloat16)
    if residual is not None:
        x = (x.float() + residual.float()).to(torch.bfloat16)
    xf = x.float()
    t = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(torch.bfloat16)
    return (t.float() * w.float()).to(torch.bfloat16)
