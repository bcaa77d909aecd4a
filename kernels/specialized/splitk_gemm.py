"""Skinny GEMM for 16..64 tokens: activations staged once per CTA in shared memory, K split
across CTAs, an FP32 reduction in L2 with the epilogue run by the last CTA of each row tile.

``out[m, n] = sum_k x'[m, k] * W[n, k]`` as :mod:`.skinny_gemm`, for the batch sizes where
that kernel re-reads the activations from L2 once per warp (8 x M x K bytes per CTA: at M = 64
more than the weights, notes/specialized.md). Per CTA:

- **Tile**: 8 warps x 16 weight rows = 128 rows, one K-slice of ``kl = K / splits`` columns.
  Grid (row tiles of all segments, splits). ``splits`` is chosen so that the grid fills the
  SMs twice (at K = 7168: 14 slices of 512 at M = 64, 7 of 1024 at M <= 32).
- **Activations once**: the CTA's ``M x kl`` slice of ``x`` (+ ``r``) is loaded once (16-byte
  loads from L2), residual-added, multiplied by the norm weight and stored as BF16 in shared
  memory (rows padded by 64 bytes: the 8 lanes of a quarter-warp hit distinct banks). Every
  warp reads its B fragments from there (``ld.shared.v4``), none from global memory.
- **Weights streamed**: each lane loads its A fragments (two 16-byte weight loads per 32-wide
  chunk, K permuted inside the chunk as in :mod:`.skinny_gemm`) ``ahead`` chunks (8 at M <= 16, else 4) before their
  MMAs, the first ones before the activation staging (so the weight stream starts at once); the
  first chunks are also prefetched into L2 before the PDL wait.
- **Tensor cores**: ``mma.sync.m16n8k16`` bf16 -> fp32, weight rows as M, tokens as N.
- **Split-K reduction**: each warp adds its 16 x M partial into an FP32 accumulator in global
  memory (``red.global.add.v2.f32``: L2 atomics, 2 tokens per op); the CTA then bumps the row
  tile's counter (acq_rel); the CTA that finds ``splits - 1`` runs the epilogue for the 128 rows
  (reads the sums, applies ``rstd``, the residual add, writes BF16) and zeroes the accumulator
  and the counter for the next launch (graph replay safe).
- **RMSNorm without a second pass**: the per-token sum of squares of ``h = x (+ r)`` over the
  CTA's slice goes into the same workspace (one ``red.add`` per warp and token); the epilogue
  computes ``rstd`` from the full sum. So the B operand is ``bf16(h * w_norm)`` and the output
  ``bf16(rstd * acc)``: the rounding differs from vLLM's ``bf16(bf16(h * rstd) * w_norm)`` by
  one BF16 rounding of the input (rel. ~2^-9 per element, well inside the checks' 2e-2).
- **Residual**: with ``add_residual`` the CTAs of row tile 0 write ``h`` (their slice) to the
  new residual stream; ``residual_epilogue`` adds ``res`` to the output (o_proj).

FP32 atomics make the sums' order vary between runs (last-bit differences before the BF16
rounding). Compile key: the plan (every shape static).
"""

# no `from __future__ import annotations`: the Smem struct reads its field annotations
# (the DSL re-reads the source to preprocess a kernel: never edit a kernel file while a
# process that imported it still compiles, its line numbers no longer match)
import os
from dataclasses import dataclass, field

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32

from decodescope.kernels.specialized import interface as itf
from decodescope.kernels.specialized import mma_common as mc
from decodescope.kernels.specialized.utils import load_vec8, pdl_begin, pdl_enabled, warp_sum

ROWS = 16  # weight rows per warp (the MMA's M)
WARPS = 8
CTA_ROWS = ROWS * WARPS
KCHUNK = 32  # k per chunk: two m16n8k16 steps
KGRAIN = 256  # slice lengths are multiples of this (the staging maps a warp to one row)
PAD = 32  # bf16 elements of padding per staged row (64 bytes: conflict-free B loads)
AHEAD_LARGE_M = 4  # weight chunks in flight per warp at M > 16 (registers)
AHEAD_SMALL_M = 8
NUM_SMS = 132
SMEM_BUDGET = 100 * 1024  # two CTAs per SM


@cute.jit
def ld_cg_f32(ptr) -> Float32:
    """A float from L2 (relaxed, gpu scope: never a stale L1 line of another CTA's sums)."""
    return cute.arch.inline_ptx(
        "ld.relaxed.gpu.global.f32 {$w0}, [{$r0}];",
        write_only_types=[Float32],
        read_only_args=[ptr],
    )


def enabled_for(m: int, k: int) -> bool:
    """Whether the split-K path serves an M x K projection: ``DECODESCOPE_SPLITK_GEMM`` = 0
    (never), 1 (wherever the shape allows) or unset (M >= 8 and K >= 4096: the hidden-size
    input projections). H200, 15:15 run of eb72dbd: in_proj 48.3 -> 38.1 us at M = 8, 191.4 ->
    101.9 at 64, qkv_a+g_proj 189.6 -> 78.0 at 64; but o_proj (K = 1536) 10.0 -> 15.0 and
    26.3 -> 51.7, q_b 6.5 -> 8.4 at M = 8: the FP32 atomics of the reduction cost about as
    much as those small-K GEMMs' weights, notes/specialized.md)."""
    env = os.environ.get("DECODESCOPE_SPLITK_GEMM", "")
    if env == "0" or k % KGRAIN or not 1 <= m <= 64:
        return False
    return env == "1" or (m >= MIN_M and k >= MIN_K)


MIN_M = 8
MIN_K = 4096
REDUCE_MODES = ("atomic", "partial")


def reduce_mode() -> str:
    """How the K-slices meet: ``atomic`` (red.add into one FP32 accumulator; measured) or
    ``partial`` (each split stores its partial sums, the last CTA adds them; not yet run on a
    GPU): ``DECODESCOPE_SPLITK_REDUCE``."""
    m = os.environ.get("DECODESCOPE_SPLITK_REDUCE", "") or "atomic"
    if m not in REDUCE_MODES:
        raise ValueError(f"DECODESCOPE_SPLITK_REDUCE: one of {REDUCE_MODES}, got {m!r}")
    return m


@dataclass(frozen=True)
class SplitKPlan:
    m: int
    k: int
    segments: tuple[int, ...]  # output widths, each a multiple of 16
    norm: bool = False
    add_residual: bool = False
    residual_epilogue: bool = False
    x_stride: int = 0
    eps: float = 1e-5
    pdl: bool = field(default_factory=pdl_enabled)
    splits_force: int = 0
    reduce: str = field(default_factory=reduce_mode)  # "atomic" or "partial"

    def __post_init__(self) -> None:
        if not 1 <= self.m <= 64:
            raise ValueError(f"split-K GEMM supports 1..64 tokens, got {self.m}")
        if self.k % KGRAIN:
            raise ValueError(f"split-K GEMM: K must be a multiple of {KGRAIN}, got {self.k}")
        if not 1 <= len(self.segments) <= 3 or any(n % ROWS for n in self.segments):
            raise ValueError(f"1..3 segments, each a multiple of {ROWS} rows: {self.segments}")
        if self.add_residual and not self.norm:
            raise ValueError("add_residual needs norm")
        if self.reduce not in REDUCE_MODES:
            raise ValueError(f"split-K GEMM: reduce is one of {REDUCE_MODES}, got {self.reduce!r}")
        if self.splits_force and (self.k // KGRAIN) % self.splits_force:
            raise ValueError(f"splits={self.splits_force} does not divide K/{KGRAIN}")

    @property
    def mp(self) -> int:
        return (self.m + 7) // 8 * 8

    @property
    def ntiles(self) -> int:
        return self.mp // 8

    def ctas(self, n: int) -> int:
        return -(-n // CTA_ROWS)

    @property
    def row_ctas(self) -> int:
        return sum(self.ctas(n) for n in self.segments)

    def smem_for(self, splits: int) -> int:
        return self.mp * (self.k // splits + PAD) * 2

    @property
    def splits(self) -> int:
        if self.splits_force:
            return self.splits_force
        g = self.k // KGRAIN
        divs = [d for d in range(1, g + 1) if g % d == 0]
        fits = [d for d in divs if self.smem_for(d) <= SMEM_BUDGET] or [g]
        for d in fits:
            if self.row_ctas * d >= 2 * NUM_SMS:
                return d
        return fits[-1]

    @property
    def ahead(self) -> int:
        return AHEAD_SMALL_M if self.m <= 16 else AHEAD_LARGE_M

    @property
    def kl(self) -> int:
        return self.k // self.splits

    @property
    def ldx(self) -> int:
        return self.x_stride or self.k

    @property
    def acc_rows(self) -> int:
        return self.row_ctas * CTA_ROWS

    @property
    def ws_rows(self) -> int:
        """Rows of the FP32 workspace: one accumulator, or one partial per split."""
        return self.acc_rows * (self.splits if self.reduce == "partial" else 1)


class SplitKGemm:
    def __init__(self, plan: SplitKPlan):
        self.p = plan
        self.threads = WARPS * 32

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,  # [M, ldx] bf16
        mR: cute.Tensor,  # [M, K] residual in, or placeholder
        mRout: cute.Tensor,  # [M, K] new residual out, or placeholder
        mNW: cute.Tensor,  # [K] norm weight, or placeholder
        mW0: cute.Tensor,
        mO0: cute.Tensor,
        mW1: cute.Tensor,
        mO1: cute.Tensor,
        mW2: cute.Tensor,
        mO2: cute.Tensor,
        mE: cute.Tensor,  # [M, N0] epilogue residual, or placeholder
        mAcc: cute.Tensor,  # [acc_rows, mp] f32, zero between launches
        mSS: cute.Tensor,  # [row_ctas, mp] f32, zero between launches
        mCnt: cute.Tensor,  # [row_ctas] i32, zero between launches
        stream: cuda.CUstream,
    ):
        p = self.p
        klp = p.kl + PAD

        @cute.struct
        class Smem:
            x: cute.struct.Align[cute.struct.MemRange[BFloat16, p.mp * klp], 16]
            rstd: cute.struct.MemRange[Float32, p.mp]
            last: cute.struct.MemRange[Int32, 1]

        self.smem_cls = Smem
        self.kernel(mX, mR, mRout, mNW, mW0, mO0, mW1, mO1, mW2, mO2, mE, mAcc, mSS, mCnt).launch(
            grid=[p.row_ctas, p.splits, 1],
            block=[self.threads, 1, 1],
            smem=Smem.size_in_bytes(),
            stream=stream,
            use_pdl=p.pdl,
        )

    @cute.kernel
    def kernel(self, mX, mR, mRout, mNW, mW0, mO0, mW1, mO1, mW2, mO2, mE, mAcc, mSS, mCnt):
        p = self.p
        tidx, _, _ = cute.arch.thread_idx()
        bx, sp, _ = cute.arch.block_idx()
        warp = tidx // 32
        lane = tidx % 32
        klp = p.kl + PAD

        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(self.smem_cls)
        sX = st.x.get_tensor(cute.make_layout((p.mp, klp), stride=(klp, 1)))
        sRstd = st.rstd.get_tensor(cute.make_layout(p.mp))
        sLast = st.last.get_tensor(cute.make_layout(1))

        weights = (mW0, mW1, mW2)
        outs = (mO0, mO1, mO2)
        t0 = 0
        for s in cutlass.range_constexpr(len(p.segments)):
            nc = p.ctas(p.segments[s])
            if bx >= t0 and bx < t0 + nc:
                self.body(mX, mR, mRout, mNW, weights[s], outs[s], mE, mAcc, mSS, mCnt, sX,
                          sRstd, sLast, bx, bx - t0, p.segments[s], sp, warp, lane)  # fmt: skip
            t0 += nc

    @cute.jit
    def body(self, mX, mR, mRout, mNW, mW, mO, mE, mAcc, mSS, mCnt, sX, sRstd, sLast, bx, cta,
             n, sp, warp, lane):  # fmt: skip
        p = self.p
        g = lane // 4
        c = lane % 4
        ntiles16 = n // ROWS
        wt = cutlass.min(cta * WARPS + warp, ntiles16 - 1)  # this warp's 16-row tile (clamped)
        wvalid = cta * WARPS + warp < ntiles16
        row = wt * ROWS + g
        kbase = sp * p.kl
        nch = p.kl // KCHUNK

        if cutlass.const_expr(p.pdl):
            for v in cutlass.range_constexpr(min(p.ahead, nch)):
                for hh in cutlass.range_constexpr(2):
                    tile = cute.local_tile(
                        mW[row + 8 * hh, None], (8,), ((kbase + v * KCHUNK) // 8 + c,)
                    )
                    cute.arch.prefetch(tile.iterator.llvm_ptr, cache_level="L2")
            pdl_begin()

        # weights of the first chunks in flight before the staging
        wlo = []
        whi = []
        for v in cutlass.range_constexpr(min(p.ahead, nch)):
            mc.load_w_tiles(mW, [row], kbase + v * KCHUNK + c * 8, wlo, whi)

        self.stage(mX, mR, mRout, mNW, mSS, sX, bx, sp, warp, lane)
        cute.arch.sync_threads()

        atom = mc.mma_atom()
        accs = mc.zero_accs(p.ntiles)
        fa, fb = mc.fragments()
        for ch in cutlass.range_constexpr(nch):
            if cutlass.const_expr(ch + p.ahead < nch):
                mc.load_w_tiles(mW, [row], kbase + (ch + p.ahead) * KCHUNK + c * 8, wlo, whi)
            for j in cutlass.range_constexpr(p.ntiles):
                xb = cute.make_rmem_tensor((8,), BFloat16)
                load_vec8(sX[j * 8 + g, None], ch * KCHUNK + c * 8, xb)
                mc.mma_k16(atom, accs, fa, fb, xb, [(wlo[ch], whi[ch], j)])

        # -- split-K: add the partial into the L2 accumulator -------------------------------
        # lane (g, c), tile j: rows g / g + 8, tokens 8j + 2c + {0, 1} (contiguous in mAcc)
        arow = bx * CTA_ROWS + warp * ROWS + g
        if wvalid:
            for j in cutlass.range_constexpr(p.ntiles):
                m0 = j * 8 + 2 * c
                for hh in cutlass.range_constexpr(2):
                    if cutlass.const_expr(p.reduce == "partial"):  # this split's own rows
                        ptr = mAcc.iterator + ((sp * p.acc_rows + arow + 8 * hh) * p.mp + m0)
                        cute.arch.inline_ptx(
                            "st.global.v2.f32 [{$r0}], {{$r1}, {$r2}};",
                            read_only_args=[ptr, accs[j][2 * hh], accs[j][2 * hh + 1]],
                        )
                    else:
                        ptr = mAcc.iterator + ((arow + 8 * hh) * p.mp + m0)
                        cute.arch.inline_ptx(
                            "red.relaxed.gpu.global.add.v2.f32 [{$r0}], {{$r1}, {$r2}};",
                            read_only_args=[ptr, accs[j][2 * hh], accs[j][2 * hh + 1]],
                        )
        cute.arch.fence_acq_rel_gpu()
        cute.arch.sync_threads()
        tidx = warp * 32 + lane
        if tidx == 0:
            old = cute.arch.atomic_add(mCnt.iterator + bx, Int32(1), sem="acq_rel", scope="gpu")
            sLast[0] = old
        cute.arch.sync_threads()
        if sLast[0] == p.splits - 1:
            cute.arch.fence_acq_rel_gpu()
            self.epilogue(mO, mE, mAcc, mSS, mCnt, sRstd, bx, cta, n, tidx)

    @cute.jit
    def stage(self, mX, mR, mRout, mNW, mSS, sX, bx, sp, warp, lane):
        """``sX[m, :] = bf16(h[m, slice] * w_norm[slice])`` with ``h = bf16(x + r)`` (or x);
        rows m >= M zero. The sum of squares of h over the slice goes to ``mSS[bx, m]``. A
        warp covers 256 contiguous columns of one row per pass (kl is a multiple of 256)."""
        p = self.p
        kbase = sp * p.kl
        wpr = p.kl // 256  # warp passes per row (32 lanes x 8 columns each)
        units = p.mp * wpr
        for pas in cutlass.range_constexpr((units + WARPS - 1) // WARPS):
            u = pas * WARPS + warp
            if u < units:
                self.stage_vec(mX, mR, mRout, mNW, mSS, sX, bx, u // wpr, (u % wpr) * 32 + lane,
                               kbase)  # fmt: skip

    @cute.jit
    def stage_vec(self, mX, mR, mRout, mNW, mSS, sX, bx, m, v, kbase):
        p = self.p
        lane = cute.arch.lane_idx()
        xv = cute.make_rmem_tensor((8,), BFloat16)
        xv.fill(0.0)
        ss = Float32(0.0)
        if m < p.m:
            load_vec8(mX[m, None], kbase + v * 8, xv)
            if cutlass.const_expr(p.add_residual):
                rv = cute.make_rmem_tensor((8,), BFloat16)
                load_vec8(mR[m, None], kbase + v * 8, rv)
                for e in cutlass.range_constexpr(8):
                    xv[e] = (xv[e].to(Float32) + rv[e].to(Float32)).to(BFloat16)
                if bx == 0:  # the first row tile writes the new residual stream
                    cute.autovec_copy(
                        xv, cute.local_tile(mRout[m, None], (8,), ((kbase // 8) + v,))
                    )
            if cutlass.const_expr(p.norm):
                nw = cute.make_rmem_tensor((8,), BFloat16)
                load_vec8(mNW, kbase + v * 8, nw)
                for e in cutlass.range_constexpr(8):
                    f = xv[e].to(Float32)
                    ss = ss + f * f
                    xv[e] = (f * nw[e].to(Float32)).to(BFloat16)
        cute.autovec_copy(xv, cute.local_tile(sX[m, None], (8,), (v,)))
        if cutlass.const_expr(p.norm):
            ss = warp_sum(ss)
            if lane == 0 and m < p.m:
                cute.arch.atomic_add(mSS.iterator + (bx * p.mp + m), ss)

    @cute.jit
    def epilogue(self, mO, mE, mAcc, mSS, mCnt, sRstd, bx, cta, n, tidx):
        """The last CTA of row tile ``bx``: ``out = bf16(rstd * acc) (+ res)`` for its 128 rows;
        zero the accumulator, the sums of squares and the counter."""
        p = self.p
        NT = self.threads
        if cutlass.const_expr(p.norm):  # noqa: SIM102 (compile-time, then run-time)
            if tidx < p.mp:
                ss = ld_cg_f32(mSS.iterator + (bx * p.mp + tidx))
                sRstd[tidx] = cute.math.rsqrt(ss / Float32(p.k) + Float32(p.eps))
        cute.arch.sync_threads()
        if tidx < p.mp:
            mSS[bx, tidx] = Float32(0.0)
        total = CTA_ROWS * p.m
        if cutlass.const_expr(p.reduce == "partial"):
            self.epilogue_partial(mO, mE, mAcc, sRstd, bx, cta, n, tidx)
            total = 0
        for i in cutlass.range_constexpr((total + NT - 1) // NT):
            idx = tidx + i * NT
            if idx < total:
                r = idx % CTA_ROWS
                m = idx // CTA_ROWS
                nn = cta * CTA_ROWS + r
                arow = bx * CTA_ROWS + r
                if nn < n:
                    val = ld_cg_f32(mAcc.iterator + (arow * p.mp + m))
                    if cutlass.const_expr(p.norm):
                        val = val * sRstd[m]
                    if cutlass.const_expr(p.residual_epilogue):
                        val = val.to(BFloat16).to(Float32) + mE[m, nn].to(Float32)
                    mO[m, nn] = val.to(BFloat16)
                mAcc[arow, m] = Float32(0.0)
        if tidx == 0:
            mCnt[bx] = Int32(0)

    @cute.jit
    def epilogue_partial(self, mO, mE, mAcc, sRstd, bx, cta, n, tidx):
        """``reduce == "partial"``: sum the splits' partials (consecutive threads read
        consecutive tokens of one row: coalesced); nothing to zero."""
        p = self.p
        NT = self.threads
        total = CTA_ROWS * p.m
        for i in cutlass.range_constexpr((total + NT - 1) // NT):
            idx = tidx + i * NT
            if idx < total:
                m = idx % p.m
                r = idx // p.m
                nn = cta * CTA_ROWS + r
                arow = bx * CTA_ROWS + r
                if nn < n:
                    val = Float32(0.0)
                    for s in cutlass.range(p.splits, unroll_full=True):
                        val = val + ld_cg_f32(mAcc.iterator + ((s * p.acc_rows + arow) * p.mp + m))
                    if cutlass.const_expr(p.norm):
                        val = val * sRstd[m]
                    if cutlass.const_expr(p.residual_epilogue):
                        val = val.to(BFloat16).to(Float32) + mE[m, nn].to(Float32)
                    mO[m, nn] = val.to(BFloat16)


# -- torch-facing --------------------------------------------------------------------------

_PLACEHOLDER = (16, 16)


def _fake_args(p: SplitKPlan):
    bf = torch.bfloat16
    M, K = p.m, p.k
    ph = itf.fake(bf, _PLACEHOLDER)
    x = itf.fake_strided(bf, (M, K), (p.ldx, 1))
    r = itf.fake(bf, (M, K)) if p.add_residual else ph
    rout = itf.fake(bf, (M, K)) if p.add_residual else ph
    nw = itf.fake(bf, (K,)) if p.norm else itf.fake(bf, (16,))
    segs = []
    for s in range(3):
        if s < len(p.segments):
            segs += [itf.fake(bf, (p.segments[s], K)), itf.fake(bf, (M, p.segments[s]))]
        else:
            segs += [ph, ph]
    e = itf.fake(bf, (M, p.segments[0])) if p.residual_epilogue else ph
    acc = itf.fake(torch.float32, (p.ws_rows, p.mp))
    ss = itf.fake(torch.float32, (p.row_ctas, p.mp), align=4)
    cnt = itf.fake(torch.int32, (p.row_ctas,), align=4)
    return (x, r, rout, nw, *segs, e, acc, ss, cnt, itf.env_stream())


def compile_plan(p: SplitKPlan):
    # keyed under the op family's name ("skinny_gemm"); the plan type tells the kernels apart
    return itf.compiled(("skinny_gemm", p), lambda: (SplitKGemm(p), _fake_args(p)))


_WS: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _workspace(p: SplitKPlan, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FP32 accumulator, sums of squares, counters: zeroed once; the last CTA of each row tile
    zeroes what it used, so the buffers serve every launch of the plan (one stream)."""
    key = (p, str(device))
    ws = _WS.get(key)
    if ws is None:
        ws = _WS[key] = (
            torch.zeros(p.ws_rows, p.mp, dtype=torch.float32, device=device),
            torch.zeros(p.row_ctas, p.mp, dtype=torch.float32, device=device),
            torch.zeros(p.row_ctas, dtype=torch.int32, device=device),
        )
    return ws


def splitk_gemm(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    outs: list[torch.Tensor],
    *,
    residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    epilogue_residual: torch.Tensor | None = None,
    eps: float = 1e-5,
    splits: int = 0,
) -> None:
    """Same contract as :func:`.skinny_gemm.skinny_gemm` (``residual_out`` must not alias
    ``x`` or ``residual``); ``splits`` forces the K split (0: the plan's choice)."""
    M, K = x.shape
    plan = SplitKPlan(
        m=M,
        k=K,
        segments=tuple(int(w.shape[0]) for w in weights),
        norm=norm_weight is not None,
        add_residual=residual is not None,
        residual_epilogue=epilogue_residual is not None,
        x_stride=0 if x.stride(0) == K else int(x.stride(0)),
        eps=float(eps),
        splits_force=splits,
    )
    fn = compile_plan(plan)
    ph = itf.placeholder(x.device, _PLACEHOLDER)
    segs: list[torch.Tensor] = []
    for s in range(3):
        segs += [weights[s], outs[s]] if s < len(weights) else [ph, ph]
    acc, ss, cnt = _workspace(plan, x.device)
    fn(
        x,
        residual if residual is not None else ph,
        residual_out if residual is not None else ph,
        norm_weight if norm_weight is not None else ph[0],
        *segs,
        epilogue_residual if epilogue_residual is not None else ph,
        acc,
        ss,
        cnt,
    )


def splitk_gemm_ref(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    *,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    epilogue_residual: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Torch reference with this kernel's rounding points (rstd applied to the FP32 sums)."""
    h = x
    rout = None
    if residual is not None:
        h = (x.float() + residual.float()).to(torch.bfloat16)
        rout = h
    rstd = None
    if norm_weight is not None:
        hf = h.float()
        rstd = torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
        h = (hf * norm_weight.float()).to(torch.bfloat16)
    outs = []
    for w in weights:
        o = h.float() @ w.float().T
        if rstd is not None:
            o = o * rstd
        o = o.to(torch.bfloat16)
        if epilogue_residual is not None:
            o = (o.float() + epilogue_residual.float()).to(torch.bfloat16)
        outs.append(o)
    return outs, rout


# -- dispatch by M -------------------------------------------------------------------------


def gemm_plan(m: int, k: int, segments: tuple[int, ...], **flags):
    """The plan that serves an ``m x k`` projection: :class:`SplitKPlan` where
    :func:`enabled_for` says so, else the small-M :class:`.skinny_gemm.GemmPlan`."""
    from decodescope.kernels.specialized.skinny_gemm import GemmPlan

    if enabled_for(m, k):
        return SplitKPlan(m=m, k=k, segments=segments, **flags)
    return GemmPlan(m=m, k=k, segments=segments, **flags)


def compile_any(plan) -> object:
    """Compile (cached) either kind of plan."""
    if isinstance(plan, SplitKPlan):
        return compile_plan(plan)
    from decodescope.kernels.specialized import skinny_gemm as sg

    return sg.compile_plan(plan)


def project(x: torch.Tensor, weights: list[torch.Tensor], outs: list[torch.Tensor], **kw) -> None:
    """One launch of ``outs[s] = norm(x (+ residual)) @ weights[s]^T (+ epilogue_residual)``
    by the kernel :func:`gemm_plan` picks (same keyword arguments as ``skinny_gemm``)."""
    if enabled_for(x.shape[0], x.shape[1]):
        splitk_gemm(x, weights, outs, **kw)
    else:
        from decodescope.kernels.specialized.skinny_gemm import skinny_gemm

        skinny_gemm(x, weights, outs, **kw)
