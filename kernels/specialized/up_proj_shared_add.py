"""LatentMoE back end: latent RMSNorm + up-projection (L -> H) + shared-expert add, one launch.

``out[t] = bf16( rmsnorm(acc[t]) * latent_norm  @ latent_up^T  +  shared_out[t] )``

``acc [T, L]`` is the routed experts' FP32 weighted sum (``moe_experts``); the reference
(``kernels/reference.py`` ``moe_ref``) applies the latent RMSNorm to that sum, right before the
up-projection, so the norm lives here: every CTA takes the sum of squares of its token tile
(one warp per token), stages the normalized latent in shared memory as BF16, and its warps run
the skinny GEMV of :mod:`moe_common` over its block of ``latent_up`` rows; the epilogue adds
the shared experts' FP32 output and rounds once to BF16. Rows split over CTAs (16 per CTA).
Launch count: 1.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, const_expr

from decodescope.kernels.specialized import interface as itf
from decodescope.kernels.specialized.moe_common import VEC, dot_rows, lanes_per_row, load_rows
from decodescope.kernels.specialized.router_topk import pdl_enabled


class UpProjSharedAdd:
    """Compile-time facts: T tokens, L latent, H hidden, eps; TT tokens per staged tile,
    NW warps per CTA, R rows per lane group."""

    def __init__(
        self,
        T: int,
        L: int,
        H: int,
        eps: float,
        TT: int = 8,
        NW: int = 8,
        R: int = 2,
        pdl: bool = True,
    ):
        self.pdl = pdl
        if min(TT, T) > NW:
            raise ValueError("one warp per staged token: TT must be <= NW")
        self.T, self.L, self.H, self.eps = T, L, H, eps
        self.TT, self.NW, self.R = min(TT, T), NW, R
        self.LPR = lanes_per_row(L)
        self.G = 32 // self.LPR
        self.NCH = L // VEC // self.LPR
        self.rows_per_cta = NW * self.G * R
        if H % R:
            raise ValueError(f"hidden {H} must be a multiple of R={R} (rows per lane group)")
        self.grid = -(-H // self.rows_per_cta)

    @cute.jit
    def __call__(
        self,
        mAcc: cute.Tensor,
        mGamma: cute.Tensor,
        mW: cute.Tensor,
        mShared: cute.Tensor,
        mOut: cute.Tensor,
        stream,
    ):
        self.kernel(mAcc, mGamma, mW, mShared, mOut).launch(
            grid=[self.grid, 1, 1],
            block=[self.NW * 32, 1, 1],
            stream=stream,
            use_pdl=self.pdl,
        )

    @cute.kernel
    def kernel(
        self,
        mAcc: cute.Tensor,
        mGamma: cute.Tensor,
        mW: cute.Tensor,
        mShared: cute.Tensor,
        mOut: cute.Tensor,
    ):
        T, L, H, TT = self.T, self.L, self.H, self.TT
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()

        smem = cutlass.memory.SmemAllocator()
        sX = smem.allocate_tensor(
            BFloat16, cute.make_ordered_layout((TT, L), order=(1, 0)), byte_alignment=16
        )
        sRstd = smem.allocate_tensor(Float32, cute.make_layout(8), byte_alignment=16)
        gAv = cute.zipped_divide(mAcc, (1, VEC))
        gGv = cute.zipped_divide(
            cute.make_tensor(mGamma.iterator, cute.make_layout((1, L))), (1, VEC)
        )
        sXv = cute.zipped_divide(sX, (1, VEC))
        gWv = cute.zipped_divide(mW, (1, VEC))
        acc = cute.make_rmem_tensor((self.R, TT), Float32)

        grp = lane // self.LPR
        li = lane % self.LPR
        row0 = bid * self.rows_per_cta + (warp * self.G + grp) * self.R
        # weight chunks first (registers, reused for every token tile): their latency overlaps
        # the norm prologue
        ws = load_rows(gWv, cutlass.min(row0, H - self.R), 1, li, self.R, self.LPR, self.NCH)
        if const_expr(self.pdl):
            # launched early: latent_up streams while the expert kernel finishes
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        for t0 in cutlass.range(0, (T // TT) * TT, TT, unroll=1):
            self._token_tile(ws, gAv, gGv, sXv, sRstd, mShared, mOut, acc, t0, row0, li, TT)
        if const_expr(T % TT):
            self._token_tile(ws, gAv, gGv, sXv, sRstd, mShared, mOut, acc, T - T % TT, row0, li,
                             T % TT)  # fmt: skip

    @cute.jit
    def _norm_stage(self, aV, t0, gGv, sXv, sRstd, nt: cutlass.Constexpr[int]):
        """Rows ``t0 .. t0+nt`` of the FP32 latent ``aV`` (vector view): RMSNorm (one warp per
        token, rstd into ``sRstd``) times the latent norm weight, BF16 into ``sXv``; a CTA
        barrier after each half. Shared with :class:`.moe_allreduce.MoeAllReduceLLDirect`."""
        L = self.L
        NT = self.NW * 32
        KV = L // VEC
        tid, _, _ = cute.arch.thread_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        if warp < nt:
            ss = Float32(0.0)
            for c in cutlass.range(lane, KV, 32, unroll=4):
                v = aV[(0, None), (t0 + warp, c)].load()
                ss = ss + (v * v).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            ss = cute.arch.warp_reduction(ss, lambda a, b: a + b)
            if lane == 0:
                sRstd[warp] = cute.math.rsqrt(ss / Float32(L) + Float32(self.eps))
        cute.arch.barrier()
        for i in cutlass.range(tid, nt * KV, NT, unroll=4):
            t = i // KV
            c = i % KV
            v = aV[(0, None), (t0 + t, c)].load()
            gm = gGv[(0, None), (0, c)].load().to(Float32)
            sXv[(0, None), (t, c)].store((v * gm * sRstd[t]).to(BFloat16))
        cute.arch.barrier()

    @cute.jit
    def _token_tile(self, ws, gAv, gGv, sXv, sRstd, mShared, mOut, acc, t0, row0, li,
                    nt: cutlass.Constexpr[int]):  # fmt: skip
        """Tokens t0 .. t0+nt: RMSNorm of the routed sum (one warp per token), BF16 staging,
        up-projection rows, + shared output, BF16 store."""
        H = self.H
        self._norm_stage(gAv, t0, gGv, sXv, sRstd, nt)
        dot_rows(ws, sXv, acc, li, self.R, nt, self.LPR, self.NCH)
        if li == 0:
            for r in cutlass.range_constexpr(self.R):
                if row0 + r < H:
                    for t in cutlass.range_constexpr(nt):
                        o = acc[r, t] + mShared[t0 + t, row0 + r]
                        mOut[t0 + t, row0 + r] = o.to(BFloat16)
        cute.arch.barrier()


# -- torch-facing --------------------------------------------------------------------------


def fake_back_args(T: int, L: int, H: int) -> tuple:
    """Fake ``(acc, latent_norm, latent_up, shared_out, out)`` of the MoE back end kernels
    (this one, :mod:`back_mma`, :mod:`moe_allreduce`)."""
    return (
        itf.fake(torch.float32, (T, L)),
        itf.fake(torch.bfloat16, (L,)),
        itf.fake(torch.bfloat16, (H, L)),
        itf.fake(torch.float32, (T, H)),
        itf.fake(torch.bfloat16, (T, H)),
    )


def check_back_args(acc, latent_norm, latent_up, shared_out, out) -> tuple[int, int, int]:
    """Check the MoE back end kernels' tensors (ValueError naming the bad one); ``(T, L, H)``."""
    T, L = acc.shape
    H = latent_up.shape[0]
    itf.check(acc, "acc", (T, L), torch.float32)
    itf.check(latent_norm, "latent_norm", (L,), torch.bfloat16)
    itf.check(latent_up, "latent_up", (H, L), torch.bfloat16)
    itf.check(shared_out, "shared_out", (T, H), torch.float32)
    itf.check(out, "out", (T, H), torch.bfloat16)
    return T, L, H


def _build(T: int, L: int, H: int, eps: float, pdl: bool = True):
    op = UpProjSharedAdd(T, L, H, eps, pdl=pdl)
    return op, (*fake_back_args(T, L, H), itf.env_stream())


def up_proj_shared_add(
    acc: torch.Tensor,
    latent_norm: torch.Tensor,
    latent_up: torch.Tensor,
    shared_out: torch.Tensor,
    out: torch.Tensor,
    eps: float,
) -> None:
    """Launch :class:`UpProjSharedAdd` on the current stream."""
    T, L, H = check_back_args(acc, latent_norm, latent_up, shared_out, out)
    pdl = pdl_enabled()
    key = ("moe_up_proj_shared_add", T, L, H, float(eps), pdl)
    fn = itf.compiled(key, lambda: _build(T, L, H, float(eps), pdl))
    fn(acc, latent_norm, latent_up, shared_out, out)


def up_proj_shared_add_ref(acc, latent_norm, latent_up, shared_out, eps: float) -> torch.Tensor:
    """Torch reference (FP32 math, BF16 staging of the normalized latent as the kernel does)."""
    a = acc.float()
    xn = a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + eps) * latent_norm.float()
    y = xn.to(torch.bfloat16).float() @ latent_up.float().T + shared_out.float()
    return y.to(torch.bfloat16)
