"""LatentMoE back on the tile GEMM, one launch: ``out[T, H] = bf16(rstd[t] * (bf16(acc * w_norm)
@ latent_up^T) + shared_out)``, the function of :class:`.back_mma.BackMma` with ``norm="post"``
(compare ``up_proj_shared_add_ref``: the same within BF16 rounding), for 1..64 tokens (issue #5).

Why: ``BackMma`` at 32..64 tokens is latency-bound (H200 TP8: 48.6 us at 64 tokens against a
~13 us bytes floor; 255 registers, 112 CTAs, every CTA re-reading all of ``acc`` from L2 per
warp and chunk). The front had the same problem and moved to :mod:`.tile_gemm` (57.0 -> 37.6 us
at 64 tokens). This kernel is :class:`.tile_gemm.TileGemm` (same CTA tile: ``warps`` x 32
weight rows by all tokens, split-K over CTAs, 64-wide chunks through a multi-stage
``cp.async`` pipeline, ``mma.sync.m16n8k16`` from shared memory, the last CTA of a row tile
sums the splits' partials) with an FP32 activation stage and the RMSNorm folded in:

- **Activations**: each chunk's FP32 ``acc`` tile ``[MP, 64]`` (256-byte rows, sixteen 16-byte
  units) is streamed by ``cp.async`` beside the weights. FP32 unit ``u`` of token row ``r`` is
  stored at unit ``u ^ (r % 2)``. Each thread copies the same units of every chunk (unit
  ``tid % 16`` of rows ``tid // 16 + k * threads / 16``).
- **Conversion in place, by the thread that copied**: after ``cp.async.wait_group`` a thread's
  own copies are visible to it without a barrier, so it reads its 4 FP32 values, adds their
  squares to its token's sum of squares, and writes ``bf16(acc * w_norm)`` (4 x BF16, 8 bytes)
  into the first or second half of the same 16-byte unit (half ``(r // 2) % 2``). One barrier
  per chunk, as in the BF16 tile GEMM; no second buffer (2 CTAs per SM at 64 tokens with 3
  stages: 2 x ~98 KB). The norm weights of the CTA's K slice are loaded into shared memory once,
  before the PDL wait (a weight: never written upstream).
- **B fragments**: lane (g, c) needs columns ``8c .. 8c + 7`` of each 32-wide half chunk
  (the K permutation of :mod:`.tile_gemm`): two 8-byte loads (FP32 units ``2U``, ``2U + 1`` of
  ``U = 4h + c``). With the XOR and the half above, the 16 lanes of a half warp (rows ``g`` =
  0..3 of a token tile, ``c`` = 0..3) hit 16 distinct 8-byte bank slots: no conflicts.
- **RMSNorm (post)**: the per-token sums of squares of a split's K slice meet across the 16
  threads of a row (shuffles), go to a small FP32 workspace ``[row tile, split, token]`` beside
  the dot-product partials (same release/acquire counter protocol), and the last CTA of each row
  tile turns their sum (split order) into ``rstd = rsqrt(ss / L + eps)``. Every CTA of a split
  computes the same sums (same values, same order); each writes its own slot, so no CTA waits
  for another beyond the last-CTA reduction.
- **Epilogue** (last CTA of a row tile): ``bf16(rstd[t] * sum_splits(partial) + shared_out)``,
  rounded once, as ``BackMma``'s ``post``. Always through the workspace, also at one split.
- **Cluster** (``BackPlan.cluster``, the tile GEMM's ``DECODESCOPE_TILE_CLUSTER``; the default
  since session 24): the splits of a row tile form one thread-block cluster, and the partials
  and the sums of squares meet in distributed shared memory instead (``TileGemm.
  reduce_cluster`` with this kernel's epilogue: ``cl_*``); each CTA of the cluster finishes
  every ``splits``-th token. H200 (s24/n1, 64 tokens, alone): 30.4 -> 22.6 us at TP16, 31.2 ->
  22.8 at TP8 (cuBLAS's GEMM alone 17.0).

``act="regs"`` (``DECODESCOPE_MOE_BACK_TILE_ACT=regs``, an A/B variant): the FP32 units are
loaded into registers one chunk ahead (the same units per thread, 16-byte loads) instead of
through shared memory, converted into a BF16 double buffer in tile_gemm's activation layout
(``(U + 4 (r % 2)) % 8``) and read as there (one 16-byte load per B fragment). Shared memory
then holds only the weight stages (4 at 64 tokens with two CTAs per SM, against 3), at the cost
of one chunk of activation latency per iteration covered by a chunk's MMAs only.

Instruction count (s9/r2: at 64 tokens the loop is issue-bound, not waiting on loads: 2 and 3
stages took the same time). SASS per chunk and warp at 64 tokens (ptxas 13.0 + cuobjdump):
670 instructions with ``mma_k16`` (its A fragment re-assembled for every MMA: ~4 moves each,
258 moves for 64 HMMA; ~126 integer ops for 16 copy addresses); ``frag="lean"`` (addresses
hoisted, A fragments per half) 471; ``frag="ldsm"`` (``act="regs"``, ``ldmatrix.x4`` for A
and for B two token tiles at a time, K in natural order, 16-byte unit ``U`` of row ``r`` at
``U ^ (r % 8)`` in both buffers) 281, of them 64 HMMA, 24 LDSM, 2 MOV.

Default fragments (``DECODESCOPE_MOE_BACK_TILE_FRAG=auto``): ``ldsm`` (with ``act="regs"``) above
``LDSM_ABOVE`` = 32 tokens, ``k16`` with ``act="smem"`` up to 32 (H200 TP8 s9/r4: 30.5 against
36.7 us at 64 tokens; 24.6 against 22.9 at 32).

Selection: ``DECODESCOPE_MOE_BACK=tile`` forces it (1..64 tokens, ``L`` a multiple of 64, ``H``
of 16); ``auto`` (the default) picks it from ``TILE_FROM`` = 32 tokens (H200 TP8, s9/r2: 22.8 us
against BackMma's 33.9 at 32 tokens, 36.9 against 48.2 at 64), BackMma below. Knobs for A/Bs
(compile key): ``DECODESCOPE_MOE_BACK_TILE_STAGES`` (0: 4 where two CTAs fit an SM, else 3),
``DECODESCOPE_MOE_BACK_TILE_SPLITS`` (0: the tile GEMM's rule, 4 at H 7168),
``DECODESCOPE_MOE_BACK_TILE_WARPS`` (4), ``DECODESCOPE_MOE_BACK_TILE_ACT`` (``smem``),
``DECODESCOPE_MOE_BACK_TILE_FRAG`` (``auto``; see :func:`knobs`).
"""

# no `from __future__ import annotations`: the Smem struct reads its field annotations
import os
from dataclasses import dataclass, field

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32

from decodescope.kernels.specialized import env_knobs
from decodescope.kernels.specialized import interface as itf
from decodescope.kernels.specialized import mma_common as mc
from decodescope.kernels.specialized import tile_gemm as tg
from decodescope.kernels.specialized.router_topk import pdl_enabled
from decodescope.kernels.specialized.up_proj_shared_add import check_back_args
from decodescope.kernels.specialized.utils import pdl_begin

BK = tg.BK  # K columns per chunk
UNITS = BK // 4  # 16-byte FP32 units per token row of a chunk
SM_SMEM = 228 * 1024  # shared memory per SM (H100/H200), 1 KB of it reserved per CTA
# auto picks this kernel from this many tokens (None: never). H200 TP8, kernel alone, graph
# medians (notes/gpu-logs/s9/r2/back_tile): 22.8 us against BackMma's 33.9 at 32 tokens, 36.9
# against 48.2 at 64
TILE_FROM: int | None = 32
ACTS = ("smem", "regs")  # how the FP32 activations travel (see the module docstring)
# how the MMA operands are built (DECODESCOPE_MOE_BACK_TILE_FRAG); ldsm_smem: ldsm with the FP32
# stage through cp.async, converted and packed in place (act="smem")
FRAGS = ("k16", "lean", "ldsm", "ldsm_smem")
# the automatic fragments: ldmatrix above this many tokens. H200 TP8, kernel alone, graph medians
# (notes/gpu-logs/s9/r4): 30.5 us against 36.7 (k16) at 64 tokens, 24.6 against 22.9 at 32
LDSM_ABOVE = 32


def _two_per_sm(nbytes: int) -> bool:
    return 2 * (nbytes + 1024) <= SM_SMEM


@dataclass(frozen=True)
class BackPlan:
    """Compile-time facts of one back launch: ``m`` tokens, ``k`` = L, ``n`` = H, eps, and the
    tiling (``stages`` / ``splits`` 0: automatic)."""

    m: int
    k: int
    n: int
    eps: float
    pdl: bool = field(default_factory=pdl_enabled)
    warps: int = 4
    stages: int = 0
    splits: int = 0
    act: str = "smem"
    lean: bool = False  # hoisted copy addresses, compute_lean instead of compute_b (A/B knob)
    ldsm: bool = False  # ldmatrix fragments, XOR-8 swizzles (needs act="regs"; implies lean)
    # warpgroup MMAs on the ldsm layouts (tile_gemm.TilePlan.wgmma; needs ldsm, act="regs", 4
    # warps); None: resolved when the plan is built, by the tile GEMM's rule (wgmma_default,
    # DECODESCOPE_TILE_WGMMA: from 32 tokens since s25). H200 64 tokens alone: s23/w1 with the
    # workspace split-K 30.4 -> 30.4 us at TP16; s24/n1 with the cluster 22.6 -> 21.7
    wgmma: bool | None = None
    # split-K through a thread-block cluster (tile_gemm.TilePlan.cluster: the splits' partials
    # and sums of squares reduced over distributed shared memory, no workspace or counter);
    # None: resolved when the plan is built (DECODESCOPE_TILE_CLUSTER, as the tile GEMM's)
    cluster: bool | None = None
    # where the PDL trigger sits (back_trigger): "wait" right after the wait, "main" after the
    # main loop, "issued" once the CTA's last chunk is issued
    trigger: str = "wait"

    def __post_init__(self) -> None:
        fit = self.ldsm and self.act == "regs" and self.warps == 4
        if self.wgmma is None:
            object.__setattr__(self, "wgmma", fit and tg.wgmma_default(self.m))
        if self.wgmma and not fit:
            raise ValueError("back_tile: wgmma needs ldsm, act='regs' and 4 warps")
        if self.ldsm and self.n % (self.warps * tg.WARP_ROWS):
            raise ValueError(f"back_tile: ldsm needs H={self.n} a multiple of the CTA's rows")
        if self.act not in ACTS:
            raise ValueError(f"back_tile: act must be one of {ACTS}, got {self.act!r}")
        if self.warps not in (2, 4, 8):
            raise ValueError(f"back_tile: warps must be 2, 4 or 8, got {self.warps}")
        if self.stages and not 2 <= self.stages <= 8:
            raise ValueError(f"back_tile: stages must be 0 (auto) or 2..8, got {self.stages}")
        # self.tile runs the tile GEMM's own checks (tokens, K multiple of 64, N of 16, splits,
        # the cluster's splits and partial tile) and resolves the cluster from the environment
        object.__setattr__(self, "cluster", self.tile.cluster)
        if self.smem_bytes > 227 * 1024:
            raise ValueError(f"back_tile: {self.smem_bytes} bytes of shared memory > 227 KB")
        if self.trigger not in TRIGGERS:
            raise ValueError(f"back_tile: trigger must be one of {TRIGGERS}, got {self.trigger!r}")

    @property
    def mp(self) -> int:
        return (self.m + 7) // 8 * 8

    def _stage_bytes(self) -> int:
        w = self.warps * tg.WARP_ROWS * BK * 2
        return w + self.mp * BK * 4 if self.act == "smem" else w

    @property
    def nstages(self) -> int:
        if self.stages:
            return self.stages
        fixed = self._fixed_bytes(tg.TilePlan(m=self.m, k=self.k, segments=(self.n,), pdl=False,
                                              splits_force=self.splits, warps=self.warps,
                                              ldsm=False, wgmma=False, cluster=False))  # fmt: skip
        for s in (4, 3):
            if _two_per_sm(s * self._stage_bytes() + fixed):
                return s
        return 2

    @property
    def tile(self) -> tg.TilePlan:
        """The :class:`.tile_gemm.TilePlan` whose tiling this kernel shares (BF16 sizes: its
        ``smem_bytes`` is not this kernel's)."""
        return tg.TilePlan(
            m=self.m,
            k=self.k,
            segments=(self.n,),
            pdl=self.pdl,
            splits_force=self.splits,
            warps=self.warps,
            stages=self.nstages,
            ldsm=False,
            wgmma=self.wgmma,
            cluster=self.cluster,
        )  # fmt: skip  (this kernel's own fragments: self.ldsm; wgmma: the accumulator rows)

    def _fixed_bytes(self, t: tg.TilePlan) -> int:
        # norm weights, rstd, last flag (+ alignment); with act="regs" the BF16 double buffer
        xb = 2 * self.mp * BK * 2 if self.act == "regs" else 0
        return t.chunks * BK * 2 + t.mp * 4 + 16 + xb

    @property
    def x_floats(self) -> int:
        """FP32 words of the activation region (FP32 stages, or the BF16 double buffer)."""
        return self.nstages * self.mp * BK if self.act == "smem" else self.mp * BK

    @property
    def smem_bytes(self) -> int:
        t = self.tile
        pad = 2 * tg.SW128_ALIGN if self.wgmma else 0  # the wgmma buffers' alignment
        return self.nstages * self._stage_bytes() + self._fixed_bytes(t) + 128 + pad

    @property
    def ws_shape(self) -> tuple[int, int]:
        t = self.tile
        return (t.splits * t.mp, t.acc_rows)

    @property
    def ssq_size(self) -> int:
        t = self.tile
        return t.row_ctas * t.splits * t.mp


class BackTile(tg.TileGemm):
    """:class:`.tile_gemm.TileGemm`'s weight loads and split-K partial stores, with the FP32
    activation stage, the in-place conversion and the RMSNorm epilogue of this module."""

    ROW_LANES = UNITS  # threads that stage one token row of a chunk (16 x 16 bytes: 64 FP32)

    def __init__(self, bp: BackPlan):
        super().__init__(bp.tile)
        self.bp = bp

    @cute.jit
    def __call__(
        self,
        mAcc: cute.Tensor,  # [M, L] f32
        mNW: cute.Tensor,  # [L] bf16
        mW: cute.Tensor,  # [H, L] bf16
        mSh: cute.Tensor,  # [M, H] f32
        mOut: cute.Tensor,  # [M, H] bf16
        mWs: cute.Tensor,  # [splits * mp, acc_rows] f32 partials
        mSsq: cute.Tensor,  # [row_ctas * splits * mp] f32 sums of squares
        mCnt: cute.Tensor,  # [row_ctas] i32, zero between launches
        stream: cuda.CUstream,
    ):
        p = self.p

        al = tg.SW128_ALIGN if self.bp.wgmma else 128  # the 128-byte swizzle's 8-row atoms

        @cute.struct
        class Smem:
            w: cute.struct.Align[cute.struct.MemRange[BFloat16, p.stages * p.cta_rows * BK], al]
            x: cute.struct.Align[cute.struct.MemRange[Float32, self.bp.x_floats], al]
            nw: cute.struct.Align[cute.struct.MemRange[BFloat16, p.chunks * BK], 16]
            rstd: cute.struct.Align[cute.struct.MemRange[Float32, p.mp], 16]
            last: cute.struct.MemRange[Int32, 1]

        self.smem_cls = Smem
        self.kernel(mAcc, mNW, mW, mSh, mOut, mWs, mSsq, mCnt).launch(
            grid=[p.row_ctas, p.splits, 1],
            block=[p.threads, 1, 1],
            smem=Smem.size_in_bytes(),
            stream=stream,
            use_pdl=p.pdl,
            **tg.cluster_launch(p),
        )

    @cute.kernel
    def kernel(self, mAcc, mNW, mW, mSh, mOut, mWs, mSsq, mCnt):
        p = self.p
        tidx, _, _ = cute.arch.thread_idx()
        bx, sp, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(self.smem_cls)
        sW = st.w.get_tensor(
            cute.make_layout((p.stages, p.cta_rows, BK), stride=(p.cta_rows * BK, BK, 1))
        )
        regs = self.bp.act == "regs"
        sX = None
        if cutlass.const_expr(regs):
            # the BF16 double buffer, tile_gemm's activation layout
            sXb = cute.make_tensor(
                cute.recast_ptr(
                    st.x.get_tensor(cute.make_layout(self.bp.x_floats)).iterator, dtype=BFloat16
                ),  # fmt: skip
                cute.make_layout((2, p.mp, BK), stride=(p.mp * BK, BK, 1)),
            )
        else:
            sX = st.x.get_tensor(cute.make_layout((p.stages, p.mp, BK), stride=(p.mp * BK, BK, 1)))
            # the same bytes as BF16: 128 per token row (the converted values, in place)
            sXb = cute.make_tensor(
                cute.recast_ptr(sX.iterator, dtype=BFloat16),
                cute.make_layout((p.stages, p.mp, 2 * BK), stride=(p.mp * 2 * BK, 2 * BK, 1)),
            )
        sNW = st.nw.get_tensor(cute.make_layout(p.chunks * BK))
        sRstd = st.rstd.get_tensor(cute.make_layout(p.mp))
        sLast = st.last.get_tensor(cute.make_layout(1))

        warp = tidx // 32
        lane = tidx % 32
        g = lane // 4
        c = lane % 4
        n = self.bp.n
        row0 = bx * p.cta_rows
        kc0 = sp * p.chunks
        pre = min(p.stages - 1, p.chunks)

        # weights of the first chunks and the norm weights before the PDL wait (never written
        # by the predecessor); the norm weights are read by other threads: barrier
        lean = (self.bp.lean or self.bp.ldsm) and n % p.cta_rows == 0  # every row exists
        wsrc = wdst = asrc = adst = None
        if cutlass.const_expr(lean):
            # this thread's copy addresses, once: per chunk / stage / row step they move by
            # compile-time strides (tile_gemm recomputes them per copy)
            wr = tidx // 8
            wu = tidx % 8
            wsrc = mW.iterator + ((row0 + wr) * self.bp.k + wu * 8)
            wdst = sW.iterator + (wr * BK + ((wu + 4 * (wr % 2)) % 8) * 8)
            if cutlass.const_expr(self.bp.ldsm):  # ldmatrix's layout: unit u ^ (r % 8)
                wdst = sW.iterator + (wr * BK + (wu ^ (wr % 8)) * 8)
            ar = tidx // UNITS
            au = tidx % UNITS
            asrc = mAcc.iterator + (ar * self.bp.k + au * 4)
            if cutlass.const_expr(not regs):
                adst = sX.iterator + (ar * BK + (au ^ (ar % 2)) * 4)
        for s in cutlass.range_constexpr(pre):
            if cutlass.const_expr(lean):
                self.load_w_lean(wsrc, wdst, kc0 + s, s)
            else:
                self.load_w(mW, sW, n, row0, kc0 + s, s, tidx)
        self.load_nw(mNW, sNW, kc0, tidx)
        cute.arch.sync_threads()
        trig = self.bp.trigger
        if cutlass.const_expr(p.pdl and trig != "wait"):
            cute.arch.griddepcontrol_wait()  # the trigger comes later (back_trigger)
        elif cutlass.const_expr(p.pdl):
            pdl_begin()
        for s in cutlass.range_constexpr(p.stages - 1):
            if cutlass.const_expr(s < pre and not regs):
                if cutlass.const_expr(lean):
                    self.load_acc_lean(asrc, adst, kc0 + s, s, tidx)
                else:
                    self.load_acc(mAcc, sX, kc0 + s, s, tidx)
            cute.arch.cp_async_commit_group()
        if cutlass.const_expr(p.pdl and trig == "issued" and p.chunks <= p.stages - 1):
            cute.arch.griddepcontrol_launch_dependents()  # every chunk was issued above
        rX = []
        if cutlass.const_expr(regs):  # chunk 0's activations into registers
            for _ in cutlass.range_constexpr(self.slots):
                rX.append(cute.make_rmem_tensor((4,), Float32))
            if cutlass.const_expr(lean):
                self.load_acc_regs_lean(asrc, rX, kc0, tidx)
            else:
                self.load_acc_regs(mAcc, rX, kc0, tidx)

        atom = mc.mma_atom()
        accs = mc.zero_accs(tg.RT * p.ntiles)
        fa, fb = mc.fragments()
        ssq = cute.make_rmem_tensor((self.slots,), Float32)
        ssq.fill(0.0)
        for i in cutlass.range(p.chunks, unroll=1):
            stg = i % p.stages
            xs = stg
            if cutlass.const_expr(regs):
                # chunk i from registers into BF16 slot i % 2 (read by chunk i - 2's MMAs, which
                # every thread finished before the last barrier); then chunk i + 1's loads, in
                # flight during this chunk's MMAs
                xs = i % 2
                self.convert_regs(rX, sXb, sNW, xs, i, ssq, tidx)
                if i + 1 < p.chunks:
                    if cutlass.const_expr(lean):
                        self.load_acc_regs_lean(asrc, rX, kc0 + i + 1, tidx)
                    else:
                        self.load_acc_regs(mAcc, rX, kc0 + i + 1, tidx)
                cute.arch.cp_async_wait_group(p.stages - 2)
            else:
                cute.arch.cp_async_wait_group(p.stages - 2)
                if cutlass.const_expr(self.bp.ldsm):
                    self.convert_packed(sX, sXb, sNW, stg, i, ssq, tidx)
                else:
                    self.convert(sX, sXb, sNW, stg, i, ssq, tidx)
            if cutlass.const_expr(self.bp.wgmma):
                # the converted chunk and the landed weights, visible to wgmma's async proxy
                cute.arch.fence_proxy("async.shared", space="cta")
            # the converted chunk is visible to all; every thread is past chunk i - 1's MMAs,
            # so its stage may be refilled
            cute.arch.sync_threads()
            nxt = i + (p.stages - 1)
            if nxt < p.chunks:
                sn = nxt % p.stages
                if cutlass.const_expr(lean):
                    self.load_w_lean(wsrc, wdst, kc0 + nxt, sn)
                    if cutlass.const_expr(not regs):
                        self.load_acc_lean(asrc, adst, kc0 + nxt, sn, tidx)
                else:
                    self.load_w(mW, sW, n, row0, kc0 + nxt, sn, tidx)
                    if cutlass.const_expr(not regs):
                        self.load_acc(mAcc, sX, kc0 + nxt, sn, tidx)
            cute.arch.cp_async_commit_group()
            if cutlass.const_expr(p.pdl and trig == "issued" and p.chunks > p.stages - 1):  # noqa: SIM102
                if nxt == p.chunks - 1:  # this CTA's last chunk is in flight
                    cute.arch.griddepcontrol_launch_dependents()
            if cutlass.const_expr(self.bp.wgmma):
                self.compute_wgmma(sW, sXb, stg, accs, xs=xs)
            elif cutlass.const_expr(self.bp.ldsm):
                self.compute_ldsm(sW, sXb, stg, xs, warp, lane, accs, fa, fb, atom)
            elif cutlass.const_expr(self.bp.lean):
                self.compute_lean(sW, sXb, stg, xs, warp, g, c, accs, atom)
            else:
                self.compute_b(sW, sXb, stg, xs, warp, g, c, accs, fa, fb, atom)
        cute.arch.cp_async_wait_group(0)
        if cutlass.const_expr(p.pdl and trig == "main"):
            # every weight chunk of this CTA has landed: the next layer's first kernel may
            # become resident now (it parks in its wait during the reduction and epilogue)
            cute.arch.griddepcontrol_launch_dependents()
        if cutlass.const_expr(p.cluster):
            self.reduce_cluster(mOut, mSh, sW, accs, ssq, bx, n, sp, tidx)
            return

        self.store_partial(mWs, accs, bx, sp, warp, g, c)
        self.store_ssq(mSsq, ssq, bx, sp, tidx)
        cute.arch.fence_acq_rel_gpu()
        cute.arch.sync_threads()
        if tidx == 0:
            old = cute.arch.atomic_add(mCnt.iterator + bx, Int32(1), sem="acq_rel", scope="gpu")
            sLast[0] = old
        cute.arch.sync_threads()
        if sLast[0] == p.splits - 1:
            cute.arch.fence_acq_rel_gpu()
            self.epilogue_norm(mOut, mSh, mWs, mSsq, mCnt, sRstd, bx, tidx)

    @property
    def slots(self) -> int:
        """FP32 units of a chunk per thread (each a different token row, same column unit)."""
        p = self.p
        return -(-(p.mp * UNITS) // p.threads)

    @cute.jit
    def load_nw(self, mNW, sNW, kc0, tidx):
        """The norm weights of this CTA's K slice (``chunks * 64`` BF16) into shared memory."""
        p = self.p
        units = p.chunks * BK // 8
        for q in cutlass.range_constexpr(-(-units // p.threads)):
            idx = tidx + q * p.threads
            if idx < units:
                v = cute.make_rmem_tensor((8,), BFloat16)
                cute.autovec_copy(cute.local_tile(mNW, (8,), (kc0 * (BK // 8) + idx,)), v)
                cute.autovec_copy(v, cute.local_tile(sNW, (8,), (idx,)))

    @cute.jit
    def load_acc(self, mAcc, sX, kc, stg, tidx):
        """cp.async of the FP32 activations (tokens < m), chunk ``kc``, into stage ``stg``:
        unit ``u`` of row ``r`` at unit ``u ^ (r % 2)``."""
        p = self.p
        units = p.mp * UNITS
        u = tidx % UNITS
        for q in cutlass.range_constexpr(self.slots):
            idx = tidx + q * p.threads
            r = idx // UNITS
            if idx < units and r < p.m:
                src = cute.local_tile(mAcc[r, None], (4,), (kc * UNITS + u,))
                dst = cute.local_tile(sX[stg, r, None], (4,), (u ^ (r % 2),))
                mc.cp_async16(dst, src)

    @cute.jit
    def load_w_lean(self, wsrc, wdst, kc, stg):
        """``load_w`` from this thread's hoisted addresses (every row exists): row step
        ``threads / 8`` rows, chunk ``kc``, stage ``stg``."""
        p = self.p
        rs = p.threads // 8
        for i in cutlass.range_constexpr(p.cta_rows // rs):
            src = wsrc + (kc * BK + i * rs * self.bp.k)
            dst = wdst + (stg * (p.cta_rows * BK) + i * rs * BK)
            cute.arch.inline_ptx("cp.async.cg.shared.global [{$r0}], [{$r1}], 16;",
                                 read_only_args=[dst, src])  # fmt: skip

    @cute.jit
    def load_acc_lean(self, asrc, adst, kc, stg, tidx):
        """``load_acc`` from this thread's hoisted addresses (row step ``threads / 16``, whose
        parity is even: the unit XOR is the thread's own)."""
        p = self.p
        rs = p.threads // UNITS
        for q in cutlass.range_constexpr(self.slots):
            if tidx // UNITS + q * rs < p.m:
                src = asrc + (kc * BK + q * rs * self.bp.k)
                dst = adst + (stg * (p.mp * BK) + q * rs * BK)
                cute.arch.inline_ptx("cp.async.cg.shared.global [{$r0}], [{$r1}], 16;",
                                     read_only_args=[dst, src])  # fmt: skip

    @cute.jit
    def load_acc_regs_lean(self, asrc, rX, kc, tidx):
        """``load_acc_regs`` from this thread's hoisted address (16-byte ``ld.global``)."""
        p = self.p
        rs = p.threads // UNITS
        for q in cutlass.range_constexpr(self.slots):
            if tidx // UNITS + q * rs < p.m:
                v = cute.arch.inline_ptx(
                    "ld.global.v4.f32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
                    write_only_types=[Float32, Float32, Float32, Float32],
                    read_only_args=[asrc + (kc * BK + q * rs * self.bp.k)],
                )
                for e in cutlass.range_constexpr(4):
                    rX[q][e] = v[e]

    @cute.jit
    def load_acc_regs(self, mAcc, rX, kc, tidx):
        """``act="regs"``: this thread's units of chunk ``kc`` (the units ``load_acc`` would
        copy) into registers (16-byte loads; a warp reads two rows' 256 contiguous bytes)."""
        p = self.p
        units = p.mp * UNITS
        u = tidx % UNITS
        for q in cutlass.range_constexpr(self.slots):
            idx = tidx + q * p.threads
            r = idx // UNITS
            if idx < units and r < p.m:
                cute.autovec_copy(cute.local_tile(mAcc[r, None], (4,), (kc * UNITS + u,)), rX[q])

    @cute.jit
    def convert_regs(self, rX, sXb, sNW, xs, i, ssq, tidx):
        """``act="regs"``: squares into ``ssq``, ``bf16(acc * w_norm)`` into BF16 slot ``xs`` in
        tile_gemm's layout (logical 16-byte unit ``U`` of row ``r`` at ``(U + 4 (r % 2)) % 8``;
        FP32 unit ``u`` is half ``u % 2`` of ``U = u // 2``)."""
        p = self.p
        units = p.mp * UNITS
        u = tidx % UNITS
        nw = cute.make_rmem_tensor((4,), BFloat16)
        cute.autovec_copy(cute.local_tile(sNW, (4,), (i * UNITS + u,)), nw)
        for q in cutlass.range_constexpr(self.slots):
            idx = tidx + q * p.threads
            r = idx // UNITS
            if idx < units:
                xf = rX[q]
                xb = cute.make_rmem_tensor((4,), BFloat16)
                s = ssq[q]
                for e in cutlass.range_constexpr(4):
                    s = s + xf[e] * xf[e]
                    xb[e] = (xf[e] * nw[e].to(Float32)).to(BFloat16)
                ssq[q] = s
                pu = (u // 2 + 4 * (r % 2)) % 8
                if cutlass.const_expr(self.bp.ldsm):  # ldmatrix's layout: unit U ^ (r % 8)
                    pu = (u // 2) ^ (r % 8)
                dst = cute.local_tile(sXb[xs, r, None], (4,), (2 * pu + u % 2,))
                cute.autovec_copy(xb, dst)

    @cute.jit
    def convert_packed(self, sX, sXb, sNW, stg, i, ssq, tidx):
        """``ldsm`` with ``act="smem"``: this thread's own units of chunk ``i`` read first (all
        slots), then, after a warp barrier (the 16 units of a token row belong to 16 lanes of one
        warp), ``bf16(acc * w_norm)`` packed into the first 128 bytes of the same FP32 row in
        ldmatrix's layout: BF16 unit ``U = u // 2`` of row ``r`` at ``U ^ (r % 8)``, half
        ``u % 2``. Those bytes held units 0-7 of the row, read by their lanes before the
        barrier."""
        p = self.p
        units = p.mp * UNITS
        u = tidx % UNITS
        nw = cute.make_rmem_tensor((4,), BFloat16)
        cute.autovec_copy(cute.local_tile(sNW, (4,), (i * UNITS + u,)), nw)
        xbs = []
        for q in cutlass.range_constexpr(self.slots):
            idx = tidx + q * p.threads
            r = idx // UNITS
            xb = cute.make_rmem_tensor((4,), BFloat16)
            if idx < units:
                xf = cute.make_rmem_tensor((4,), Float32)
                cute.autovec_copy(cute.local_tile(sX[stg, r, None], (4,), (u ^ (r % 2),)), xf)
                s = ssq[q]
                for e in cutlass.range_constexpr(4):
                    s = s + xf[e] * xf[e]
                    xb[e] = (xf[e] * nw[e].to(Float32)).to(BFloat16)
                ssq[q] = s
            xbs.append(xb)
        cute.arch.sync_warp()
        for q in cutlass.range_constexpr(self.slots):
            idx = tidx + q * p.threads
            r = idx // UNITS
            if idx < units:
                pu = (u // 2) ^ (r % 8)
                dst = cute.local_tile(sXb[stg, r, None], (4,), (2 * pu + u % 2,))
                cute.autovec_copy(xbs[q], dst)

    @cute.jit
    def convert(self, sX, sXb, sNW, stg, i, ssq, tidx):
        """This thread's own units of chunk ``i`` (stage ``stg``): squares into ``ssq``, then
        ``bf16(acc * w_norm)`` into half ``(r // 2) % 2`` of the same unit."""
        p = self.p
        units = p.mp * UNITS
        u = tidx % UNITS
        nw = cute.make_rmem_tensor((4,), BFloat16)
        cute.autovec_copy(cute.local_tile(sNW, (4,), (i * UNITS + u,)), nw)
        for q in cutlass.range_constexpr(self.slots):
            idx = tidx + q * p.threads
            r = idx // UNITS
            if idx < units:
                pu = u ^ (r % 2)
                xf = cute.make_rmem_tensor((4,), Float32)
                cute.autovec_copy(cute.local_tile(sX[stg, r, None], (4,), (pu,)), xf)
                xb = cute.make_rmem_tensor((4,), BFloat16)
                s = ssq[q]
                for e in cutlass.range_constexpr(4):
                    s = s + xf[e] * xf[e]
                    xb[e] = (xf[e] * nw[e].to(Float32)).to(BFloat16)
                ssq[q] = s
                cute.autovec_copy(
                    xb, cute.local_tile(sXb[stg, r, None], (4,), (2 * pu + (r // 2) % 2,))
                )

    @cute.jit
    def compute_b(self, sW, sXb, stg, xs, warp, g, c, accs, fa, fb, atom):
        """The MMAs of one chunk (as :meth:`.tile_gemm.TileGemm.compute`, weights from stage
        ``stg``), B from the converted activations ``xs``: with ``act="smem"`` columns
        ``8c .. 8c + 7`` of half ``h`` are FP32 units ``2U``, ``2U + 1`` (``U = 4h + c``) of token
        row ``8j + g``, 4 BF16 each; with ``"regs"`` one 16-byte load as in tile_gemm."""
        p = self.p
        par = 4 * (g % 2)  # weight rows g, g + 8 share g's parity (tile_gemm's swizzle)
        xo = g % 2  # token rows 8j + g: the FP32 unit XOR
        hf = (g // 2) % 2  # and the half holding the BF16 values
        for h in cutlass.range_constexpr(2):
            pu = (4 * h + c + par) % 8
            tiles = []
            for q in cutlass.range_constexpr(tg.RT):
                r = warp * tg.WARP_ROWS + q * 16 + g
                lo = cute.make_rmem_tensor((8,), BFloat16)
                hi = cute.make_rmem_tensor((8,), BFloat16)
                cute.autovec_copy(cute.local_tile(sW[stg, r, None], (8,), (pu,)), lo)
                cute.autovec_copy(cute.local_tile(sW[stg, r + 8, None], (8,), (pu,)), hi)
                tiles.append((lo, hi, q))
            U = 4 * h + c
            for j in cutlass.range_constexpr(p.ntiles):
                row = sXb[xs, j * 8 + g, None]
                xb = None
                if cutlass.const_expr(self.bp.act == "regs"):
                    xb = cute.make_rmem_tensor((8,), BFloat16)
                    cute.autovec_copy(cute.local_tile(row, (8,), (pu,)), xb)
                else:
                    b0 = cute.make_rmem_tensor((4,), BFloat16)
                    b1 = cute.make_rmem_tensor((4,), BFloat16)
                    cute.autovec_copy(cute.local_tile(row, (4,), (2 * ((2 * U) ^ xo) + hf,)), b0)
                    cute.autovec_copy(
                        cute.local_tile(row, (4,), (2 * ((2 * U + 1) ^ xo) + hf,)), b1
                    )
                    xb = _Pair(b0, b1)
                mc.mma_k16(atom, accs, fa, fb, xb,
                           [(lo, hi, q * p.ntiles + j) for lo, hi, q in tiles])  # fmt: skip

    @cute.jit
    def compute_ldsm(self, sW, sXb, stg, xs, warp, lane, accs, fa, fb, atom):
        """The MMAs of one chunk with ``ldmatrix`` fragments (``ldsm``), K in natural order:
        per 16-wide K step, A of each row tile by one ``x4`` (matrices rows 0-7 | 8-15 x k
        +0 | +8: lanes 0-15 rows, lanes 16-31 the k + 8 half), B of two token tiles by one
        ``x4`` (matrices (tile, k +0), (tile, k +8), (tile + 1, ..): lanes 0-7 / 8-15 / 16-23 /
        24-31), an ``x2`` for an odd last tile. Both buffers keep 16-byte unit ``U`` of row ``r``
        at ``U ^ (r % 8)``: the 8 rows of a matrix hit 8 different bank groups."""
        p = self.p
        fa32 = cute.recast_tensor(fa, Int32)
        fb32 = cute.recast_tensor(fb, Int32)
        li = lane % 8
        ar = warp * tg.WARP_ROWS + lane % 16  # + 16 q: this lane's A row (row % 8 == li)
        a_base = sW.iterator + (stg * (p.cta_rows * BK) + ar * BK)
        bt = lane // 16  # token tile of the pair
        bh = (lane // 8) % 2  # k + 8 half
        xr = BK if self.bp.act == "regs" else 2 * BK  # BF16 row stride (smem: in the FP32 rows)
        b_base = sXb.iterator + (xs * (p.mp * xr) + (bt * 8 + li) * xr)
        for ks in cutlass.range_constexpr(BK // 16):
            ua = 2 * ks + lane // 16
            aregs = []
            for q in cutlass.range_constexpr(tg.RT):
                aregs.append(tg.ldsm_x4(a_base + (q * 16 * BK + (ua ^ li) * 8)))
            ub = 2 * ks + bh
            bregs = []
            for jj in cutlass.range_constexpr(p.ntiles // 2):
                bb = tg.ldsm_x4(b_base + (jj * 16 * xr + (ub ^ li) * 8))
                bregs.append((bb[0], bb[1]))
                bregs.append((bb[2], bb[3]))
            if cutlass.const_expr(p.ntiles % 2):  # lanes 0-15: (last tile, k +0 | +8)
                jl = p.ntiles - 1
                b0, b1 = tg.ldsm_x2(sXb.iterator + (xs * (p.mp * xr) + (jl * 8 + li) * xr
                                                  + ((2 * ks + bh) ^ li) * 8))  # fmt: skip
                bregs.append((b0, b1))
            for j in cutlass.range_constexpr(p.ntiles):
                fb32[0] = bregs[j][0]
                fb32[1] = bregs[j][1]
                for q in cutlass.range_constexpr(tg.RT):
                    for e in cutlass.range_constexpr(4):
                        fa32[e] = aregs[q][e]
                    acc = accs[q * p.ntiles + j]
                    cute.gemm(atom, acc, fa, fb, acc)

    @cute.jit
    def compute_lean(self, sW, sXb, stg, xs, warp, g, c, accs, atom):
        """:meth:`compute_b`'s MMAs with fewer register moves (``lean``): the A fragments of
        the half (``RT`` tiles x 2 K steps) are assembled once and reused by every token tile
        (``mma_k16`` re-assembles them per token tile: 4 moves per MMA); the B fragments are
        loaded straight into the MMA's operand registers (no moves), all token tiles of the half
        first, then the MMAs ordered K step, token tile, row tile (dependent MMAs 2 x ntiles
        apart)."""
        p = self.p
        par = 4 * (g % 2)
        xo = g % 2
        hf = (g // 2) % 2
        for h in cutlass.range_constexpr(2):
            pu = (4 * h + c + par) % 8
            fas = []  # fas[q][s]
            for q in cutlass.range_constexpr(tg.RT):
                r = warp * tg.WARP_ROWS + q * 16 + g
                lo = cute.make_rmem_tensor((8,), BFloat16)
                hi = cute.make_rmem_tensor((8,), BFloat16)
                cute.autovec_copy(cute.local_tile(sW[stg, r, None], (8,), (pu,)), lo)
                cute.autovec_copy(cute.local_tile(sW[stg, r + 8, None], (8,), (pu,)), hi)
                two = []
                for k in cutlass.range_constexpr(2):
                    fa = cute.make_rmem_tensor((8, 1, 1), BFloat16)
                    mc.set_a(fa, lo, hi, k)
                    two.append(fa)
                fas.append(two)
            U = 4 * h + c
            fbs = []  # fbs[j][s]: the 4 BF16 of K step s, token tile j
            for j in cutlass.range_constexpr(p.ntiles):
                row = sXb[xs, j * 8 + g, None]
                two = []
                for k in cutlass.range_constexpr(2):
                    fb = cute.make_rmem_tensor((4, 1, 1), BFloat16)
                    flat = cute.make_tensor(fb.iterator, cute.make_layout(4))
                    if cutlass.const_expr(self.bp.act == "regs"):  # 8 bytes of the 16-byte unit
                        src = cute.local_tile(row, (4,), (2 * pu + k,))
                    else:
                        src = cute.local_tile(row, (4,), (2 * ((2 * U + k) ^ xo) + hf,))
                    cute.autovec_copy(src, flat)
                    two.append(fb)
                fbs.append(two)
            for k in cutlass.range_constexpr(2):
                for j in cutlass.range_constexpr(p.ntiles):
                    for q in cutlass.range_constexpr(tg.RT):
                        acc = accs[q * p.ntiles + j]
                        cute.gemm(atom, acc, fas[q][k], fbs[j][k], acc)

    # the cluster epilogue (tile_gemm.TileGemm.reduce_cluster): rstd * sum + shared_out
    def cl_norm(self) -> bool:
        return True

    def cl_eps(self) -> float:
        return self.bp.eps

    def cl_out_type(self):
        return BFloat16

    def cl_load_epi(self, mSh, m, nn):
        sh = cute.make_rmem_tensor((4,), Float32)
        cute.autovec_copy(cute.local_tile(mSh[m, None], (4,), (nn // 4,)), sh)
        return sh

    def cl_value(self, val, rs, sh, e):
        return (val * rs + sh[e]).to(BFloat16)

    @cute.jit
    def cl_publish_ssq(self, ssq, sQ, tidx):
        """Each token row's sum of squares over this split (:meth:`store_ssq`'s butterfly over
        the 16 threads of a row) into this CTA's ``sQ``."""
        p = self.p
        for q in cutlass.range_constexpr(self.slots):
            s = self.row_ssq(ssq, q)
            idx = tidx + q * p.threads
            if tidx % UNITS == 0 and idx < p.mp * UNITS:
                sQ[idx // UNITS] = s

    @cute.jit
    def store_ssq(self, mSsq, ssq, bx, sp, tidx):
        """Each token row's sum of squares over this split's K slice (the 16 threads of a row are
        16 consecutive lanes: butterfly over them) to ``ssq[bx, sp, row]``."""
        p = self.p
        for q in cutlass.range_constexpr(self.slots):
            s = self.row_ssq(ssq, q)
            idx = tidx + q * p.threads
            if tidx % UNITS == 0 and idx < p.mp * UNITS:
                r = idx // UNITS
                ptr = mSsq.iterator + ((bx * p.splits + sp) * p.mp + r)
                cute.arch.inline_ptx("st.global.f32 [{$r0}], {$r1};", read_only_args=[ptr, s])

    @cute.jit
    def epilogue_norm(self, mOut, mSh, mWs, mSsq, mCnt, sRstd, bx, tidx):
        """The last CTA of row tile ``bx``: each token's rstd from the splits' sums of squares
        (split order), then :meth:`.tile_gemm.TileGemm.epilogue_partial`'s walk (4 rows of one
        token per thread and step, ``EPI_BATCH`` steps' loads together) with
        ``bf16(rstd * sum + shared_out)``; zero the counter."""
        p = self.p
        nt = p.threads
        n = self.bp.n
        for m in cutlass.range(tidx, p.m, nt, unroll=1):
            ss = Float32(0.0)
            for s in cutlass.range_constexpr(p.splits):
                ptr = mSsq.iterator + ((bx * p.splits + s) * p.mp + m)
                ss = ss + cute.arch.inline_ptx(
                    "ld.global.cg.f32 {$w0}, [{$r0}];",
                    write_only_types=[Float32],
                    read_only_args=[ptr],
                )
            sRstd[m] = cute.math.rsqrt(ss / Float32(self.bp.k) + Float32(self.bp.eps))
        cute.arch.sync_threads()
        quads = p.cta_rows // 4
        total = p.m * quads
        steps = (total + nt - 1) // nt
        bsz = min(tg.EPI_BATCH, steps)
        for b in cutlass.range((steps + bsz - 1) // bsz, unroll=1):
            parts = []
            for t in cutlass.range_constexpr(bsz):
                f = tidx + (b * bsz + t) * nt
                ok = f < total
                fc = cutlass.min(f, total - 1)  # clamped: every load stays in bounds
                m = fc // quads
                r4 = (fc % quads) * 4
                vals = []
                for s in cutlass.range_constexpr(p.splits):
                    ptr = mWs.iterator + ((s * p.mp + m) * p.acc_rows + bx * p.cta_rows + r4)
                    vals.append(
                        cute.arch.inline_ptx(
                            "ld.global.cg.v4.f32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
                            write_only_types=[Float32, Float32, Float32, Float32],
                            read_only_args=[ptr],
                        )
                    )
                parts.append((ok, m, r4, vals))
            for ok, m, r4, vals in parts:
                nn = bx * p.cta_rows + r4
                if ok and nn < n:
                    sh = cute.make_rmem_tensor((4,), Float32)
                    cute.autovec_copy(cute.local_tile(mSh[m, None], (4,), (nn // 4,)), sh)
                    ov = cute.make_rmem_tensor((4,), BFloat16)
                    rs = sRstd[m]
                    for e in cutlass.range_constexpr(4):
                        val = vals[0][e]
                        for s in cutlass.range_constexpr(1, p.splits):
                            val = val + vals[s][e]
                        ov[e] = (val * rs + sh[e]).to(BFloat16)
                    cute.autovec_copy(ov, cute.local_tile(mOut[m, None], (4,), (nn // 4,)))
        if tidx == 0:
            mCnt[bx] = Int32(0)


class _Pair:
    """``xb[0..7]`` for :func:`.mma_common.mma_k16` from two 4-element BF16 fragments."""

    def __init__(self, lo, hi):
        self.lo, self.hi = lo, hi

    def __getitem__(self, i: int):
        return self.lo[i] if i < 4 else self.hi[i - 4]


# -- torch-facing --------------------------------------------------------------------------


def _fake_args(bp: BackPlan):
    T, L, H = bp.m, bp.k, bp.n
    return (
        itf.fake(torch.float32, (T, L)),
        itf.fake(torch.bfloat16, (L,)),
        itf.fake(torch.bfloat16, (H, L)),
        itf.fake(torch.float32, (T, H)),
        itf.fake(torch.bfloat16, (T, H)),
        itf.fake(torch.float32, bp.ws_shape),
        itf.fake(torch.float32, (bp.ssq_size,)),
        itf.fake(torch.int32, (bp.tile.row_ctas,), align=4),
        itf.env_stream(),
    )


def compile_plan(bp: BackPlan):
    """Compile (cached) the kernel of ``bp``."""
    return itf.compiled(("moe_back_tile", bp), lambda: (BackTile(bp), _fake_args(bp)))


_WS: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def workspace(bp: BackPlan, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Partials, sums of squares and counters of a plan (zeroed once; the last CTA of a row tile
    re-zeroes its counter: launches of one plan on one stream reuse them)."""
    key = (bp, str(device))
    ws = _WS.get(key)
    if ws is None:
        ws = _WS[key] = (
            torch.zeros(bp.ws_shape, dtype=torch.float32, device=device),
            torch.zeros(bp.ssq_size, dtype=torch.float32, device=device),
            torch.zeros(bp.tile.row_ctas, dtype=torch.int32, device=device),
        )
    return ws


def _knob(var: str, choices: tuple[int, ...]) -> int:
    v = os.environ.get(var, "") or "0"
    if not v.isdigit() or int(v) not in choices:
        raise ValueError(f"{var}={v!r}: expected one of {choices}")
    return int(v)


def knobs(T: int = 0) -> dict[str, int]:
    """The knobs for ``T`` tokens (environment, read at each call):
    ``DECODESCOPE_MOE_BACK_TILE_STAGES`` (0 auto, 2..6), ``_SPLITS`` (0 auto, or a divisor of L / 64), ``_WARPS`` (0 = 4, 2, 4, 8),
    ``_ACT`` (``smem`` or ``regs``), ``_FRAG`` (``auto``, the default: ``ldsm`` above
    ``LDSM_ABOVE`` tokens, else ``k16``; ``k16``: ``mma_common.mma_k16``; ``lean``: hoisted copy
    addresses and A fragments built once per half; ``ldsm``: ``ldmatrix`` fragments, which
    set ``act="regs"``)."""
    stages = _knob("DECODESCOPE_MOE_BACK_TILE_STAGES", (0, 2, 3, 4, 5, 6))
    splits = _knob("DECODESCOPE_MOE_BACK_TILE_SPLITS", (0, 1, 2, 4, 7, 8, 14))
    warps = _knob("DECODESCOPE_MOE_BACK_TILE_WARPS", (0, 2, 4, 8)) or 4
    act = os.environ.get("DECODESCOPE_MOE_BACK_TILE_ACT", "") or "smem"
    if act not in ACTS:
        raise ValueError(f"DECODESCOPE_MOE_BACK_TILE_ACT={act!r}: expected one of {ACTS}")
    frag = os.environ.get("DECODESCOPE_MOE_BACK_TILE_FRAG", "") or "auto"
    if frag not in ("auto", *FRAGS):
        raise ValueError(
            f"DECODESCOPE_MOE_BACK_TILE_FRAG={frag!r}: expected one of {('auto', *FRAGS)}"
        )
    if frag == "auto":
        frag = "ldsm" if T > LDSM_ABOVE else "k16"
    if frag == "ldsm":
        act = "regs"  # the BF16 buffer ldmatrix reads
    elif frag == "ldsm_smem":
        act = "smem"
    return {"stages": stages, "splits": splits, "warps": warps, "act": act,
            "lean": frag == "lean", "ldsm": frag.startswith("ldsm")}  # fmt: skip


LATE_ENV = "DECODESCOPE_MOE_BACK_LATE"
LATE_FROM = 8  # ``auto``: the trigger after the main loop from this many tokens on
TRIGGERS = ("wait", "main", "issued")  # where the MoE back kernels' PDL trigger sits
_LATE_VALUES = {"0": "wait", "1": "main", "issued": "issued"}


def back_trigger(T: int) -> str:
    """Where the MoE back kernels (:class:`.back_mma.BackMma` and this one) trigger their PDL
    dependents, from ``DECODESCOPE_MOE_BACK_LATE``: ``0`` / unset (the default) ``"wait"``,
    right after the wait, as every kernel of the step; ``1``: ``"main"``, after the main loop,
    so the next layer's first kernel becomes resident during this kernel's epilogue instead of
    parking beside its weight stream for the whole kernel; ``issued``: ``"issued"``, once the
    CTA's last weight chunk is issued (the last few chunks still in flight: the next kernel's
    CTAs get that long to become resident and issue their own first loads); ``auto``:
    ``"main"`` from :data:`LATE_FROM` tokens on, else ``"wait"``. Read at each call; part of
    the compile key. Scheduling only: the next kernel's ``griddepcontrol.wait`` still waits for
    this grid's completion, wherever the trigger sits.

    H200, session 33, BackMma (bench, specialized, same call, default / ``1``): the MLA layer
    after it spans 9-14 us less (TP16 batch 1 103.5 -> 93.2 us, batch 8 221.8 -> 207.9; TP8
    126.2 -> 117.2, 336.7 -> 323.2). Its share grows at batch 1 (TP8 +1.2 us; TP16 the KDA layer
    +0.8, projected step 8.01 -> 8.06 ms) and falls at batch 8 (-0.9 to -1.2 us, projected steps
    -0.06 / -0.09 ms). Not the default: the rule set before the run asked for both batches.
    Session 34 (batch 1, 8, 24, 64, TP8 / TP16, two runs each; notes/specialized.md "Outcome of
    part 43"): ``auto`` and ``issued`` pass the GPU checks (this kernel's ``late`` /
    ``late_issued`` cases included) and shorten the MLA span by 9-19 us, but move its share by
    -1.2 to +2.1 us (``issued`` worst at 64 tokens, in this kernel) and the projected step by
    -0.09 to +0.18 ms: neither met the rule, so the default stays ``0``."""
    v = env_knobs.read(LATE_ENV, ("0", "1", "issued", "auto"), "0")
    if v == "auto":
        return "main" if T >= LATE_FROM else "wait"
    return _LATE_VALUES[v]


def plan_for(T: int, L: int, H: int, eps: float, **kw) -> BackPlan:
    """The plan of a launch: :func:`knobs` unless given (a ``kw`` naming ``act``, ``lean`` or
    ``ldsm`` replaces the automatic fragment choice), the MoE kernels' PDL switch."""
    k = knobs(T)
    if {"act", "lean", "ldsm"} & kw.keys():  # a variant with its own activations / fragments
        k.update(act="smem", lean=False, ldsm=False)
    k.setdefault("trigger", back_trigger(T))
    k.update(kw)
    return BackPlan(m=T, k=L, n=H, eps=float(eps), pdl=k.pop("pdl", pdl_enabled()), **k)


def fits(T: int, L: int, H: int) -> bool:
    """Whether the shapes suit this kernel (1..64 tokens, L a multiple of 64, H of 16)."""
    return 1 <= T <= 64 and L % BK == 0 and H % 16 == 0


def back_tile(acc, latent_norm, latent_up, shared_out, out, eps: float, **kw) -> None:
    """Launch :class:`BackTile` (same arguments as ``up_proj_shared_add``; ``kw``: plan fields
    for sweeps)."""
    T, L, H = check_back_args(acc, latent_norm, latent_up, shared_out, out)
    if not fits(T, L, H):
        raise ValueError(f"back_tile: needs 1..64 tokens, L % 64 == 0, H % 16 == 0; got T={T} "
                         f"L={L} H={H}")  # fmt: skip
    bp = plan_for(T, L, H, eps, **kw)
    fn = compile_plan(bp)
    ws, ssq, cnt = workspace(bp, acc.device)
    fn(acc, latent_norm, latent_up, shared_out, out, ws, ssq, cnt)


def back_tile_ref(acc, latent_norm, latent_up, shared_out, eps: float, splits: int = 1):
    """Torch reference in the kernel's arithmetic: ``bf16(acc * w)`` (FP32 product rounded
    once), FP32 dot products per K split summed in split order, ``rstd`` from the FP32 sum of
    squares, ``bf16(dot * rstd + shared_out)``."""
    a = acc.float()
    L = a.shape[1]
    xb = (a * latent_norm.float()).to(torch.bfloat16).float()
    w = latent_up.float()
    ks = L // splits
    dot = xb[:, :ks] @ w[:, :ks].T
    for s in range(1, splits):
        dot = dot + xb[:, s * ks : (s + 1) * ks] @ w[:, s * ks : (s + 1) * ks].T
    rstd = torch.rsqrt(a.pow(2).sum(-1, keepdim=True) / L + eps)
    return (dot * rstd + shared_out.float()).to(torch.bfloat16)
