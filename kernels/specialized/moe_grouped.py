"""Routed + shared experts as three non-persistent launches on tensor cores (the shape of vLLM's
Triton ``fused_moe``): ``DECODESCOPE_MOE_EXPERTS=grouped`` in :mod:`moe_block`.

Same outputs as :class:`moe_experts.MoeExperts` (``acc [T, L]`` FP32 routed sum, which the
front kernel zeroed; ``shared_out [T, H]`` FP32; ``topk_ids`` / ``topk_weights``), same BF16
rounding points (z and h rounded to BF16, gate/up and the w2 products in FP32), reference
:func:`moe_experts.moe_experts_ref`. Why not one persistent kernel: the H200 measured the
persistent kernels latency-bound (one CTA per SM walking a dependent chain per small tile,
2.6-4.6 us per tile, notes/specialized_moe.md); here each SM holds several small CTAs at once
and their latencies overlap, as in vLLM's launches, which run at the bytes floor.

1. :class:`GroupedRoute` (``1 + NSH`` CTAs): CTA 0 ranks the tokens (:func:`router_topk.
   select_topk`: sigmoid + bias, top-k, renormalized x scaling; a warp per token), counts the
   picks per expert, compacts the selected experts in expert order (``slot_e``, ``slot_off``,
   ``slot_n``, ``nact``) and writes each expert's pairs ``p = t * k + j`` contiguously
   (``pairs``; order inside an expert: shared-memory atomics, not deterministic). CTAs 1..NSH
   write ``hs = bf16(SiTU(shared gate, shared up))`` [T, S] from the front kernel's output.
Weights of 2. and 3. reach the MMAs through per-lane ``cp.async`` rings in shared memory
(:mod:`mma_common`; ``DECODESCOPE_MOE_GROUPED_W13`` / ``_W2`` pick the register loads). Kernel 2
by default is :class:`grouped_w13_tile.GroupedW13Tile` instead (``DECODESCOPE_MOE_GROUPED_W13=
tile``: a CTA-shared multi-stage pipeline, the rate of vLLM's Triton w13 on the H200).

2. :class:`GroupedW13` (grid ``slots x Ie/16``): CTA (slot a, row tile r) computes gate rows
   ``16r..16r+15`` and the matching up rows of expert ``slot_e[a]`` against that expert's
   tokens (8 per pass) with ``mma.sync.m16n8k16`` in the swapped-operand scheme of
   :mod:`front_mma` (weights as M, tokens as N, K permuted so that fragments are 16-byte loads;
   z read as FP32 from ``y_front`` and rounded to BF16 in registers), its warps splitting K,
   partial sums through shared memory, SiTU epilogue: ``h [T*k, Ie]`` BF16 by pair.
3. :class:`GroupedW2` (grid ``slots x L/128 + H/128``): 4 warps, each 2 row tiles of 16 rows
   and all of K (``Ie``, short: no cross-warp reduction, no barrier), epilogue
   ``acc[t, row] += weight(p) * y`` (FP32 ``red.global.add``: summation order over experts
   varies, last-bit nondeterminism as in the persistent kernel). The last ``H/128`` CTAs are the
   shared expert (``shared_w2`` against ``hs``, all tokens, weight 1, plain FP32 stores).

Grids are static (worst case ``slots = min(E, T*k)``); CTAs past ``nact`` exit at once. No host
sync: one CUDA graph. PDL: each kernel waits for its predecessor, then lets the next launch.
"""

from __future__ import annotations

import os

import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32, Int64, const_expr

from decodescope.kernels.specialized import env_knobs as knob
from decodescope.kernels.specialized import interface as itf
from decodescope.kernels.specialized import mma_common as mc
from decodescope.kernels.specialized import route_topk as rtk
from decodescope.kernels.specialized.moe_common import situ
from decodescope.kernels.specialized.moe_experts import num_sms
from decodescope.kernels.specialized.router_topk import pdl_enabled, select_topk

ROWS = 16  # MMA M
KCH = 32  # k per chunk: two m16n8k16 steps
W2_WARPS = 4  # warps per w2 CTA, each on its own row tiles
W2_RT = 2  # row tiles per w2 warp
W2_ROWS = W2_WARPS * W2_RT * ROWS  # 128 rows per w2 CTA
# cap of the w13 / w2 grids (x SMs): past it, CTAs loop over the (slot, tile) items. Large on
# purpose: ~7 CTAs are resident per SM, and a cap near that would leave a last partial wave of
# CTAs that each walk several items with the SM mostly idle; at 64 the CTAs walk 1-2 items
# (T = 64, TP8: ~10.5 k items) and the block scheduler fills the SMs as CTAs finish, while the
# worst-case grid (21.5 k CTAs at T = 64) is not launched in full
CTAS_PER_SM = 64
W13_MODES = ("w8", "w4", "ring")  # GroupedW13 tilings (see its __init__)
# DECODESCOPE_MOE_GROUPED_W13=tile (the default since the H200 A/B s9/r2): grouped_w13_tile.
# GroupedW13Tile instead of GroupedW13 (CTA-shared cp.async pipeline, warps splitting rows;
# w13 alone, TP8: ring 163.7 -> tile 146.3 us at 8 tokens, 636.4 -> 564.9 at 64, Triton's w13
# on the same routing 149.4 / 564.5; notes/gpu-logs/s9/r2/w13tile)
W13_TILE = "tile"
W2_MODES = ("regs", "ring")  # GroupedW2 weight loads: registers, or the cp.async ring
# DECODESCOPE_MOE_GROUPED_W2=tile: grouped_w2_tile.GroupedW2Tile instead (CTA-shared cp.async
# tile pipeline, warps splitting rows; notes/specialized_moe.md s9)
W2_TILE = "tile"
# the tile w2 is the default up to this many tokens (None: at every token count). H200 TP8, w2
# alone, us / floor: ring 110.5 (1.35) -> tile 76.1 (0.98) at 8 tokens (s9/r2); with its grid
# up to 512 CTAs per SM (grouped_w2_tile.DEF_CAP, one item per CTA) ring -> tile 232.2 (1.10) ->
# 225.5 (1.09) at 32, 354.8 (1.19) -> 339.6 (1.13) at 64 (s9/r4; notes/gpu-logs/s9/r4/w2tile2)
W2_TILE_UPTO: int | None = None
RING_STAGES = 4  # K chunks in flight per warp in the "ring" modes (mma_common.ring_pipeline)
# w2's ring depth: 3 (s8/r7, H200 TP8, w2 alone, us / bytes floor: 4 stages 1.17 / 1.18 at 64 /
# 32 tokens, 3 stages 1.12 / 1.06, 2 stages 1.11 / 1.05; a shallower ring leaves shared memory
# for more CTAs per SM)
W2_RING_STAGES = 3
# GroupedRoute's top-k: K rounds of router_topk.select_topk, or route_topk.thresh_topk
ROUTE_TOPK = ("rounds", "thresh")
ROUTE_MODES = ("one", "split", "thresh")  # DECODESCOPE_MOE_GROUPED_ROUTE


def _div_pick(n: int, options) -> int:
    for w in options:
        if n % w == 0:
            return w
    return 1


def n_slots(T: int, E: int, K: int) -> int:
    """Worst-case number of selected experts: the static grids are sized for it."""
    return min(E, T * K)


def _expert_mat(mW, e, rows: int, cols: int):
    """Expert ``e``'s [rows, cols] matrix of a stacked [E, rows, cols] weight (64-bit offset:
    at TP8 ``w13`` spans 2.47e9 elements, see ``MoeExperts._expert``). Trace-time helper."""
    off = cute.assume(Int64(e) * (rows * cols), divby=8)
    ptr = (mW.iterator + off).align(16)
    return cute.make_tensor(ptr, cute.make_ordered_layout((rows, cols), order=(1, 0)))


def _load_z(mY, tok, cv):
    """BF16 registers of ``y[tok, 8 cv : 8 cv + 8]`` (FP32 in memory: two 16-byte loads)."""
    xf = cute.make_rmem_tensor((8,), Float32)
    cute.autovec_copy(cute.local_tile(mY[tok, None], (8,), (cv,)), xf)
    xb = cute.make_rmem_tensor((8,), BFloat16)
    xb.store(xf.load().to(BFloat16))
    return xb


class GroupedRoute:
    """Kernel 1: top-k routing and the per-expert pair lists, shared SiTU in the other CTAs.

    ``split=False`` (``DECODESCOPE_MOE_GROUPED_ROUTE=one``; also ``split`` up to 8 tokens): CTA 0 ranks all tokens
    (8 or 16 warps, a warp per token at a time) and builds the lists. ``split=True``
    (``split`` and ``thresh``, the default): ``ceil(T/8)`` CTAs of 8 warps rank one token per
    warp (``thresh``: :func:`route_topk.thresh_topk`; ``split``: the rounds below); the last of them to
    finish (a self-resetting counter ``mCtr[0]``, GPU-scope release/acquire as in the
    persistent kernel's ``done`` protocol) reads every CTA's ids back and builds the lists. One
    warp ranks a token in ~4200 instructions (16 rounds of a 28-candidate select tree and a
    5-level shuffle argmax at E = 896): one SM needs ~9 us per 16 tokens, ~36 us at 64 (an
    estimate from the instruction count, not measured), which the split spreads over 8 SMs."""

    def __init__(self, T, E, K, L, S, scaling, beta, lbeta, pdl=True, split: bool = False,
                 topk: str = "rounds", zero_acc: bool = False):  # fmt: skip
        if topk not in ROUTE_TOPK:
            raise ValueError(f"moe_grouped: route top-k {topk!r}, expected one of {ROUTE_TOPK}")
        if E % 32:
            raise ValueError(f"moe_grouped: num_experts={E} must be a multiple of 32")
        if K > 32:
            raise ValueError(f"moe_grouped: top_k={K} must be <= 32")
        if S % 8:
            raise ValueError(f"moe_grouped: shared_inter={S} must be a multiple of 8")
        self.T, self.E, self.K, self.L, self.S = T, E, K, L, S
        self.scaling, self.beta, self.lbeta, self.pdl = scaling, beta, lbeta, pdl
        self.topk = topk
        if topk == "thresh":  # route_topk.thresh_topk: one token per warp, always split
            split = True
        if split:
            self.NW = 8
            self.NTK = -(-T // 8)  # top-k CTAs
        else:
            self.NW = 16 if T > 8 else 8  # one token per warp up to 8 (16) tokens
            self.NTK = 1
        self.split = split and self.NTK > 1
        self.NT = self.NW * 32
        self.slots = n_slots(T, E, K)
        self.nsh = max(1, -(-(T * S // 8) // self.NT))  # shared SiTU CTAs, 8 elements a thread
        self.grid = self.NTK + self.nsh
        # zero_acc: the front kernel did not zero ``acc`` (``DECODESCOPE_MOE_FRONT=tile``): the
        # shared-SiTU CTAs zero it after their SiTU (16-byte stores). Safe under PDL: every CTA
        # is past its wait (the previous step's back kernel, which reads acc, has completed),
        # and GroupedW2, the first to touch acc again, waits for GroupedW13, whose CTAs each
        # waited for this kernel to complete.
        if zero_acc and L % 4:
            raise ValueError(f"moe_grouped: zero_acc needs latent {L} a multiple of 4")
        self.zero_acc = zero_acc

    @cute.jit
    def __call__(self, mY, mBias, mIds, mTw, mPairs, mSlotE, mSlotOff, mSlotN, mNact, mHs,
                 mCtr, mAcc, stream):  # fmt: skip
        self.kernel(
            mY, mBias, mIds, mTw, mPairs, mSlotE, mSlotOff, mSlotN, mNact, mHs, mCtr, mAcc
        ).launch(  # fmt: skip
            grid=[self.grid, 1, 1], block=[self.NT, 1, 1], stream=stream, use_pdl=self.pdl
        )

    @cute.kernel
    def kernel(self, mY, mBias, mIds, mTw, mPairs, mSlotE, mSlotOff, mSlotN, mNact, mHs, mCtr,
               mAcc):  # fmt: skip
        T, E, K, L, S, NT, NW = self.T, self.E, self.K, self.L, self.S, self.NT, self.NW
        NTK = self.NTK
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        smem = cutlass.memory.SmemAllocator()
        sIds = smem.allocate_tensor(Int32, cute.make_layout(T * K), byte_alignment=16)
        sTw = smem.allocate_tensor(Float32, cute.make_layout(T * K), byte_alignment=16)
        sCnt = smem.allocate_tensor(Int32, cute.make_layout(E), byte_alignment=16)
        sFlag = smem.allocate_tensor(Int32, cute.make_layout(4), byte_alignment=16)
        thresh = const_expr(self.topk == "thresh")
        if const_expr(thresh):
            CAP = rtk.CAP
            sM = smem.allocate_tensor(Float32, cute.make_layout(NW * 32), byte_alignment=16)
            sV = smem.allocate_tensor(Float32, cute.make_layout(NW * (CAP + 4)), byte_alignment=16)
            sI = smem.allocate_tensor(Int32, cute.make_layout(NW * (CAP + 4)), byte_alignment=16)
            sS = smem.allocate_tensor(Float32, cute.make_layout(NW * (CAP + 4)), byte_alignment=16)
            bias = rtk.load_bias(mBias, lane, E)  # a weight: before the PDL wait
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        if bid < NTK:
            for e in cutlass.range(tid, E, NT):
                sCnt[e] = Int32(0)
            cute.arch.barrier()
            for t in cutlass.range(bid * NW + warp, T, NTK * NW):
                if const_expr(thresh):
                    rtk.thresh_topk(mY, mBias, bias, t, lane, warp, sIds, sTw, sCnt, sM, sV, sI,
                                    sS, E, K, self.scaling, CAP)  # fmt: skip
                else:
                    select_topk(mY, mBias, t, lane, sIds, sTw, sCnt, E, K, self.scaling)
                if lane < K:  # select_topk ends with a warp sync: the token's picks are final
                    mIds[t * K + lane] = sIds[t * K + lane]
                    mTw[t * K + lane] = sTw[t * K + lane]
            cute.arch.barrier()
            if const_expr(self.split):
                # the barrier ordered every warp's id stores before thread 0's release
                if tid == 0:
                    cute.arch.fence_acq_rel_gpu()
                    if const_expr(thresh):
                        # release pattern (fence, relaxed atomic); the last CTA's thread 0
                        # then completes the acquire pattern (fence) before the barrier, which
                        # orders every thread's loads below after it: two GPU-scope membars on
                        # the critical path instead of three
                        old = cute.arch.atomic_add(mCtr.iterator, Int32(1), sem="relaxed",
                                                   scope="gpu")  # fmt: skip
                        if old == NTK - 1:
                            cute.arch.fence_acq_rel_gpu()
                    else:
                        old = cute.arch.atomic_add(mCtr.iterator, Int32(1), sem="acq_rel",
                                                   scope="gpu")  # fmt: skip
                    sFlag[0] = old
                cute.arch.barrier()
                if sFlag[0] == NTK - 1:  # the last top-k CTA: all ids are in global memory
                    if const_expr(not thresh):
                        cute.arch.fence_acq_rel_gpu()
                    for e in cutlass.range(tid, E, NT):
                        sCnt[e] = Int32(0)
                    cute.arch.barrier()
                    if const_expr(thresh):
                        # relaxed GPU-scope loads (coherent at L2: no stale L1 line), all of a
                        # thread's in flight before the first use
                        NPT = -(-(T * K) // NT)
                        vs = [cute.arch.load(mIds.iterator + cutlass.min(tid + j * NT, T * K - 1),
                                             Int32, sem="relaxed", scope="gpu")
                              for j in range(NPT)]  # fmt: skip
                        for j in cutlass.range_constexpr(NPT):
                            if tid + j * NT < T * K:
                                sIds[tid + j * NT] = vs[j]
                                cute.arch.atomic_add(sCnt.iterator + vs[j], Int32(1))
                    else:
                        for p in cutlass.range(tid, T * K, NT):
                            v = cute.arch.load(mIds.iterator + p, Int32, sem="acquire",
                                               scope="gpu")  # fmt: skip
                            sIds[p] = v
                            cute.arch.atomic_add(sCnt.iterator + v, Int32(1))
                    cute.arch.barrier()
                    self._lists(mPairs, mSlotE, mSlotOff, mSlotN, mNact, sIds, sCnt)
                    if tid == 0:
                        mCtr[0] = Int32(0)  # ready for the next step
            else:
                self._lists(mPairs, mSlotE, mSlotOff, mSlotN, mNact, sIds, sCnt)
        else:
            SV = S // 8
            for i in cutlass.range((bid - NTK) * NT + tid, T * SV, self.nsh * NT):
                t = i // SV
                cv = i % SV
                gf = cute.make_rmem_tensor((8,), Float32)
                uf = cute.make_rmem_tensor((8,), Float32)
                cute.autovec_copy(cute.local_tile(mY[t, None], (8,), ((E + L) // 8 + cv,)), gf)
                cute.autovec_copy(cute.local_tile(mY[t, None], (8,), ((E + L + S) // 8 + cv,)), uf)
                hv = cute.make_rmem_tensor((8,), Float32)
                for q in cutlass.range_constexpr(8):
                    hv[q] = situ(gf[q], uf[q], self.beta, self.lbeta)
                hb = cute.make_rmem_tensor((8,), BFloat16)
                hb.store(hv.load().to(BFloat16))
                cute.autovec_copy(hb, cute.local_tile(mHs[t, None], (8,), (cv,)))
            if const_expr(self.zero_acc):  # acc [T * L] FP32, 4 floats per store
                zv = cute.make_rmem_tensor((4,), Float32)
                for q in cutlass.range_constexpr(4):
                    zv[q] = Float32(0.0)
                for i in cutlass.range((bid - NTK) * NT + tid, T * L // 4, self.nsh * NT):
                    cute.autovec_copy(zv, cute.local_tile(mAcc, (4,), (i,)))

    @cute.jit
    def _lists(self, mPairs, mSlotE, mSlotOff, mSlotN, mNact, sIds, sCnt):
        """From the counts ``sCnt`` and ids ``sIds`` (all tokens) in shared memory: the compact
        list of selected experts in expert order and their pairs, contiguous per expert."""
        T, E, K, NT = self.T, self.E, self.K, self.NT
        tid, _, _ = cute.arch.thread_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        if warp == 0:
            # prefix sums over the experts (lane l holds experts l*EPL .. l*EPL+EPL-1):
            # offsets of each expert's pairs, and the compact list of selected experts
            EPL = E // 32
            csum = Int32(0)
            asum = Int32(0)
            for i in cutlass.range_constexpr(EPL):
                cn = sCnt[lane * EPL + i]
                csum = csum + cn
                asum = asum + cutlass.select_(cn > 0, Int32(1), Int32(0))
            cs = csum
            cas = asum
            for o in cutlass.range_constexpr(5):
                oc = cute.arch.shuffle_sync_up(cs, offset=1 << o)
                oa = cute.arch.shuffle_sync_up(cas, offset=1 << o)
                cs = cutlass.select_(lane >= (1 << o), cs + oc, cs)
                cas = cutlass.select_(lane >= (1 << o), cas + oa, cas)
            off = cs - csum
            a = cas - asum
            for i in cutlass.range_constexpr(EPL):
                e = lane * EPL + i
                cn = sCnt[e]
                if cn > 0:
                    mSlotE[a] = e
                    mSlotOff[a] = off
                    mSlotN[a] = cn
                    a = a + 1
                sCnt[e] = off
                off = off + cn
            if lane == 31:
                mNact[0] = cas
        cute.arch.barrier()
        for p in cutlass.range(tid, T * K, NT):
            pos = cute.arch.atomic_add(sCnt.iterator + sIds[p], Int32(1))
            mPairs[pos] = p


class GroupedW13:
    """Kernel 2: gate/up of each selected expert for its tokens, SiTU, ``h`` by pair."""

    def __init__(self, T, E, K, L, Ie, beta, lbeta, pdl=True, mode: str = "w4", nsm: int = 132):
        if L % KCH or E % 8:
            raise ValueError(f"moe_grouped: latent {L} must be a multiple of {KCH}")
        if Ie % ROWS:
            raise ValueError(f"moe_grouped: expert_inter={Ie} must be a multiple of {ROWS}")
        if mode not in W13_MODES:
            raise ValueError(f"moe_grouped: w13 mode {mode!r}, expected one of {W13_MODES}")
        self.T, self.E, self.K, self.L, self.Ie = T, E, K, L, Ie
        self.beta, self.lbeta, self.pdl, self.mode = beta, lbeta, pdl, mode
        chunks = L // KCH
        if mode == "w8":
            # 8 warps split K, the K loop unrolled (all of a warp's weight loads may be issued
            # ahead); ptxas capped at 128 registers so that 2 CTAs share an SM
            self.NW = _div_pick(chunks, (8, 4, 2, 1))
            self.CPW = chunks // self.NW
            self.U = _div_pick(self.CPW, (2, 1))
            self.full_unroll = True
            self.min_blocks = 2
        else:
            # "w4": 4 warps, 4 chunks (16 x 16 B of weights per lane) per runtime loop step,
            # 70 registers (ptxas, TP8): about 7 CTAs (28 warps) per SM. "ring" (the default):
            # the same tiling, each warp's weights streamed through its lanes' cp.async ring
            # (RING_STAGES chunks of 4 weight pieces in flight, 8 KB a warp at 4 stages), z in
            # registers as many chunks ahead
            self.NW = _div_pick(chunks, (4, 2, 1))
            self.CPW = chunks // self.NW
            self.U = _div_pick(self.CPW, (4, 3, 2, 1))
            self.full_unroll = False
            self.min_blocks = 0
        self.stages = _div_pick(self.CPW, (RING_STAGES, 2, 1))  # "ring": divides CPW
        if mode == "ring":  # ptxas capped at 128 registers: 4 CTAs (16 warps) per SM (168 free)
            self.min_blocks = 4
        self.NRT = Ie // ROWS
        self.slots = n_slots(T, E, K)
        self.grid = min(self.slots * self.NRT, CTAS_PER_SM * nsm)

    @cute.jit
    def __call__(self, mY, mW13, mH, mPairs, mSlotE, mSlotOff, mSlotN, mNact, stream):
        self.kernel(mY, mW13, mH, mPairs, mSlotE, mSlotOff, mSlotN, mNact).launch(
            grid=[self.grid, 1, 1],
            block=[self.NW * 32, 1, 1],
            stream=stream,
            use_pdl=self.pdl,
            min_blocks_per_mp=self.min_blocks,
            # set, so that min_blocks_per_mp does not query a device at compile time (-1: the
            # driver's default carveout, cudaSharedmemCarveoutDefault)
            preferred_smem_carveout=-1 if self.min_blocks > 1 else None,
        )

    @cute.kernel
    def kernel(self, mY, mW13, mH, mPairs, mSlotE, mSlotOff, mSlotN, mNact):
        E, K, L, Ie, NW, U = self.E, self.K, self.L, self.Ie, self.NW, self.U
        NT = NW * 32
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        warp = tid // 32
        lane = tid % 32
        g = lane // 4
        c = lane % 4
        smem = cutlass.memory.SmemAllocator()
        red = cute.make_layout((NW, ROWS, 8), stride=(ROWS * 8, 8, 1))
        sG = smem.allocate_tensor(Float32, red, byte_alignment=16)
        sU = smem.allocate_tensor(Float32, red, byte_alignment=16)
        sRW = None
        if const_expr(self.mode == "ring"):
            sRW = smem.allocate_tensor(BFloat16, mc.ring_layout(NW, self.stages, 4, 8), 16)
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        atom = mc.mma_atom()
        fa, fb = mc.fragments()
        chunk0 = warp * self.CPW
        nact = mNact[0]
        for item in cutlass.range(bid, nact * self.NRT, self.grid):  # (slot, row tile) items
            a = item // self.NRT
            rt = item % self.NRT
            e = mSlotE[a]
            off = mSlotOff[a]
            n = mSlotN[a]
            mW = _expert_mat(mW13, e, 2 * Ie, L)
            rows = [rt * ROWS + g, Ie + rt * ROWS + g]
            for ps in cutlass.range((n + 7) // 8):
                tok = mPairs[off + cutlass.min(ps * 8 + g, n - 1)] // K
                if const_expr(self.mode == "ring"):
                    self._ring_pass(mW, mY, tok, rows[0], rows[1], chunk0, warp, lane, sRW,
                                    sG, sU)  # fmt: skip
                else:
                    accs = mc.zero_accs(2)
                    for it in cutlass.range(self.CPW // U, unroll_full=self.full_unroll):
                        mc.mma_chunks(
                            atom, accs, fa, fb, mW, rows, 1, U,
                            lambda v, it=it: (chunk0 + it * U + v) * KCH + c * 8,
                            lambda k0, tok=tok: lambda j: _load_z(mY, tok, E // 8 + k0 // 8),
                        )  # fmt: skip
                    mc.stash_acc(sG, warp, g, c, 0, accs[0])
                    mc.stash_acc(sU, warp, g, c, 0, accs[1])
                cute.arch.barrier()
                for i in cutlass.range_constexpr(-(-(ROWS * 8) // NT)):
                    idx = tid + i * NT
                    r = idx % ROWS
                    m = idx // ROWS
                    if idx < ROWS * 8:  # noqa: SIM102 (dynamic conditions: nested ifs)
                        if ps * 8 + m < n:
                            gs = Float32(0.0)
                            us = Float32(0.0)
                            for w in cutlass.range_constexpr(NW):
                                gs = gs + sG[w, r, m]
                                us = us + sU[w, r, m]
                            p = mPairs[off + ps * 8 + m]
                            hv = situ(gs, us, self.beta, self.lbeta)
                            mH[p, rt * ROWS + r] = hv.to(BFloat16)
                cute.arch.barrier()

    @cute.jit
    def _ring_pass(self, mW, mY, tok, rg, ru, chunk0, warp, lane, sRW, sG, sU):
        """One token pass of the warp's K slice: the lane's gate and up weight runs (rows rg,
        rg + 8, ru, ru + 8) through the ring, token ``tok``'s 8 FP32 z values per chunk into
        registers ``NS`` chunks ahead (z through the ring as well lost on the H200: its pieces
        are mostly duplicates across lanes, notes/specialized_moe.md, session 7). A runtime loop
        of unrolled rounds: constant slots (a dynamic slot index was MIO-bound); all 28 chunks
        unrolled took 214 registers, this form 168, capped at 128 (``min_blocks``) with a
        32-byte spill (ptxas 13.0, TP8). The accumulators end in ``sG`` / ``sU``."""
        NS = self.stages
        g = lane // 4
        c = lane % 4
        atom = mc.mma_atom()
        fa, fb = mc.fragments()
        accs = mc.zero_accs(2)
        zr = [cute.make_rmem_tensor((8,), Float32) for _ in range(NS)]
        for v in cutlass.range_constexpr(NS):
            self._ring_issue(mW, mY, tok, rg, ru, (chunk0 + v) * KCH + c * 8, v, warp, lane,
                             sRW, zr)  # fmt: skip
            cute.arch.cp_async_commit_group()
        for it in cutlass.range(self.CPW // NS, unroll=1):
            for s in cutlass.range_constexpr(NS):
                cute.arch.cp_async_wait_group(NS - 1)
                self._ring_consume(s, warp, lane, sRW, zr, accs, atom, fa, fb)
                nxt = it * NS + s + NS
                if nxt < self.CPW:
                    self._ring_issue(mW, mY, tok, rg, ru, (chunk0 + nxt) * KCH + c * 8, s,
                                     warp, lane, sRW, zr)  # fmt: skip
                cute.arch.cp_async_commit_group()
        mc.stash_acc(sG, warp, g, c, 0, accs[0])
        mc.stash_acc(sU, warp, g, c, 0, accs[1])

    def _ring_issue(self, mW, mY, tok, rg, ru, k0, slot, warp, lane, sRW, zr):
        """cp.async of one chunk's weight runs into ring slot ``slot``, its z into ``zr[slot]``
        (trace time)."""
        mc.ring_issue_rows(sRW, warp, lane, slot, mW, (rg, ru), k0)
        cute.autovec_copy(cute.local_tile(mY[tok, None], (8,), ((self.E + k0) // 8,)), zr[slot])

    def _ring_consume(self, slot, warp, lane, sRW, zr, accs, atom, fa, fb):
        """The chunk in ring slot ``slot``: z rounded to BF16, gate and up MMAs (trace time)."""
        xb = cute.make_rmem_tensor((8,), BFloat16)
        xb.store(zr[slot].load().to(BFloat16))
        mc.ring_mma(atom, accs, fa, fb, sRW, warp, lane, slot, 2, 1, lambda j: xb)


class GroupedW2:
    """Kernel 3: w2 of each selected expert, weighted FP32 atomics into ``acc``; shared down."""

    def __init__(self, T, E, K, L, Ie, H, S, pdl=True, nsm: int = 132, mode: str = "regs",
                 stages: int = W2_RING_STAGES):  # fmt: skip
        if mode not in W2_MODES:
            raise ValueError(f"moe_grouped: w2 mode {mode!r}, expected one of {W2_MODES}")
        if not 1 <= stages <= 8:
            raise ValueError(f"moe_grouped: w2 ring stages {stages}, expected 1..8")
        self.mode = mode
        self.stages = stages  # "ring": chunks in flight per warp (shared memory per CTA grows)
        for name, v in (("latent", L), ("hidden", H)):
            if v % ROWS:
                raise ValueError(f"moe_grouped: {name} {v} must be a multiple of {ROWS}")
        for name, v in (("expert_inter", Ie), ("shared_inter", S)):
            if v % KCH:
                raise ValueError(f"moe_grouped: {name} {v} must be a multiple of {KCH}")
        self.T, self.E, self.K, self.L, self.Ie, self.H, self.S = T, E, K, L, Ie, H, S
        self.pdl = pdl
        self.U2 = _div_pick(Ie // KCH, (4, 3, 2, 1))
        self.Us = _div_pick(S // KCH, (4, 3, 2, 1))
        self.ntL = L // ROWS
        self.ntH = H // ROWS
        self.CE = -(-L // W2_ROWS)  # CTAs per expert
        self.CS = -(-H // W2_ROWS)  # shared-expert CTAs
        self.slots = n_slots(T, E, K)
        self.nr = min(self.slots * self.CE, CTAS_PER_SM * nsm)  # routed CTAs
        self.grid = self.nr + self.CS

    @cute.jit
    def __call__(self, mH, mHs, mW2, mWs2, mAcc, mShared, mPairs, mTw, mSlotE, mSlotOff,
                 mSlotN, mNact, stream):  # fmt: skip
        self.kernel(
            mH, mHs, mW2, mWs2, mAcc, mShared, mPairs, mTw, mSlotE, mSlotOff, mSlotN, mNact
        ).launch(  # fmt: skip
            grid=[self.grid, 1, 1], block=[W2_WARPS * 32, 1, 1], stream=stream, use_pdl=self.pdl
        )

    @cute.kernel
    def kernel(self, mH, mHs, mW2, mWs2, mAcc, mShared, mPairs, mTw, mSlotE, mSlotOff, mSlotN,
               mNact):  # fmt: skip
        T, K, L, Ie, S = self.T, self.K, self.L, self.Ie, self.S
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        warp = tid // 32
        lane = tid % 32
        g = lane // 4
        c = lane % 4
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        atom = mc.mma_atom()
        fa, fb = mc.fragments()
        nr = self.nr
        sR = None
        if const_expr(self.mode == "ring"):  # per lane and chunk: W2_RT x (lo, hi) runs + h
            smem = cutlass.memory.SmemAllocator()
            sR = smem.allocate_tensor(
                BFloat16, mc.ring_layout(W2_WARPS, self.stages, 2 * W2_RT + 1, 8), 16
            )
        if bid < nr:
            U = self.U2
            nact = mNact[0]
            for item in cutlass.range(bid, nact * self.CE, nr):  # (slot, 128-row block) items
                a = item // self.CE
                cb = item % self.CE
                e = mSlotE[a]
                off = mSlotOff[a]
                n = mSlotN[a]
                mW = _expert_mat(mW2, e, L, Ie)
                tiles = [(cb * W2_WARPS + warp) * W2_RT + q for q in range(W2_RT)]
                rows = [cutlass.min(t, self.ntL - 1) * ROWS + g for t in tiles]
                for ps in cutlass.range((n + 7) // 8):
                    prow = mPairs[off + cutlass.min(ps * 8 + g, n - 1)]
                    accs = mc.zero_accs(W2_RT)
                    if const_expr(self.mode == "ring"):
                        self._ring_chunks(mW, mH, prow, rows, warp, lane, c, sR, accs, atom,
                                          fa, fb)  # fmt: skip
                    else:
                        for it in cutlass.range(Ie // KCH // U, unroll_full=True):
                            mc.mma_chunks(
                                atom, accs, fa, fb, mW, rows, 1, U,
                                lambda v, it=it: (it * U + v) * KCH + c * 8,
                                lambda k0, prow=prow: lambda j: mc.load_row8(mH, prow, k0),
                            )  # fmt: skip
                    for s in cutlass.range_constexpr(2):
                        slot = ps * 8 + 2 * c + s
                        if slot < n:
                            p = mPairs[off + slot]
                            wt = mTw[p]
                            base = (p // K) * L
                            for q in cutlass.range_constexpr(W2_RT):
                                if tiles[q] < self.ntL:
                                    r0 = base + tiles[q] * ROWS + g
                                    acc = accs[q]
                                    cute.arch.atomic_add(mAcc.iterator + r0, wt * acc[s])
                                    cute.arch.atomic_add(mAcc.iterator + (r0 + 8), wt * acc[2 + s])
        else:
            sb = bid - nr
            tiles = [(sb * W2_WARPS + warp) * W2_RT + q for q in range(W2_RT)]
            rows = [cutlass.min(t, self.ntH - 1) * ROWS + g for t in tiles]
            U = self.Us
            for ps in cutlass.range(-(-T // 8)):
                tok = cutlass.min(ps * 8 + g, T - 1)
                accs = mc.zero_accs(W2_RT)
                for it in cutlass.range(S // KCH // U, unroll_full=True):
                    mc.mma_chunks(
                        atom, accs, fa, fb, mWs2, rows, 1, U,
                        lambda v, it=it: (it * U + v) * KCH + c * 8,
                        lambda k0, tok=tok: lambda j: mc.load_row8(mHs, tok, k0),
                    )  # fmt: skip
                for s in cutlass.range_constexpr(2):
                    t = ps * 8 + 2 * c + s
                    if t < T:
                        for q in cutlass.range_constexpr(W2_RT):
                            if tiles[q] < self.ntH:
                                r0 = tiles[q] * ROWS + g
                                acc = accs[q]
                                mShared[t, r0] = acc[s]
                                mShared[t, r0 + 8] = acc[2 + s]

    def _ring_chunks(self, mW, mH, prow, rows, warp, lane, c, sR, accs, atom, fa, fb):
        """All of K (``Ie``) through the ring (trace time): per chunk, the lane's weight runs of
        its ``W2_RT`` row tiles and the 8 h values of pair row ``prow``."""
        nq = len(rows)

        def issue(v, slot):
            k0 = v * KCH + c * 8
            for q in range(nq):
                for hh in range(2):
                    src = cute.local_tile(mW[rows[q] + 8 * hh, None], (8,), (k0 // 8,))
                    mc.cp_async16(mc.ring_piece(sR, warp, slot, 2 * q + hh, lane, 8), src)
            src = cute.local_tile(mH[prow, None], (8,), (k0 // 8,))
            mc.cp_async16(mc.ring_piece(sR, warp, slot, 2 * nq, lane, 8), src)

        def consume(v, slot):
            t = []
            for p in range(2 * nq + 1):
                r = cute.make_rmem_tensor((8,), BFloat16)
                cute.autovec_copy(mc.ring_piece(sR, warp, slot, p, lane, 8), r)
                t.append(r)
            tiles = [(t[2 * q], t[2 * q + 1], q) for q in range(nq)]
            mc.mma_k16(atom, accs, fa, fb, t[2 * nq], tiles)

        mc.ring_pipeline(self.Ie // KCH, self.stages, issue, consume)


# -- torch-facing --------------------------------------------------------------------------


class GroupedBuffers:
    """Scratch of the grouped path for one (T, shapes): routing lists and the shared SiTU."""

    def __init__(self, T, E, K, S, device):
        i32 = torch.int32
        sl = n_slots(T, E, K)
        self.pairs = torch.empty(T * K, dtype=i32, device=device)
        self.slot_e = torch.empty(sl, dtype=i32, device=device)
        self.slot_off = torch.empty(sl, dtype=i32, device=device)
        self.slot_n = torch.empty(sl, dtype=i32, device=device)
        self.nact = torch.empty(4, dtype=i32, device=device)
        self.hs = torch.empty(T, S, dtype=torch.bfloat16, device=device)
        # the split route kernel's arrival counter: zero here, reset by its last CTA each step
        self.ctr = torch.zeros(4, dtype=i32, device=device)


def _build_route(T, E, K, L, S, scaling, beta, lbeta, pdl, split=False, topk="rounds",
                 zero_acc=False):  # fmt: skip
    op = GroupedRoute(T, E, K, L, S, scaling, beta, lbeta, pdl, split, topk=topk,
                      zero_acc=zero_acc)  # fmt: skip
    i32, f32 = torch.int32, torch.float32
    sl = op.slots
    args = (
        itf.fake(f32, (T, E + L + 2 * S)),
        itf.fake(f32, (E,)),
        itf.fake(i32, (T * K,)),
        itf.fake(f32, (T * K,)),
        itf.fake(i32, (T * K,)),
        itf.fake(i32, (sl,)),
        itf.fake(i32, (sl,)),
        itf.fake(i32, (sl,)),
        itf.fake(i32, (4,)),
        itf.fake(torch.bfloat16, (T, S)),
        itf.fake(i32, (4,)),
        itf.fake(f32, (T * L,)),  # acc (zeroed only with zero_acc)
        itf.env_stream(),
    )
    return op, args


def _build_w13(T, E, K, L, Ie, S, beta, lbeta, pdl, mode="w4", nsm=132, tile=None):
    if mode == W13_TILE:  # same arguments; ``tile``: its TileConfig (None: the env's)
        from decodescope.kernels.specialized import grouped_w13_tile as gwt

        return gwt.build(T, E, K, L, Ie, S, beta, lbeta, pdl, nsm, tile or gwt.tile_config(T))
    op = GroupedW13(T, E, K, L, Ie, beta, lbeta, pdl, mode, nsm)
    i32 = torch.int32
    sl = op.slots
    args = (
        itf.fake(torch.float32, (T, E + L + 2 * S)),
        itf.fake(torch.bfloat16, (E, 2 * Ie, L)),
        itf.fake(torch.bfloat16, (T * K, Ie)),
        itf.fake(i32, (T * K,)),
        itf.fake(i32, (sl,)),
        itf.fake(i32, (sl,)),
        itf.fake(i32, (sl,)),
        itf.fake(i32, (4,)),
        itf.env_stream(),
    )
    return op, args


def _build_w2(T, E, K, L, Ie, H, S, pdl, nsm=132, mode="regs", stages=W2_RING_STAGES,
              tile=None):  # fmt: skip
    if mode == W2_TILE:  # same arguments; ``tile``: its TileKnobs (None: the env's)
        from decodescope.kernels.specialized import grouped_w2_tile as gw2

        return gw2.build(T, E, K, L, Ie, H, S, pdl, nsm, tile or gw2.knobs(T))
    op = GroupedW2(T, E, K, L, Ie, H, S, pdl, nsm, mode, stages)
    return op, w2_fake_args(T, E, K, L, Ie, H, S, op.slots)


def w2_fake_args(T, E, K, L, Ie, H, S, slots: int) -> tuple:
    """The fake arguments of a w2 launch (:class:`GroupedW2` and :class:`grouped_w2_tile.
    GroupedW2Tile` share them), ``slots`` the op's work-list length."""
    i32, f32, bf = torch.int32, torch.float32, torch.bfloat16
    return (
        itf.fake(bf, (T * K, Ie)),
        itf.fake(bf, (T, S)),
        itf.fake(bf, (E, L, Ie)),
        itf.fake(bf, (H, S)),
        itf.fake(f32, (T * L,)),
        itf.fake(f32, (T, H)),
        itf.fake(i32, (T * K,)),
        itf.fake(f32, (T * K,)),
        itf.fake(i32, (slots,)),
        itf.fake(i32, (slots,)),
        itf.fake(i32, (slots,)),
        itf.fake(i32, (4,)),
        itf.env_stream(),
    )


def w13_mode() -> str:
    """``DECODESCOPE_MOE_GROUPED_W13``: ``tile`` (default: :class:`grouped_w13_tile.
    GroupedW13Tile`), or ``ring``, ``w4``, ``w8`` (:class:`GroupedW13`'s tilings). H200 TP8, w13
    alone, us / floor: ring -> tile 163.7 (1.03) -> 146.3 (0.95) at 8 tokens, 636.4 (1.03) ->
    564.9 (0.91) at 64, level with Triton's w13 on the same routing (notes/gpu-logs/s9/r2);
    before that w4 -> ring 844.6 -> 639.8 us at 64 (s7/r5). Read at each call, part of the
    compile key."""
    return knob.read("DECODESCOPE_MOE_GROUPED_W13", (*W13_MODES, W13_TILE), W13_TILE)


def w2_mode(T: int | None = None) -> str:
    """``DECODESCOPE_MOE_GROUPED_W2``: ``tile`` (:class:`grouped_w2_tile.GroupedW2Tile`, the
    default at every token count since the H200 runs s9/r2 and s9/r4, see ``W2_TILE_UPTO``), or
    ``ring`` / ``regs`` (:class:`GroupedW2`'s weight loads; H200 TP8, notes/gpu-logs/s7/r2:
    regs -> ring 116.9 -> 102.1 us at 8 tokens, 491.8 -> 365.8 at 64). Unset: ``tile`` where
    ``W2_TILE_UPTO`` is None or ``T <= W2_TILE_UPTO``, else ``ring``. Read at each call, part
    of the compile key."""
    v = knob.read("DECODESCOPE_MOE_GROUPED_W2", (*W2_MODES, W2_TILE))
    if v is None:
        tile = W2_TILE_UPTO is None or (T is not None and T <= W2_TILE_UPTO)
        return W2_TILE if tile else "ring"
    return v


def w2_stages() -> int:
    """``DECODESCOPE_MOE_W2_STAGES``: chunks in flight per warp in :class:`GroupedW2`'s ring
    (default ``W2_RING_STAGES`` = 3 since the H200 A/B of s8/r7; fewer stages take less shared
    memory per CTA, so more CTAs fit an SM). Read at each call, part of the compile key."""
    return knob.read("DECODESCOPE_MOE_W2_STAGES", tuple(range(1, 9)), str(W2_RING_STAGES))


def route_mode() -> str:
    """``DECODESCOPE_MOE_GROUPED_ROUTE``: ``thresh`` (default: the top-k over ``ceil(T/8)``
    CTAs, :class:`GroupedRoute`, each warp ranking a token by :func:`route_topk.thresh_topk`),
    ``split`` (the same CTAs with :func:`router_topk.select_topk`'s K rounds) or ``one`` (one
    CTA ranks all tokens). H200 TP8, route alone (notes/gpu-logs/s8/r4): thresh 6.3 / 7.3 / 9.7
    us at 1 / 8 / 64 tokens, split 9.7 / 12.8 / 15.1 (16.6 / 19.0 at 8 / 64 before
    select_topk's loads were hoisted); ids and weights bit for bit equal (checks
    ``route_thresh_identical_*``). Read at each call, part of the compile key."""
    var = "DECODESCOPE_MOE_GROUPED_ROUTE"  # set but empty: an error, as before
    return knob.check(var, os.environ.get(var, "thresh"), ROUTE_MODES)


def route_split() -> bool:
    """Whether :func:`route_mode` spreads the top-k over CTAs (``split`` or ``thresh``)."""
    return route_mode() != "one"


def build_all(T, E, K, L, Ie, H, S, scaling, beta, lbeta, pdl=True, mode="w4", split=False,
              w2="regs"):  # fmt: skip
    """The three (op, fake args) pairs, for compile tests."""
    return (
        _build_route(T, E, K, L, S, scaling, beta, lbeta, pdl, split),
        _build_w13(T, E, K, L, Ie, S, beta, lbeta, pdl, mode),
        _build_w2(T, E, K, L, Ie, H, S, pdl, mode=w2),
    )


def supported(T, E, K, L, Ie, H, S) -> bool:
    """Whether these shapes fit the grouped kernels (the constructors' checks)."""
    try:
        GroupedRoute(T, E, K, L, S, 1.0, 1.0, 1.0)
        GroupedW13(T, E, K, L, Ie, 1.0, 1.0)
        GroupedW2(T, E, K, L, Ie, H, S)
    except ValueError:
        return False
    return True


def moe_grouped(
    y_front,
    router_bias,
    w13,
    w2,
    shared_w2,
    h,
    acc,
    shared_out,
    topk_ids,
    topk_w,
    bufs: GroupedBuffers,
    *,
    top_k: int,
    scaling: float,
    beta: float,
    lbeta: float,
    parts: tuple[int, ...] = (0, 1, 2),
    zero_acc: bool = False,
    early=None,
    back_w=None,
) -> None:
    """The three launches (same contract as :func:`moe_experts.moe_experts`, plus ``bufs``):
    ``acc [T, L]`` FP32 must be zero (the front kernel zeroes it), or with ``zero_acc`` the
    route kernel zeroes it (a front that does not: ``front_mma.front_variant`` ``tile``);
    ``done`` is not used. ``early``: the one-token early route's ``(rks, part, sig)``
    (:func:`.experts_t1.experts_t1`; only right after the front that wrote them). ``back_w``:
    the back's ``latent_up``, for the one-token L2 prefetch (``DECODESCOPE_MOE_BACK_L2PRE``).
    ``parts``: which of route (0), w13 (1), w2 (2) to launch (timing each kernel alone: 1 and
    2 read the lists of an earlier full call; 2 adds into ``acc`` again)."""
    E, twoI, L = w13.shape
    Ie = twoI // 2
    H, S = shared_w2.shape
    T = y_front.shape[0]
    K = top_k
    itf.check(y_front, "y_front", (T, E + L + 2 * S), torch.float32)
    itf.check(router_bias, "router_bias", (E,), torch.float32)
    itf.check(w13, "w13", (E, 2 * Ie, L), torch.bfloat16)
    itf.check(w2, "w2", (E, L, Ie), torch.bfloat16)
    itf.check(h, "h", (T * K, Ie), torch.bfloat16)
    itf.check(acc, "acc", (T, L), torch.float32)
    itf.check(shared_out, "shared_out", (T, H), torch.float32)
    itf.check(topk_ids, "topk_ids", (T, K), torch.int32)
    itf.check(topk_w, "topk_weights", (T, K), torch.float32)
    itf.check(bufs.hs, "grouped hs", (T, S), torch.bfloat16)
    pdl = pdl_enabled()
    mode = w13_mode()
    m2 = w2_mode(T)
    s2 = w2_stages()
    nsm = num_sms(y_front.device)
    rmode = route_mode()
    split = rmode != "one"
    topk = "thresh" if rmode == "thresh" else "rounds"
    dims = (T, E, K, L, Ie, H, S)
    rkey = ("moe_grouped_route", *dims, scaling, beta, lbeta, pdl, split, topk, zero_acc)

    def rbuild():
        return _build_route(T, E, K, L, S, scaling, beta, lbeta, pdl, split, topk, zero_acc)

    from decodescope.kernels.specialized import experts_t1 as _t1  # lazy: it imports this module

    if _t1.use_t1(T, (E, K, L, Ie, H, S)):  # 1 token: experts_t1 (DECODESCOPE_MOE_T1)
        b, ids, tw = bufs, topk_ids.view(-1), topk_w.view(-1)
        _t1.experts_t1(  # the grouped route compiled only where experts_t1 launches it
            lambda: itf.compiled(rkey, rbuild)(
                y_front, router_bias, ids, tw, b.pairs, b.slot_e, b.slot_off, b.slot_n, b.nact,
                b.hs, b.ctr, acc.view(-1)),
            y_front, w13, w2, shared_w2, h, acc, shared_out, topk_w, bufs, top_k=K, beta=beta,
            lbeta=lbeta, pdl=pdl, nsm=nsm, parts=parts, router_bias=router_bias,
            topk_ids=topk_ids, scaling=scaling, zero_acc=zero_acc, early=early, back_w=back_w,
        )  # fmt: skip
        return
    if early is not None:
        raise ValueError("moe_grouped: the early route runs at one token with experts_t1 only")
    r = itf.compiled(rkey, rbuild)
    tile = None
    if mode == W13_TILE:  # its tiling knobs (DECODESCOPE_MOE_W13T_*) are part of the key
        from decodescope.kernels.specialized import grouped_w13_tile as gwt

        tile = gwt.tile_config(T)
    w13k = itf.compiled(
        ("moe_grouped_w13", *dims, beta, lbeta, pdl, mode, nsm, tile),
        lambda: _build_w13(T, E, K, L, Ie, S, beta, lbeta, pdl, mode, nsm, tile),
    )
    tile2 = None
    if m2 == W2_TILE:  # its knobs (DECODESCOPE_MOE_W2T_*) are part of the key
        from decodescope.kernels.specialized import grouped_w2_tile as gw2

        tile2 = gw2.knobs(T)
    w2k = itf.compiled(
        ("moe_grouped_w2", *dims, pdl, nsm, m2, s2, tile2),
        lambda: _build_w2(T, E, K, L, Ie, H, S, pdl, nsm, m2, s2, tile2),
    )
    b = bufs
    ids, tw = topk_ids.view(-1), topk_w.view(-1)
    if 0 in parts:
        r(y_front, router_bias, ids, tw, b.pairs, b.slot_e, b.slot_off, b.slot_n, b.nact, b.hs,
          b.ctr, acc.view(-1))  # fmt: skip
    if 1 in parts:
        w13k(y_front, w13, h, b.pairs, b.slot_e, b.slot_off, b.slot_n, b.nact)
    if 2 in parts:
        w2k(h, b.hs, w2, shared_w2, acc.view(-1), shared_out, b.pairs, tw, b.slot_e,
            b.slot_off, b.slot_n, b.nact)  # fmt: skip


def lists_from_ids(ids: torch.Tensor, E: int):
    """The per-expert lists :class:`GroupedRoute` derives from the routing ``ids [T, k]``:
    ``(slot_e, slot_off, slot_n, nact, pairs)``, selected experts in increasing order, each
    expert's pairs ``t * k + j`` in increasing order (the kernel's order inside one may differ:
    compare through :func:`canonical_pairs`)."""
    flat = ids.reshape(-1).long().cpu()
    cnt = torch.bincount(flat, minlength=E)
    sel = torch.nonzero(cnt).flatten()
    slot_n = cnt[sel]
    slot_off = torch.cumsum(slot_n, 0) - slot_n
    pairs = torch.argsort(flat * flat.numel() + torch.arange(flat.numel()), stable=True)
    i32 = torch.int32
    return sel.to(i32), slot_off.to(i32), slot_n.to(i32), int(sel.numel()), pairs.to(i32)


def route_ref(logits: torch.Tensor, bias: torch.Tensor, k: int, scaling: float = 1.0):
    """Torch reference of :class:`GroupedRoute`: ``(ids, tw, slot_e, slot_off, slot_n, nact,
    pairs)`` (:func:`router_topk.router_topk_ref`, then :func:`lists_from_ids`)."""
    from decodescope.kernels.specialized.router_topk import router_topk_ref

    ids, tw = router_topk_ref(logits, bias, k, scaling)
    return (ids, tw, *lists_from_ids(ids, logits.shape[1]))


def grouped_ref(z, shared_gu, ids, tw, w13, w2, shared_w2, beta, lbeta):
    """The grouped kernels' computation order in torch (per selected expert, all its tokens at
    once; FP32 with the BF16 roundings of z and h): equals :func:`moe_experts.moe_experts_ref`.
    Returns ``(acc [T, L], shared_out [T, H])``."""
    from decodescope.kernels.reference import situ_ref

    T, K = ids.shape
    E = w13.shape[0]
    Ie = w13.shape[1] // 2
    slot_e, slot_off, slot_n, nact, pairs = lists_from_ids(ids, E)
    zb = z.to(torch.bfloat16).float()
    twf = tw.reshape(-1).float()
    acc = torch.zeros(T, z.shape[1], dtype=torch.float32, device=z.device)
    for a in range(nact):
        e, o, n = int(slot_e[a]), int(slot_off[a]), int(slot_n[a])
        p = pairs[o : o + n].long().to(z.device)
        toks = p // K
        gu = zb[toks] @ w13[e].float().T  # [n, 2Ie]
        h = situ_ref(gu[:, :Ie], gu[:, Ie:], beta, lbeta).to(torch.bfloat16).float()
        acc.index_add_(0, toks, (h @ w2[e].float().T) * twf[p.to(twf.device)][:, None])
    S = shared_gu.shape[1] // 2
    hs = situ_ref(shared_gu[:, :S], shared_gu[:, S:], beta, lbeta).to(torch.bfloat16).float()
    return acc, hs @ shared_w2.float().T


def canonical_pairs(pairs: torch.Tensor, slot_off: torch.Tensor, slot_n: torch.Tensor):
    """``pairs`` with each expert's segment sorted (the kernel's order inside one is free)."""
    out = pairs.clone()
    for o, n in zip(slot_off.tolist(), slot_n.tolist(), strict=True):
        out[o : o + n] = torch.sort(pairs[o : o + n]).values
    return out


# ``auto`` picks the grouped kernels from this many tokens on (None: never). H200, TP8, 84
# checks pass; expert part 393.9 -> 364.7 / 1165.0 -> 966.1 / 1897.7 -> 1470.4 us at 8 / 32 /
# 64 tokens against the persistent kernel (notes/gpu-logs/s6r2/h0)
AUTO_FROM: int | None = 8


def selected(T: int = 0, dims: tuple | None = None) -> bool:
    """Whether :mod:`moe_block` runs these kernels: ``DECODESCOPE_MOE_EXPERTS=grouped``, or
    ``auto`` (the default) with ``AUTO_FROM`` set, ``T >= AUTO_FROM`` and the shapes ``dims =
    (E, K, L, Ie, H, S)`` supported; below ``AUTO_FROM`` with ``auto``: at 1 token
    :func:`experts_t1.mode` (``t1`` by default where its kernels fit, run by :func:`moe_grouped`
    through :mod:`experts_t1`). The other values are :func:`moe_experts.kernel_variant`'s.
    Read at each call."""
    v = os.environ.get("DECODESCOPE_MOE_EXPERTS", "auto")
    if v == "grouped":
        return True
    if v == "auto" and (AUTO_FROM is None or T < AUTO_FROM):  # 1 token: DECODESCOPE_MOE_T1
        from decodescope.kernels.specialized import experts_t1 as _t1

        m = _t1.mode(T)  # unset: t1 where its kernels fit the shapes, else the pipe
        if m == "t1":
            return dims is None or _t1.use_t1(T, dims)
        if m == "grouped":
            return dims is None or supported(T, *dims)
    if v != "auto" or AUTO_FROM is None or T < AUTO_FROM:
        return False
    return dims is None or supported(T, *dims)


def buffers_for(owner, T, E, K, S, device) -> GroupedBuffers:
    """The owner's :class:`GroupedBuffers`, made on first use (warm-up, before graph capture)
    and kept as ``owner._grouped_bufs``."""
    b = getattr(owner, "_grouped_bufs", None)
    if b is None:
        b = GroupedBuffers(T, E, K, S, device)
        owner._grouped_bufs = b
    return b


def run_block_parts(blk, parts: tuple[int, ...]) -> None:
    """The grouped kernels ``parts`` of a :class:`moe_block.SpecializedMoE`'s expert step, on its
    buffers (for timing one kernel alone; its ``experts()`` must have run once)."""
    c = blk.cfg
    E, S = c.moe.num_experts, c.shared_inter
    moe_grouped(
        blk.y_front, blk.bias, blk.w13, blk.w2, blk.shared_w2, blk.h, blk.acc, blk.shared_out,
        blk.topk_ids, blk.topk_weights, buffers_for(blk, blk.N, E, blk.top_k, S, blk.acc.device),
        top_k=blk.top_k, scaling=blk.scaling, beta=blk.beta, lbeta=blk.lbeta, parts=parts,
        zero_acc=blk.route_zeroes_acc(),
    )  # fmt: skip
