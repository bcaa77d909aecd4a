"""LatentMoE back end with the two-GPU reductions inside: latent all-reduce + RMSNorm +
up-projection + shared-expert all-reduce + add, one launch per rank (tp_world 2, NVLink).

``out[t] = bf16( rmsnorm(A_0[t] + A_1[t]) * latent_norm @ latent_up^T + (S_0[t] + S_1[t]) )``

with ``A_i [T, L]`` rank i's FP32 routed-expert sum (its expert-intermediate shard) and ``S_i
[T, H]`` its FP32 shared-expert output: the standard path's latent all-reduce, RMSNorm,
up-projection, shared-output all-reduce and add (:mod:`.up_proj_shared_add` on one GPU). Both
ranks get the same ``out`` bit for bit (FP32 ``a + b == b + a``).

The latent norm needs the whole reduced row in every CTA, so the exchange comes first (protocol
of :mod:`.comm`, whose docstring holds the safety argument):

1. ``griddepcontrol.wait``, epoch ``e``;
2. CTA ``b`` stores its share of ``A`` (a contiguous slice of the [T, L] floats) and the
   ``S`` columns of its own output rows into the peer's ``recv[e % 2]`` (laid out as [T, L]
   then [T, H]); ``bar.sync``; ``st.release.sys`` of ``e + 1`` into the peer's ``flags[b]``;
3. L2 prefetch of a share of the next op's weights (the next layer's first GEMM) while the
   peer's slices travel;
4. every CTA waits for *all* of the peer's flags (one thread per flag, ``ld.acquire.sys``),
   then runs :class:`.up_proj_shared_add.UpProjSharedAdd`'s token tiles on ``A_0 + A_1`` and
   adds ``S_0 + S_1`` in the epilogue.

Because every CTA waits for every peer CTA, the whole grid must be resident at once: it is
persistent (at most one CTA per SM), each CTA looping over its 16-row units; the first unit's
weights are loaded before the PDL wait and stay in registers through the exchange.

Over the LL protocol (the default): :class:`MoeAllReduceLL` (two phases, local done flags) or,
with ``DECODESCOPE_TP2_MOE_LL=direct`` up to ``DIRECT_MAX_T`` tokens,
:class:`MoeAllReduceLLDirect` (every CTA reads the peer's words itself: no local flag hop).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32, Int64, const_expr

from decodescope.kernels.specialized import comm
from decodescope.kernels.specialized import interface as itf
from decodescope.kernels.specialized.moe_common import VEC, dot_rows, load_rows
from decodescope.kernels.specialized.oproj_allreduce import H200_SMS, device_sms
from decodescope.kernels.specialized.router_topk import pdl_enabled
from decodescope.kernels.specialized.up_proj_shared_add import (
    UpProjSharedAdd,
    check_back_args,
    fake_back_args,
)

LL_ENV = "DECODESCOPE_TP2_MOE_LL"
LL_VARIANTS = ("phase", "direct")  # MoeAllReduceLL (default) / MoeAllReduceLLDirect
# tokens of MoeAllReduceLLDirect: one token tile; [T, L] FP32 + BF16 in shared memory (168 KB at
# T=8: the DSL sets the kernel's max dynamic shared memory attribute to the device's opt-in)
DIRECT_MAX_T = 8


def resolve_ll(ll: str | None, proto: str, T: int) -> str:
    """The LL MoE kernel: ``ll`` (None: ``$DECODESCOPE_TP2_MOE_LL``, unset: ``phase``, the
    two-phase :class:`MoeAllReduceLL`); ``direct`` (:class:`MoeAllReduceLLDirect`) applies to
    the LL protocol up to ``DIRECT_MAX_T`` tokens, ``phase`` everywhere else."""
    v = os.environ.get(LL_ENV, "") if ll is None else ll
    v = v.strip().lower() or "phase"
    if v not in LL_VARIANTS:
        raise ValueError(f"moe_allreduce: {LL_ENV}={v!r}: expected one of {', '.join(LL_VARIANTS)}")
    return "direct" if v == "direct" and proto == "ll" and T <= DIRECT_MAX_T else "phase"


@dataclass(frozen=True)
class MoeARPlan:
    T: int
    L: int
    H: int
    eps: float
    prefetch: bool = True
    sms: int = H200_SMS
    pdl: bool = True
    proto: str | None = None  # flag / ll / auto; None: $DECODESCOPE_TP2_PROTO (resolved here)
    ll: str | None = None  # LL kernel: phase / direct; None: $DECODESCOPE_TP2_MOE_LL (resolved)

    def __post_init__(self) -> None:
        object.__setattr__(self, "proto", comm.resolve_proto(self.proto, "moe", self.T))
        object.__setattr__(self, "ll", resolve_ll(self.ll, self.proto, self.T))
        if self.T * (self.L + self.H) > comm.RECV_FLOATS:
            raise ValueError(f"moe_allreduce: {self.T} tokens exceed the receive area")


class MoeAllReduce(UpProjSharedAdd):
    def __init__(self, plan: MoeARPlan):
        super().__init__(plan.T, plan.L, plan.H, plan.eps, pdl=plan.pdl)
        self.q = plan
        if self.rows_per_cta % VEC:
            raise ValueError(
                f"moe_allreduce: {self.rows_per_cta} rows per unit, need a multiple of 8"
            )
        self.units = self.grid
        self.grid = min(self.units, plan.sms, comm.FLAG_SLOTS)
        self.acc_chunks = (plan.T * plan.L) // VEC
        self.share = -(-self.acc_chunks // self.grid)
        self.sh_off = -(-(plan.T * plan.L) // 32) * 32  # [T, H] shared area, 128-byte aligned

    @cute.jit
    def __call__(self, mAcc, mGamma, mW, mShared, mOut, mPre, nPre: Int32, mFlags, mRecv,
                 mPeerFlags, mPeerRecv, mCtl, stream):  # fmt: skip
        self.kernel(mAcc, mGamma, mW, mShared, mOut, mPre, nPre, mFlags, mRecv, mPeerFlags,
                    mPeerRecv, mCtl).launch(grid=[self.grid, 1, 1], block=[self.NW * 32, 1, 1],
                                 stream=stream, use_pdl=self.pdl)  # fmt: skip

    @cute.kernel
    def kernel(self, mAcc, mGamma, mW, mShared, mOut, mPre, nPre, mFlags, mRecv, mPeerFlags,
               mPeerRecv, mCtl):  # fmt: skip
        T, L, H, TT = self.T, self.L, self.H, self.TT
        NT = self.NW * 32
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        RPC = self.rows_per_cta

        smem = cutlass.memory.SmemAllocator()
        sX = smem.allocate_tensor(
            BFloat16, cute.make_ordered_layout((TT, L), order=(1, 0)), byte_alignment=16
        )
        sRstd = smem.allocate_tensor(Float32, cute.make_layout(8), byte_alignment=16)
        sEp = smem.allocate_tensor(Int32, cute.make_layout(4), byte_alignment=16)

        gWv = cute.zipped_divide(mW, (1, VEC))
        grp = lane // self.LPR
        li = lane % self.LPR
        # the first unit's weight chunks before anything else (registers): they stream in while
        # the previous kernel finishes (PDL) and while the partial sums are exchanged
        row_first = bid * RPC + (warp * self.G + grp) * self.R
        ws0 = load_rows(gWv, cutlass.min(row_first, H - self.R), 1, li, self.R, self.LPR,
                        self.NCH)  # fmt: skip
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        comm.begin_epoch(mCtl, self.grid, sEp)
        e = sEp[0]
        par = e % 2
        rowL = cute.make_ordered_layout((T, L), order=(1, 0))
        rowH = cute.make_ordered_layout((T, H), order=(1, 0))
        pbase = mPeerRecv.iterator + par * mPeerRecv.shape[1]
        obase = mRecv.iterator + par * mRecv.shape[1]
        mPeerS = cute.make_tensor(pbase + self.sh_off, rowH)
        mOwnA = cute.make_tensor(obase, rowL)
        mOwnS = cute.make_tensor(obase + self.sh_off, rowH)

        # 2: push this CTA's slice of A and its rows of S
        flatA = cute.zipped_divide(cute.make_tensor(mAcc.iterator, cute.make_layout(T * L)), (VEC,))
        flatP = cute.zipped_divide(cute.make_tensor(pbase, cute.make_layout(T * L)), (VEC,))
        c0 = bid * self.share
        for i in cutlass.range(tid, self.share, NT, unroll=1):
            c = c0 + i
            if c < self.acc_chunks:
                flatP[None, c].store(flatA[None, c].load())
        gS = cute.zipped_divide(mShared, (1, VEC))
        gPS = cute.zipped_divide(mPeerS, (1, VEC))
        cpr = RPC // VEC
        for u in cutlass.range(bid, self.units, self.grid, unroll=1):
            for i in cutlass.range(tid, T * cpr, NT, unroll=1):
                t = i // cpr
                cc = u * cpr + i % cpr
                if cc * VEC < H:
                    gPS[(0, None), (t, cc)].store(gS[(0, None), (t, cc)].load())
        cute.arch.sync_threads()
        comm.release_to_peer(mPeerFlags, bid, e + 1)
        # 3: prefetch the next op's weights while the peer's slices travel
        if const_expr(self.q.prefetch):
            comm.prefetch_range(mPre, nPre, bid, self.grid, NT)
        # 4: wait for every peer CTA
        for i in cutlass.range(tid, self.grid, NT, unroll=1):
            comm.wait_flag(mFlags.iterator + i, e + 1, mCtl.iterator + 2)
        cute.arch.sync_threads()

        gAv = cute.zipped_divide(mAcc, (1, VEC))
        gOv = cute.zipped_divide(mOwnA, (1, VEC))
        gGv = cute.zipped_divide(
            cute.make_tensor(mGamma.iterator, cute.make_layout((1, L))), (1, VEC)
        )
        sXv = cute.zipped_divide(sX, (1, VEC))
        acc = cute.make_rmem_tensor((self.R, TT), Float32)
        # grid <= units: every CTA has its first unit (weights already in registers)
        self._unit(ws0, gAv, gOv, gGv, sXv, sRstd, mShared, mOwnS, mOut, acc, row_first, li)
        for u in cutlass.range(bid + self.grid, self.units, self.grid, unroll=1):
            row0 = u * RPC + (warp * self.G + grp) * self.R
            ws = load_rows(gWv, cutlass.min(row0, H - self.R), 1, li, self.R, self.LPR, self.NCH)
            self._unit(ws, gAv, gOv, gGv, sXv, sRstd, mShared, mOwnS, mOut, acc, row0, li)

    @cute.jit
    def _unit(self, ws, gAv, gOv, gGv, sXv, sRstd, mShared, mOwnS, mOut, acc, row0, li):
        """Every token tile of one 16-row unit."""
        T, TT = self.T, self.TT
        for t0 in cutlass.range(0, (T // TT) * TT, TT, unroll=1):
            self._tile_ar(ws, gAv, gOv, gGv, sXv, sRstd, mShared, mOwnS, mOut, acc, t0, row0, li,
                          TT)  # fmt: skip
        if const_expr(T % TT):
            self._tile_ar(ws, gAv, gOv, gGv, sXv, sRstd, mShared, mOwnS, mOut, acc, T - T % TT,
                          row0, li, T % TT)  # fmt: skip

    @cute.jit
    def _tile_ar(self, ws, gAv, gOv, gGv, sXv, sRstd, mShared, mOwnS, mOut, acc, t0, row0, li,
                 nt: cutlass.Constexpr[int]):  # fmt: skip
        """``UpProjSharedAdd._token_tile`` on the reduced latent ``A_0 + A_1`` and shared
        output ``S_0 + S_1`` (this rank's own + the peer's received copy)."""
        L, H = self.L, self.H
        NT = self.NW * 32
        KV = L // VEC
        tid, _, _ = cute.arch.thread_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        if warp < nt:
            ss = Float32(0.0)
            for c in cutlass.range(lane, KV, 32, unroll=4):
                v = gAv[(0, None), (t0 + warp, c)].load() + gOv[(0, None), (t0 + warp, c)].load()
                ss = ss + (v * v).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            ss = cute.arch.warp_reduction(ss, lambda a, b: a + b)
            if lane == 0:
                sRstd[warp] = cute.math.rsqrt(ss / Float32(L) + Float32(self.eps))
        cute.arch.barrier()
        for i in cutlass.range(tid, nt * KV, NT, unroll=4):
            t = i // KV
            c = i % KV
            v = gAv[(0, None), (t0 + t, c)].load() + gOv[(0, None), (t0 + t, c)].load()
            gm = gGv[(0, None), (0, c)].load().to(Float32)
            sXv[(0, None), (t, c)].store((v * gm * sRstd[t]).to(BFloat16))
        cute.arch.barrier()
        dot_rows(ws, sXv, acc, li, self.R, nt, self.LPR, self.NCH)
        if li == 0:
            for r in cutlass.range_constexpr(self.R):
                if row0 + r < H:
                    for t in cutlass.range_constexpr(nt):
                        s = mShared[t0 + t, row0 + r] + mOwnS[t0 + t, row0 + r]
                        mOut[t0 + t, row0 + r] = (acc[r, t] + s).to(BFloat16)
        cute.arch.barrier()


class MoeAllReduceLL(UpProjSharedAdd):
    """The MoE back end over the LL protocol (:mod:`.comm`), in two phases, on the single-GPU
    kernel's full grid (no persistent loop, no wait for every peer CTA):

    1. Thread 0 arrives on the epoch word: epoch ``e`` and this CTA's arrival order ``k``.
       The first ``P = min(grid, SMs)`` CTAs to arrive (``k < P``: they are running, so they
       cannot be starved by CTAs waiting in phase 2) each own slice ``k`` of the flat exchange
       vector ``[A (T x L); S (T x H)]``: they store it into the peer's ``ll[e % 2]`` as words
       ``{value, e + 1}``, poll their own ``ll[e % 2]`` for the peer's same slice, write
       ``own + peer`` (FP32) into the local ``red`` area, ``bar.sync`` and raise the local flag
       ``ctl[DONE_OFF + k] = e + 1`` (``st.release.gpu``).
    2. Every CTA waits (``ld.acquire.gpu``, one thread per flag) for the ``P`` local flags, then
       runs :class:`.up_proj_shared_add.UpProjSharedAdd`'s token tiles on ``red`` (the reduced
       ``A`` and ``S``): the single-GPU kernel's body, bit for bit the same math.

    Deadlock-free at any residency: phase 1 waits only on the peer's phase-1 CTAs (running,
    they store before they wait); phase 2 waits only on phase-1 CTAs of this rank (running).
    ``red`` needs no parity: the next launch writes it only after this one completed."""

    def __init__(self, plan: MoeARPlan):
        super().__init__(plan.T, plan.L, plan.H, plan.eps, pdl=plan.pdl)
        self.q = plan
        self.P = min(self.grid, plan.sms, comm.FLAG_SLOTS)
        self.total = plan.T * (plan.L + plan.H)
        self.share = -(-self.total // self.P)

    @cute.jit
    def __call__(self, mAcc, mGamma, mW, mShared, mOut, mPre, nPre: Int32, mLL, mPeerLL, mRed,
                 mCtl, stream):  # fmt: skip
        self.kernel_ll(mAcc, mGamma, mW, mShared, mOut, mPre, nPre, mLL, mPeerLL, mRed,
                       mCtl).launch(grid=[self.grid, 1, 1], block=[self.NW * 32, 1, 1],
                                    stream=stream, use_pdl=self.pdl)  # fmt: skip

    @cute.kernel
    def kernel_ll(self, mAcc, mGamma, mW, mShared, mOut, mPre, nPre, mLL, mPeerLL, mRed, mCtl):
        T, L, H, TT = self.T, self.L, self.H, self.TT
        NT = self.NW * 32
        TL = T * L
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        half = mLL.shape[1]

        smem = cutlass.memory.SmemAllocator()
        sX = smem.allocate_tensor(
            BFloat16, cute.make_ordered_layout((TT, L), order=(1, 0)), byte_alignment=16
        )
        sRstd = smem.allocate_tensor(Float32, cute.make_layout(8), byte_alignment=16)
        sEp = smem.allocate_tensor(Int32, cute.make_layout(4), byte_alignment=16)

        gWv = cute.zipped_divide(mW, (1, VEC))
        grp = lane // self.LPR
        li = lane % self.LPR
        row0 = bid * self.rows_per_cta + (warp * self.G + grp) * self.R
        # this CTA's weight chunks first (registers): they stream in during the exchange
        ws = load_rows(gWv, cutlass.min(row0, H - self.R), 1, li, self.R, self.LPR, self.NCH)
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        word = Int64(0)
        if tid == 0:
            word = comm.epoch_arrive(mCtl)
            sEp[0] = comm.lo32(word)
            sEp[1] = comm.hi32(word)
        cute.arch.barrier()
        e = sEp[0]
        k = sEp[1]
        base = (e % 2) * half
        flatA = cute.make_tensor(mAcc.iterator, cute.make_layout(TL))
        flatS = cute.make_tensor(mShared.iterator, cute.make_layout(T * H))
        # 1: slice k of [A; S]: to the peer, then own + peer into red
        if k < self.P:
            i0 = k * self.share
            for i in cutlass.range(tid, self.share, NT, unroll=1):
                idx = i0 + i
                if idx < self.total:
                    v = Float32(0.0)
                    if idx < TL:  # noqa: SIM108 (a dynamic branch: no Python ternary)
                        v = flatA[idx]
                    else:
                        v = flatS[idx - TL]
                    comm.st_ll(mPeerLL.iterator + base + idx, v, e + 1)
            if const_expr(self.q.prefetch):
                comm.prefetch_range(mPre, nPre, k, self.P, NT)
            for i in cutlass.range(tid, self.share, NT, unroll=1):
                idx = i0 + i
                if idx < self.total:
                    v = Float32(0.0)
                    if idx < TL:  # noqa: SIM108 (a dynamic branch: no Python ternary)
                        v = flatA[idx]
                    else:
                        v = flatS[idx - TL]
                    peer = comm.wait_ll(mLL.iterator + base + idx, e + 1, mCtl.iterator + 2)
                    mRed[idx] = v + peer
            cute.arch.barrier()
            if tid == 0:
                cute.arch.store(mCtl.iterator + comm.DONE_OFF + k, e + 1, sem="release",
                                scope="gpu")  # fmt: skip
        # 2: every slice reduced on this rank, then the single-GPU kernel's body on red
        for j in cutlass.range(tid, self.P, NT, unroll=1):
            comm.wait_local(mCtl.iterator + comm.DONE_OFF + j, e + 1, mCtl.iterator + 2)
        cute.arch.barrier()
        redA = cute.make_tensor(mRed.iterator, cute.make_ordered_layout((T, L), order=(1, 0)))
        redS = cute.make_tensor(mRed.iterator + TL, cute.make_ordered_layout((T, H), order=(1, 0)))
        gAv = cute.zipped_divide(redA, (1, VEC))
        gGv = cute.zipped_divide(
            cute.make_tensor(mGamma.iterator, cute.make_layout((1, L))), (1, VEC)
        )
        sXv = cute.zipped_divide(sX, (1, VEC))
        acc = cute.make_rmem_tensor((self.R, TT), Float32)
        for t0 in cutlass.range(0, (T // TT) * TT, TT, unroll=1):
            self._token_tile(ws, gAv, gGv, sXv, sRstd, redS, mOut, acc, t0, row0, li, TT)
        if const_expr(T % TT):
            self._token_tile(ws, gAv, gGv, sXv, sRstd, redS, mOut, acc, T - T % TT, row0, li,
                             T % TT)  # fmt: skip
        if tid == 0:
            comm.epoch_finish(mCtl, word, self.grid)


class MoeAllReduceLLDirect(UpProjSharedAdd):
    """The MoE back end over the LL protocol without the local flag hop
    (``DECODESCOPE_TP2_MOE_LL=direct``, up to ``DIRECT_MAX_T`` tokens; issue #8): no ``red``
    area, no local done flags.
    Same arguments, grid (the single-GPU kernel's), math and rounding as :class:`MoeAllReduceLL`.

    1. This CTA's weight chunks into registers; ``griddepcontrol.wait``; thread 0 issues the
       epoch atomic (:func:`.comm.epoch_arrive`). While it travels, every CTA copies this
       rank's ``A`` ([T, L], all of it: the latent norm needs whole rows) into shared memory
       ``sA`` and loads its own rows of ``S``: nothing of that needs the epoch.
    2. The epoch word is consumed (one ``bar.sync``): epoch ``e``, arrival order ``k``. The
       first ``P = min(grid, SMs)`` arrivers each store slice ``k`` of the flat ``[A; S]`` into
       the peer's ``ll[e % 2]`` as ``{value, e + 1}`` words (the ``A`` part from ``sA``), as
       :class:`MoeAllReduceLL` does; they then prefetch share ``k`` of the next op's weights.
    3. Every CTA issues the loads of the peer's ``A`` words of its own ``ll[e % 2]`` (each
       thread ``ceil(L / threads)`` words per token, all in flight together), settles them
       (:func:`.comm.settle_ll`: a word not yet there is polled again) and writes
       ``own + peer`` into ``sA``; then :class:`.up_proj_shared_add.UpProjSharedAdd`'s norm,
       BF16 staging and row dot products on ``sA``, with the peer's ``S`` words of its rows
       loaded before the dot products and settled in the epilogue: ``acc + (own + peer)``.

    Why the pushes stay with the first ``P`` arrivers (not spread over all 448 CTAs): every
    CTA waits for all of the peer's ``A``; a slice owned by a CTA of a later wave could not be
    stored while the first wave, occupying the SMs, waits for it. Why the arrival order, not
    ``blockIdx < P``: CUDA does not promise that low block indices are dispatched first; an
    arrival is proof that the CTA runs.

    Safety (the LL part of :mod:`.comm`'s docstring, unchanged; what differs: a word is read by
    every CTA of the rank, not by one): a polled word shows ``e + 1`` only if the peer stored
    it in launch ``e`` (flags unique per launch, payload in the same single-copy-atomic store).
    The peer stores into ``ll[e % 2]`` again only in its launch ``e + 2``, which starts after
    its launch ``e + 1`` completed, which needed (every CTA of it polls this rank's ``A``
    words) this rank's pushes of launch ``e + 1``, made after this rank's launch ``e``
    completed, *all* of its CTAs' reads included. So no word is overwritten before every
    reader of this rank has read it, and the parity is what keeps the peer's launch ``e + 1``
    (which can run ahead by one) off the words of launch ``e`` (the model fails without it:
    ``tests/test_moe_ll_direct.py``). The epoch itself cannot be read before the pushes: the
    words carry ``e + 1`` and the parity selects the half, so the only latency to hide is the
    atomic's round trip, hidden behind the loads of step 1.

    Deadlock-free when at least ``P`` CTAs of the grid can be resident (as the two-phase
    kernel): every wait is on a word of the peer's first ``P`` arrivers, which are running and
    store all their words before they wait for anything; no CTA waits for another CTA of its
    own rank."""

    def __init__(self, plan: MoeARPlan):
        super().__init__(plan.T, plan.L, plan.H, plan.eps, pdl=plan.pdl)
        if plan.T > DIRECT_MAX_T or self.TT != plan.T:
            raise ValueError(f"moe_allreduce direct: {plan.T} tokens, at most {DIRECT_MAX_T}")
        self.q = plan
        self.P = min(self.grid, plan.sms, comm.FLAG_SLOTS)
        self.total = plan.T * (plan.L + plan.H)
        self.share = -(-self.total // self.P)
        self.NT = self.NW * 32
        self.WPT = -(-plan.L // self.NT)  # peer A words per thread per token

    @cute.jit
    def __call__(self, mAcc, mGamma, mW, mShared, mOut, mPre, nPre: Int32, mLL, mPeerLL, mRed,
                 mCtl, stream):  # fmt: skip
        self.kernel_direct(mAcc, mGamma, mW, mShared, mOut, mPre, nPre, mLL, mPeerLL,
                           mCtl).launch(grid=[self.grid, 1, 1], block=[self.NT, 1, 1],
                                        stream=stream, use_pdl=self.pdl)  # fmt: skip

    @cute.kernel
    def kernel_direct(self, mAcc, mGamma, mW, mShared, mOut, mPre, nPre, mLL, mPeerLL, mCtl):
        T, L, H, TT, R = self.T, self.L, self.H, self.TT, self.R
        NT = self.NT
        TL = T * L
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        half = mLL.shape[1]
        err = mCtl.iterator + 2

        smem = cutlass.memory.SmemAllocator()
        sX = smem.allocate_tensor(
            BFloat16, cute.make_ordered_layout((TT, L), order=(1, 0)), byte_alignment=16
        )
        sA = smem.allocate_tensor(
            Float32, cute.make_ordered_layout((T, L), order=(1, 0)), byte_alignment=16
        )
        sRstd = smem.allocate_tensor(Float32, cute.make_layout(8), byte_alignment=16)
        sEp = smem.allocate_tensor(Int32, cute.make_layout(4), byte_alignment=16)

        gWv = cute.zipped_divide(mW, (1, VEC))
        grp = lane // self.LPR
        li = lane % self.LPR
        warp = cute.arch.warp_idx()
        row0 = bid * self.rows_per_cta + (warp * self.G + grp) * R
        # 1: this CTA's weight chunks first (registers), then the epoch atomic, then this
        # rank's own values while the atomic travels
        ws = load_rows(gWv, cutlass.min(row0, H - R), 1, li, R, self.LPR, self.NCH)
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        word = Int64(0)
        if tid == 0:
            word = comm.epoch_arrive(mCtl)
        sAf = cute.make_tensor(sA.iterator, cute.make_layout(TL))
        sAfv = cute.zipped_divide(sAf, (VEC,))
        gAfv = cute.zipped_divide(cute.make_tensor(mAcc.iterator, cute.make_layout(TL)), (VEC,))
        nchk = TL // VEC
        own = []
        for j in cutlass.range_constexpr(-(-nchk // NT)):
            own.append(gAfv[None, cutlass.min(tid + j * NT, nchk - 1)].load())
        ownS = []
        for r in cutlass.range_constexpr(R):
            for t in cutlass.range_constexpr(T):
                ownS.append(mShared[t, cutlass.min(row0 + r, H - 1)])
        for j in cutlass.range_constexpr(-(-nchk // NT)):
            # clamped, no branch (the last chunk written twice with its value): the compiler
            # would sink a load into a branch behind the previous store
            sAfv[None, cutlass.min(tid + j * NT, nchk - 1)].store(own[j])
        # 2: the epoch word consumed here; the first P arrivers push slice k of [A; S]
        if tid == 0:
            sEp[0] = comm.lo32(word)
            sEp[1] = comm.hi32(word)
        cute.arch.barrier()
        e = sEp[0]
        k = sEp[1]
        base = (e % 2) * half
        flatS = cute.make_tensor(mShared.iterator, cute.make_layout(T * H))
        if k < self.P:
            i0 = k * self.share
            for i in cutlass.range(tid, self.share, NT, unroll=1):
                idx = i0 + i
                if idx < self.total:
                    v = Float32(0.0)
                    if idx < TL:  # noqa: SIM108 (a dynamic branch: no Python ternary)
                        v = sAf[idx]
                    else:
                        v = flatS[idx - TL]
                    comm.st_ll(mPeerLL.iterator + base + idx, v, e + 1)
            if const_expr(self.q.prefetch):
                comm.prefetch_range(mPre, nPre, k, self.P, NT)
        # 3: the peer's A words straight from this rank's ll[e % 2]: own + peer into sA (the
        # first token's loads are in flight across the barrier that ends the pushes' sA reads)
        w0 = self._poll_row(mLL, base, 0, tid)
        cute.arch.barrier()
        self._settle_row(mLL, sA, base, e, err, 0, w0, tid)
        if const_expr(T > 1):
            for t in cutlass.range_constexpr(1, T):
                self._settle_row(mLL, sA, base, e, err, t, self._poll_row(mLL, base, t, tid), tid)
        cute.arch.barrier()
        sAv = cute.zipped_divide(sA, (1, VEC))
        gGv = cute.zipped_divide(
            cute.make_tensor(mGamma.iterator, cute.make_layout((1, L))), (1, VEC)
        )
        sXv = cute.zipped_divide(sX, (1, VEC))
        acc = cute.make_rmem_tensor((R, TT), Float32)
        self._tile_direct(ws, sAv, gGv, sXv, sRstd, ownS, mLL, base, e, err, mOut, acc, row0, li)
        if tid == 0:
            comm.epoch_finish(mCtl, word, self.grid)

    @cute.jit
    def _poll_row(self, mLL, base, t: cutlass.Constexpr[int], tid):
        """The loads of this thread's peer ``A`` words of token ``t`` (element ``tid + j * NT``
        of the row), all issued before any is used."""
        L, NT = self.L, self.NT
        ws = []
        for j in cutlass.range_constexpr(self.WPT):
            c = cutlass.min(tid + j * NT, L - 1)
            ws.append(comm.ld_ll(mLL.iterator + base + t * L + c))
        return ws

    @cute.jit
    def _settle_row(self, mLL, sA, base, e, err, t: cutlass.Constexpr[int], ws, tid):
        """``sA[t, c] = own + peer`` for this thread's elements of token ``t`` (own first, as
        the two-phase kernel's ``red``)."""
        L, NT = self.L, self.NT
        for j in cutlass.range_constexpr(self.WPT):
            c = tid + j * NT
            if const_expr((j + 1) * NT <= L):
                peer = comm.settle_ll(mLL.iterator + base + t * L + c, ws[j], e + 1, err)
                sA[t, c] = sA[t, c] + peer
            else:
                if c < L:
                    peer = comm.settle_ll(mLL.iterator + base + t * L + c, ws[j], e + 1, err)
                    sA[t, c] = sA[t, c] + peer

    @cute.jit
    def _tile_direct(self, ws, sAv, gGv, sXv, sRstd, ownS, mLL, base, e, err, mOut, acc, row0,
                     li):  # fmt: skip
        """``UpProjSharedAdd._token_tile`` (its loops and roundings, one tile of all ``T``
        tokens) on the reduced latent in ``sA``; the epilogue adds ``own S + peer S``, the
        peer's words loaded before the dot products and settled after."""
        L, H, T, R = self.L, self.H, self.T, self.R
        TL = T * L
        self._norm_stage(sAv, 0, gGv, sXv, sRstd, T)
        peerS = []
        for r in cutlass.range_constexpr(R):
            for t in cutlass.range_constexpr(T):
                peerS.append(comm.ld_ll(mLL.iterator + base + TL + t * H
                                        + cutlass.min(row0 + r, H - 1)))  # fmt: skip
        dot_rows(ws, sXv, acc, li, R, T, self.LPR, self.NCH)
        if li == 0:
            for r in cutlass.range_constexpr(R):
                if row0 + r < H:
                    for t in cutlass.range_constexpr(T):
                        p = comm.settle_ll(mLL.iterator + base + TL + t * H + row0 + r,
                                           peerS[r * T + t], e + 1, err)  # fmt: skip
                        s = ownS[r * T + t] + p
                        mOut[t, row0 + r] = (acc[r, t] + s).to(BFloat16)


# -- torch-facing --------------------------------------------------------------------------


def _build(plan: MoeARPlan):
    ll = plan.proto == "ll"
    if ll:
        op = MoeAllReduceLLDirect(plan) if plan.ll == "direct" else MoeAllReduceLL(plan)
    else:
        op = MoeAllReduce(plan)
    T, L, H = plan.T, plan.L, plan.H
    args = (
        *fake_back_args(T, L, H),
        itf.fake(torch.bfloat16, (comm.PREFETCH_HEAD,)),
        Int32(0),
        *(comm.fake_workspace_args_ll() if ll else comm.fake_workspace_args()),
        itf.env_stream(),
    )
    return op, args


def compile_plan(plan: MoeARPlan):
    return itf.compiled(("moe_allreduce", plan), lambda: _build(plan))


def moe_allreduce(
    ws: comm.PeerWorkspace,
    acc: torch.Tensor,
    latent_norm: torch.Tensor,
    latent_up: torch.Tensor,
    shared_out: torch.Tensor,
    out: torch.Tensor,
    eps: float,
    prefetch: torch.Tensor | None = None,
    proto: str | None = None,
    ll: str | None = None,
) -> None:
    """One launch of :class:`MoeAllReduce` (both ranks, same order as every kernel of ``ws``).
    ``proto``: ``flag``, ``ll`` or ``auto`` (:mod:`.comm`); None: ``$DECODESCOPE_TP2_PROTO``,
    else ``comm.PROTO_DEFAULT`` (ll). ``ll``: the LL kernel, ``phase`` (:class:`MoeAllReduceLL`)
    or ``direct`` (:class:`MoeAllReduceLLDirect`, up to ``DIRECT_MAX_T`` tokens); None:
    ``$DECODESCOPE_TP2_MOE_LL``, unset: ``phase``."""
    T, L, H = check_back_args(acc, latent_norm, latent_up, shared_out, out)
    head, npre = comm.PeerWorkspace.prefetch_args(prefetch, acc.device)
    plan = MoeARPlan(T, L, H, float(eps), True, device_sms(acc.device), pdl_enabled(), proto, ll)
    wsa = ws.args_ll() if plan.proto == "ll" else ws.args()
    compile_plan(plan)(acc, latent_norm, latent_up, shared_out, out, head, npre, *wsa)


def moe_allreduce_ref(accs, latent_norm, latent_up, shareds, eps: float) -> torch.Tensor:
    """Torch reference over simulated ranks: FP32 partials summed, then
    ``up_proj_shared_add_ref``'s math (BF16 staging of the normalized latent)."""
    a = sum(x.float() for x in accs)
    s = sum(x.float() for x in shareds)
    xn = a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + eps) * latent_norm.float()
    y = xn.to(torch.bfloat16).float() @ latent_up.float().T + s
    return y.to(torch.bfloat16)
