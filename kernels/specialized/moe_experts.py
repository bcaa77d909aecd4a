"""Routed experts (w13 + SiTU, w2 + routing-weighted sum) and the shared experts' down GEMM in
one persistent kernel.

Prologue (every CTA, no global metadata): rank the T tokens (:func:`router_topk.select_topk`:
sigmoid + bias + top-k + renormalization from the FP32 logits the front kernel wrote), count the
picks per expert in shared memory, compact the selected experts in expert order and build each
expert's list of (token, k) pairs. Every CTA derives the same expert order, so the tile
numbering below is the same in all of them.

Tiles, handed out round-robin over a persistent grid of one CTA per SM, in this order:

1. shared-down tiles (rows of ``shared_w2 [H, S]`` against SiTU of the shared gate/up that the
   front kernel produced) -> FP32 ``shared_out [T, H]``: independent of the routing, so each
   CTA prefetches its first one into L2 before the prologue (even before the front kernel has
   finished, under PDL); the "shared experts overlapped" of the reference, inside one launch.
2. w13 tiles ``(expert a, gate-row block)``: each warp owns one gate row and its up row
   (``w13[e, r]`` and ``w13[e, Ie + r]``) for all the expert's pairs. A lane's weight chunks
   are loaded into registers once per tile and reused for every chunk of pairs (chunks of 1, 2
   or 4 staged tokens: no FMAs on empty slots), so each selected expert's weights stream from
   HBM once per step. Applies SiTU, writes the BF16 intermediate ``h [T*k, Ie]``, then bumps
   ``done[e]`` (release).
3. w2 tiles ``(expert a, row block of L)``: wait until ``done[e]`` says all of the expert's w13
   tiles finished (acquire), then ``acc[t, :] += weight[t, k] * (w2[e] @ h[t*k + k])``.

At the top of each tile the CTA issues ``prefetch.global.L2`` for its next tile's weights.

The weighted sum over the top-k is FP32 atomics (``atom.global.add.f32``) into ``acc``, which
the front kernel zeroed: the sum order across experts varies from run to run (last-bit
nondeterminism, far under BF16 tolerances); a deterministic reduction would cost a
``[T, k, L]`` FP32 round trip.

Deadlock freedom of the wait: w13 tiles are numbered before w2 tiles, and each CTA walks its
tiles in increasing order, so when any CTA waits on a w2 tile every w13 tile is finished or
held by a running CTA that never waits; this needs all CTAs resident at once, which a grid of
one CTA per SM (256 threads at 255 registers, < 100 KB shared memory) guarantees when nothing
else runs beside it (under PDL the up-projection launches only as this grid's CTAs exit).

Launch count: 1.

:class:`MoeExpertsPipe` (the default; ``DECODESCOPE_MOE_EXPERTS=old`` selects the kernel above)
computes the same thing with the weights streamed by ``cp.async.bulk`` into a ring of
shared-memory slots on mbarriers, several tiles ahead of the math, in a grouped tile order (a
CTA's tiles are consecutive row blocks of one expert, so staged z / h rows are reused and the
``done`` counters are bumped once per run of tiles). See its docstring and
notes/specialized_moe.md.
"""

from __future__ import annotations

import os

import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32, Int64, const_expr
from cutlass.experimental import primitives as prims

from decodescope.kernels.specialized import interface as itf
from decodescope.kernels.specialized.moe_common import (
    VEC,
    dot_rows,
    dot_rows_grp,
    dot_rows_idx,
    lanes_per_row,
    load_rows,
    situ,
)
from decodescope.kernels.specialized.router_topk import pdl_enabled, select_topk


class MoeExperts:
    """Compile-time facts: T tokens, E experts, K = top-k, L latent, Ie expert intermediate,
    H hidden, S shared intermediate, routed scaling, SiTU betas, CTAs in the persistent grid."""

    def __init__(
        self,
        T: int,
        E: int,
        K: int,
        L: int,
        Ie: int,
        H: int,
        S: int,
        scaling: float,
        beta: float,
        lbeta: float,
        num_ctas: int,
        TT: int = 4,
        NW: int = 8,
        pdl: bool = True,
    ):
        self.pdl = pdl
        if E % 32:
            raise ValueError(f"num_experts={E} must be a multiple of 32")
        if K > 32:
            raise ValueError(f"top_k={K} must be <= 32")
        self.T, self.E, self.K, self.L, self.Ie, self.H, self.S = T, E, K, L, Ie, H, S
        self.scaling, self.beta, self.lbeta = scaling, beta, lbeta
        self.num_ctas, self.TT, self.NW = num_ctas, TT, NW
        # up to 8 tokens: every CTA stages all tokens' latent z once (BF16, <= 57 KB) in its
        # prologue, and the w13 tiles read it by token: no staging round trip per tile
        self.prestage = T <= 8
        self.TTs = min(TT, T)
        # w13: K = L, one gate row + its up row per lane group
        self.LPR13 = lanes_per_row(L)
        self.G13 = 32 // self.LPR13
        self.NCH13 = L // VEC // self.LPR13
        self.rows13 = NW * self.G13
        self.NRB13 = -(-Ie // self.rows13)
        # shared down: K = S, 4 rows per lane group
        self.LPRs = lanes_per_row(S)
        self.Gs = 32 // self.LPRs
        self.NCHs = S // VEC // self.LPRs
        self.Rs = 4
        self.rowss = NW * self.Gs * self.Rs
        self.NSB = -(-H // self.rowss)
        # w2: K = Ie, 4 rows per lane group
        self.LPR2 = lanes_per_row(Ie)
        self.G2 = 32 // self.LPR2
        self.NCH2 = Ie // VEC // self.LPR2
        self.R2 = 4
        self.rows2 = NW * self.G2 * self.R2
        if H % self.Rs or L % self.R2:
            raise ValueError(f"hidden {H} and latent {L} must be multiples of 4 (rows per lane)")
        self.NRB2 = -(-L // self.rows2)

    @cute.jit
    def __call__(
        self,
        mY: cute.Tensor,
        mBias: cute.Tensor,
        mW13: cute.Tensor,
        mW2: cute.Tensor,
        mWs2: cute.Tensor,
        mH: cute.Tensor,
        mAcc: cute.Tensor,
        mShared: cute.Tensor,
        mDone: cute.Tensor,
        mIds: cute.Tensor,
        mTw: cute.Tensor,
        stream,
    ):
        self.kernel(mY, mBias, mW13, mW2, mWs2, mH, mAcc, mShared, mDone, mIds, mTw).launch(
            grid=[self.num_ctas, 1, 1],
            block=[self.NW * 32, 1, 1],
            stream=stream,
            use_pdl=self.pdl,
        )

    @cute.kernel
    def kernel(
        self,
        mY: cute.Tensor,
        mBias: cute.Tensor,
        mW13: cute.Tensor,
        mW2: cute.Tensor,
        mWs2: cute.Tensor,
        mH: cute.Tensor,
        mAcc: cute.Tensor,
        mShared: cute.Tensor,
        mDone: cute.Tensor,
        mIds: cute.Tensor,
        mTw: cute.Tensor,
    ):
        T, E, K, L, Ie, H, S = self.T, self.E, self.K, self.L, self.Ie, self.H, self.S
        TT = self.TT
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()

        smem = cutlass.memory.SmemAllocator()
        sIds = smem.allocate_tensor(Int32, cute.make_layout(T * K), byte_alignment=16)
        sTw = smem.allocate_tensor(Float32, cute.make_layout(T * K), byte_alignment=16)
        sPairs = smem.allocate_tensor(Int32, cute.make_layout(T * K), byte_alignment=16)
        sCnt = smem.allocate_tensor(Int32, cute.make_layout(E), byte_alignment=16)
        sActE = smem.allocate_tensor(Int32, cute.make_layout(E), byte_alignment=16)
        sActOff = smem.allocate_tensor(Int32, cute.make_layout(E), byte_alignment=16)
        sActN = smem.allocate_tensor(Int32, cute.make_layout(E), byte_alignment=16)
        sNact = smem.allocate_tensor(Int32, cute.make_layout(4), byte_alignment=16)
        ZT = T if const_expr(self.prestage) else TT
        sZ = smem.allocate_tensor(
            BFloat16, cute.make_ordered_layout((ZT, L), order=(1, 0)), byte_alignment=16
        )
        sA = smem.allocate_tensor(
            BFloat16, cute.make_ordered_layout((self.TTs, S), order=(1, 0)), byte_alignment=16
        )
        sHx = smem.allocate_tensor(
            BFloat16, cute.make_ordered_layout((TT, Ie), order=(1, 0)), byte_alignment=16
        )

        if bid < self.NSB:
            # this CTA's first tile is a shared-expert tile (weights only): into L2 while the
            # front kernel finishes and the routing prologue runs
            r0 = bid * self.rowss
            self._prefetch_span(
                mWs2.iterator + r0 * S, (cutlass.min(r0 + self.rowss, H) - r0) * S * 2
            )
        if const_expr(self.pdl):
            # launched once every front CTA started; wait for the front grid to complete. No
            # early trigger here: the up-projection launches as this grid's CTAs exit, so all
            # of this grid's CTAs are resident together (the w2 wait needs it).
            cute.arch.griddepcontrol_wait()
        self._routing(
            mY, mBias, mIds, mTw, sIds, sTw, sPairs, sCnt, sActE, sActOff, sActN, sNact, sZ
        )

        nact = sNact[0]
        nsh = self.NSB  # tiles [0, nsh): shared down; [nsh, n13): w13; [n13, total): w2
        n13 = nsh + nact * self.NRB13
        total = n13 + nact * self.NRB2

        gYv = cute.zipped_divide(mY, (1, VEC))
        sZv = cute.zipped_divide(sZ, (1, VEC))
        sAv = cute.zipped_divide(sA, (1, VEC))
        sHv = cute.zipped_divide(sHx, (1, VEC))
        gHv = cute.zipped_divide(mH, (1, VEC))
        gWs2v = cute.zipped_divide(mWs2, (1, VEC))
        acc13 = cute.make_rmem_tensor((2, TT), Float32)
        accs = cute.make_rmem_tensor((self.Rs, self.TTs), Float32)
        acc2 = cute.make_rmem_tensor((self.R2, TT), Float32)

        tile = bid
        while tile < total:
            # the next tile's weights into L2 now: its loads then skip the HBM latency
            self._prefetch_tile(mW13, mW2, mWs2, sActE, nsh, n13, total, tile + self.num_ctas)
            if tile < nsh:
                # ---- shared experts: down GEMM over SiTU(gate, up) ----
                sb = tile
                grp = lane // self.LPRs
                li = lane % self.LPRs
                row0 = sb * self.rowss + (warp * self.Gs + grp) * self.Rs
                ws = load_rows(gWs2v, cutlass.min(row0, H - self.Rs), 1, li, self.Rs, self.LPRs,
                               self.NCHs)  # fmt: skip
                TTs = self.TTs
                for t0 in cutlass.range(0, (T // TTs) * TTs, TTs, unroll=1):
                    self._shared_tile(ws, gYv, sAv, mShared, accs, t0, row0, li, TTs)
                if const_expr(T % TTs):
                    self._shared_tile(ws, gYv, sAv, mShared, accs, T - T % TTs, row0, li, T % TTs)
            elif tile < n13:
                # ---- w13 + SiTU ----
                t1 = tile - nsh
                a = t1 // self.NRB13
                rb = t1 % self.NRB13
                e = sActE[a]
                start = sActOff[a]
                n = sActN[a]
                gW = cute.zipped_divide(self._expert(mW13, e, 2 * Ie, L), (1, VEC))
                grp = lane // self.LPR13
                li = lane % self.LPR13
                row = rb * self.rows13 + warp * self.G13 + grp
                ws = load_rows(gW, cutlass.min(row, Ie - 1), Ie, li, 2, self.LPR13, self.NCH13)
                p0 = Int32(0)
                while p0 < n:  # pairs in chunks of 1, 2 or up to TT: no FMAs on empty slots
                    rem = n - p0
                    if rem == 1:
                        self._w13_chunk(ws, gYv, sZv, sPairs, mH, acc13, start, n, p0, row, li, 1)
                    elif rem == 2:
                        self._w13_chunk(ws, gYv, sZv, sPairs, mH, acc13, start, n, p0, row, li, 2)
                    else:
                        self._w13_chunk(ws, gYv, sZv, sPairs, mH, acc13, start, n, p0, row, li, TT)
                    p0 = p0 + cutlass.min(rem, TT)
                # the chunk's trailing barrier ordered every thread's h stores before this;
                # thread 0's release (cumulative, GPU scope) publishes them: the other warps go
                # straight on to their next tile instead of each waiting on a fence
                if tid == 0:
                    cute.arch.fence_acq_rel_gpu()
                    cute.arch.atomic_add(mDone.iterator + e, Int32(1), sem="release", scope="gpu")
            else:
                # ---- w2 + routing-weighted sum ----
                t2 = tile - n13
                a = t2 // self.NRB2
                rb = t2 % self.NRB2
                e = sActE[a]
                start = sActOff[a]
                n = sActN[a]
                gW = cute.zipped_divide(self._expert(mW2, e, L, Ie), (1, VEC))
                grp = lane // self.LPR2
                li = lane % self.LPR2
                row0 = rb * self.rows2 + (warp * self.G2 + grp) * self.R2
                # w2 rows stream while this tile waits for the expert's w13 tiles
                ws = load_rows(gW, cutlass.min(row0, L - self.R2), 1, li, self.R2, self.LPR2,
                               self.NCH2)  # fmt: skip
                if tid == 0:
                    d = cute.arch.load(mDone.iterator + e, Int32, sem="acquire", scope="gpu")
                    while d < self.NRB13:
                        d = cute.arch.load(mDone.iterator + e, Int32, sem="acquire", scope="gpu")
                cute.arch.barrier()
                cute.arch.fence_acq_rel_gpu()
                p0 = Int32(0)
                while p0 < n:
                    rem = n - p0
                    if rem == 1:
                        self._w2_chunk(
                            ws, gHv, sHv, sPairs, sTw, mAcc, acc2, start, n, p0, row0, li, 1
                        )
                    elif rem == 2:
                        self._w2_chunk(
                            ws, gHv, sHv, sPairs, sTw, mAcc, acc2, start, n, p0, row0, li, 2
                        )
                    else:
                        self._w2_chunk(
                            ws, gHv, sHv, sPairs, sTw, mAcc, acc2, start, n, p0, row0, li, TT
                        )
                    p0 = p0 + cutlass.min(rem, TT)
            tile = tile + self.num_ctas

    @cute.jit
    def _routing(self, mY, mBias, mIds, mTw, sIds, sTw, sPairs, sCnt, sActE, sActOff, sActN,
                 sNact, sZ):  # fmt: skip
        """Prologue, every CTA: top-k of each token, per-expert counts, the selected experts
        compacted in expert order (``sActE/sActOff/sActN``, ``sNact``), each expert's (token, k)
        pairs (``sPairs``); with ``prestage``, all tokens' latent z as BF16 in ``sZ``."""
        T, E, K, L = self.T, self.E, self.K, self.L
        NT = self.NW * 32
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        for e in cutlass.range(tid, E, NT):
            sCnt[e] = Int32(0)
        cute.arch.barrier()
        for t in cutlass.range(warp, T, self.NW):
            select_topk(mY, mBias, t, lane, sIds, sTw, sCnt, E, K, self.scaling)
        cute.arch.barrier()
        if bid == 0:
            for p in cutlass.range(tid, T * K, NT):
                mIds[p] = sIds[p]
                mTw[p] = sTw[p]
        if warp == 0:
            EPL = E // 32
            csum = Int32(0)
            asum = Int32(0)
            for i in cutlass.range_constexpr(EPL):
                c = sCnt[lane * EPL + i]
                csum = csum + c
                asum = asum + cutlass.select_(c > 0, Int32(1), Int32(0))
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
                c = sCnt[e]
                if c > 0:
                    sActE[a] = e
                    sActOff[a] = off
                    sActN[a] = c
                    a = a + 1
                sCnt[e] = off
                off = off + c
            if lane == 31:
                sNact[0] = cas
        cute.arch.barrier()
        for p in cutlass.range(tid, T * K, NT):
            pos = cute.arch.atomic_add(sCnt.iterator + sIds[p], Int32(1))
            sPairs[pos] = p
        if const_expr(self.prestage):
            gYz = cute.zipped_divide(mY, (1, VEC))
            sZz = cute.zipped_divide(sZ, (1, VEC))
            KVL = L // VEC
            for i in cutlass.range(tid, T * KVL, NT, unroll=4):
                t = i // KVL
                c = i % KVL
                sZz[(0, None), (t, c)].store(gYz[(0, None), (t, E // VEC + c)].load().to(BFloat16))
        cute.arch.barrier()

    @cute.jit
    def _expert(
        self, mW: cute.Tensor, e, rows: cutlass.Constexpr[int], cols: cutlass.Constexpr[int]
    ):
        """Expert ``e``'s [rows, cols] matrix of a stacked [E, rows, cols] weight, addressed with
        a 64-bit offset: at TP8 ``w13`` spans 2.47e9 elements, past what 32-bit index math holds
        (``mW[e, None, None]`` computed the offset in 32 bits and read the wrong memory for
        experts >= 780 on the H200, 2026-11-30)."""
        off = cute.assume(Int64(e) * (rows * cols), divby=VEC)
        ptr = (mW.iterator + off).align(16)
        return cute.make_tensor(ptr, cute.make_ordered_layout((rows, cols), order=(1, 0)))

    @cute.jit
    def _prefetch_span(self, base, nbytes):
        """``prefetch.L2`` over ``nbytes`` from the BF16 pointer ``base`` (128-byte lines)."""
        tid, _, _ = cute.arch.thread_idx()
        for i in cutlass.range(tid, nbytes // 128, self.NW * 32):
            cute.arch.prefetch((base + i * 64).llvm_ptr, cache_level="L2")

    @cute.jit
    def _prefetch_tile(self, mW13, mW2, mWs2, sActE, nsh, n13, total, tile):
        """Prefetch the weight rows tile ``tile`` will read (nothing past the last tile)."""
        L, Ie, S = self.L, self.Ie, self.S
        if tile < total:
            if tile < nsh:
                r0 = tile * self.rowss
                nb = (cutlass.min(r0 + self.rowss, self.H) - r0) * S * 2
                self._prefetch_span(mWs2.iterator + r0 * S, nb)
            elif tile < n13:
                t1 = tile - nsh
                e = sActE[t1 // self.NRB13]
                r0 = (t1 % self.NRB13) * self.rows13
                nb = (cutlass.min(r0 + self.rows13, Ie) - r0) * L * 2
                base = mW13.iterator + Int64(e) * (2 * Ie * L) + r0 * L
                self._prefetch_span(base, nb)
                self._prefetch_span(base + Ie * L, nb)
            else:
                t2 = tile - n13
                e = sActE[t2 // self.NRB2]
                r0 = (t2 % self.NRB2) * self.rows2
                nb = (cutlass.min(r0 + self.rows2, L) - r0) * Ie * 2
                self._prefetch_span(mW2.iterator + Int64(e) * (L * Ie) + r0 * Ie, nb)

    @cute.jit
    def _shared_tile(self, ws, gYv, sAv, mShared, accs, t0, row0, li, nt: cutlass.Constexpr[int]):
        """Tokens t0 .. t0+nt: stage SiTU(shared gate, up) as BF16, shared_w2 rows, FP32 store."""
        E, L, S = self.E, self.L, self.S
        NT = self.NW * 32
        KV = S // VEC
        tid, _, _ = cute.arch.thread_idx()
        for i in cutlass.range(tid, nt * KV, NT, unroll=2):
            ts = i // KV
            c = i % KV
            g = gYv[(0, None), (t0 + ts, (E + L) // VEC + c)].load()
            u = gYv[(0, None), (t0 + ts, (E + L + S) // VEC + c)].load()
            r = cute.make_rmem_tensor((VEC,), Float32)
            for q in cutlass.range_constexpr(VEC):
                r[q] = situ(g[q], u[q], self.beta, self.lbeta)
            sAv[(0, None), (ts, c)].store(r.load().to(BFloat16))
        cute.arch.barrier()
        dot_rows(ws, sAv, accs, li, self.Rs, nt, self.LPRs, self.NCHs)
        if li == 0:
            for r in cutlass.range_constexpr(self.Rs):
                if row0 + r < self.H:
                    for t in cutlass.range_constexpr(nt):
                        mShared[t0 + t, row0 + r] = accs[r, t]
        cute.arch.barrier()

    @cute.jit
    def _w13_chunk(
        self, ws, gYv, sZv, sPairs, mH, acc13, start, n, p0, row, li, TTc: cutlass.Constexpr[int]
    ):
        """Pairs p0 .. p0+TTc of one expert: stage their latent z (BF16), gate + up rows, SiTU,
        write ``h``. Slots past ``n`` are zero and never stored."""
        if const_expr(self.prestage):
            # all tokens' z are in shared memory already: read them by token (slots past n
            # repeat the last pair and are never stored)
            toks = [sPairs[start + cutlass.min(p0 + t, n - 1)] // self.K for t in range(TTc)]
            dot_rows_idx(ws, sZv, toks, acc13, li, 2, TTc, self.LPR13, self.NCH13)
        else:
            NT = self.NW * 32
            KV = self.L // VEC
            tid, _, _ = cute.arch.thread_idx()
            for i in cutlass.range(tid, TTc * KV, NT, unroll=2):
                ts = i // KV
                c = i % KV
                slot = cutlass.min(p0 + ts, n - 1)
                tok = sPairs[start + slot] // self.K
                v = gYv[(0, None), (tok, self.E // VEC + c)].load()
                if p0 + ts >= n:
                    v = cute.zeros_like(v)
                sZv[(0, None), (ts, c)].store(v.to(BFloat16))
            cute.arch.barrier()
            dot_rows(ws, sZv, acc13, li, 2, TTc, self.LPR13, self.NCH13)
        if li == 0:  # noqa: SIM102 (dynamic conditions: nested ifs)
            if row < self.Ie:
                for t in cutlass.range_constexpr(TTc):
                    if p0 + t < n:
                        p = sPairs[start + p0 + t]
                        mH[p, row] = situ(acc13[0, t], acc13[1, t], self.beta, self.lbeta).to(
                            BFloat16
                        )
        cute.arch.barrier()

    @cute.jit
    def _w2_chunk(
        self,
        ws,
        gHv,
        sHv,
        sPairs,
        sTw,
        mAcc,
        acc2,
        start,
        n,
        p0,
        row0,
        li,
        TTc: cutlass.Constexpr[int],
    ):
        """Pairs p0 .. p0+TTc of one expert: stage their ``h`` rows, w2 rows, and add
        ``weight * y`` into the routed latent sum (FP32 atomics)."""
        self._w2p_chunk(ws, gHv, sHv, sPairs, sTw, mAcc, acc2, start, n, p0, row0, li, True,
                        TTc)  # fmt: skip

    @cute.jit
    def _w2p_chunk(
        self, ws, gHv, sHv, sPairs, sTw, mAcc, acc2, start, n, p0, row0, li, sth,
        TTc: cutlass.Constexpr[int],
    ):  # fmt: skip
        """:meth:`_w2_chunk`, staging the pairs' ``h`` rows only when ``sth`` (a Python
        ``True`` there: the staging is traced unconditionally)."""
        NT = self.NW * 32
        KV = self.Ie // VEC
        tid, _, _ = cute.arch.thread_idx()
        if sth:
            for i in cutlass.range(tid, TTc * KV, NT, unroll=2):
                ts = i // KV
                c = i % KV
                slot = cutlass.min(p0 + ts, n - 1)
                v = gHv[(0, None), (sPairs[start + slot], c)].load()
                if p0 + ts >= n:
                    v = cute.zeros_like(v)
                sHv[(0, None), (ts, c)].store(v)
            cute.arch.barrier()
        dot_rows(ws, sHv, acc2, li, self.R2, TTc, self.LPR2, self.NCH2)
        if li == 0:
            for t in cutlass.range_constexpr(TTc):
                if p0 + t < n:
                    p = sPairs[start + p0 + t]
                    wt = sTw[p]
                    base = (p // self.K) * self.L
                    for r in cutlass.range_constexpr(self.R2):
                        if row0 + r < self.L:
                            cute.arch.atomic_add(mAcc.iterator + (base + row0 + r),
                                                 wt * acc2[r, t])  # fmt: skip
        cute.arch.barrier()


def grouped_index(t, N, nc, mn=min):
    """Tile ``t`` of a phase of ``N`` tiles on ``nc`` CTAs -> the (expert, row block) index it
    works on: a CTA's tiles (``t``, ``t + nc``, ...) get one contiguous run of indices, so its
    consecutive tiles mostly share an expert and the z or h rows it staged. A bijection on
    [0, N); the phases keep their order (w13 before w2), so the w2 wait stays deadlock-free.
    Plain Python (``mn=min``) for the tests, traced in the kernel with ``cutlass.min``."""
    b = t % nc
    return b * (N // nc) + mn(b, N % nc) + t // nc


# H100/H200 opt-in shared memory per CTA (227 KB), less 4 KB for the static 1 KB and padding
SMEM_BUDGET = 232448 - 4096


class MoeExpertsPipe(MoeExperts):
    """The same function as :class:`MoeExperts` (same prologue, tile kinds and numbering,
    ``done`` protocol, FP32 atomics), with the weights streamed into shared memory ahead of the
    math.

    Every tile's weights are one stage of a ring of ``NS`` (2-4) shared-memory slots: thread 0
    issues ``cp.async.bulk`` global -> shared copies (one per contiguous row block: gate rows
    and up rows for a w13 tile, one block for a w2 or shared tile) that complete on the slot's
    mbarrier (``complete_tx``), ``NS`` tiles ahead of the tile the CTA works on. All warps wait
    on the slot's mbarrier (phase parity = use count of the slot mod 2), read the weights from
    shared memory, and after the tile's closing CTA barrier thread 0 refills the slot with the
    CTA's tile ``NS`` further on. So ``NS - 1`` to ``NS`` tiles (about 100-190 KB per SM at the
    kimi-k3 shapes) are in flight from HBM while the math runs, instead of one tile's loads
    then its math (the old kernel: one latency chain per tile). Shared-expert tiles (weights
    only) are issued before the routing prologue and before the PDL wait.

    Tile sizes: w2 and shared tiles as in :class:`MoeExperts` (48 KB at kimi-k3 TP8/TP16); a
    w13 tile is ``P13`` (gate, up) row pairs sized to the same slot (3 pairs = 42 KB at
    L = 3584), each pair on ``TPP`` threads (64 at L = 3584: two warps, partial sums added
    through shared memory).

    Tile order inside each phase (shared, w13, w2) is grouped (:func:`grouped_index`): a CTA
    works on consecutive row blocks of one expert, so the z (T > 8) or h rows it staged for a
    one-chunk expert are reused by its next tiles, and a run of finished w13 tiles is published
    with one GPU-scope release (``done[e] += run``) instead of one per tile.

    Deadlock freedom as in :class:`MoeExperts` (one CTA per SM: ~200 KB of shared memory per
    CTA; every w13 tile of a CTA comes before its w2 tiles and its last release; the copies
    never wait on other CTAs)."""

    def __init__(self, *args, stages: int = 0, **kw):
        super().__init__(*args, **kw)
        T, L, Ie, S, K, E = self.T, self.L, self.Ie, self.S, self.K, self.E
        NT = self.NW * 32
        ch = L // VEC
        tpp = 64
        while ch % tpp:
            tpp //= 2
        self.TPP, self.WPP, self.RED13 = tpp, max(1, tpp // 32), min(tpp, 32)
        self.NCHp = ch // tpp
        b2 = self.rows2 * Ie * 2
        bs = self.rowss * S * 2
        self.P13 = max(1, min(NT // tpp, max(b2, bs) // (4 * L)))
        self.NRB13 = -(-Ie // self.P13)
        b13 = 4 * self.P13 * L
        self.SLOT = max(b13, b2, bs) // 2  # BF16 elements per slot
        ZT = T if self.prestage else self.TT
        self.NA = min(E, T * K)  # most experts one step can select
        other = (
            3 * T * K * 4
            + E * 4
            + 3 * self.NA * 4
            + 16
            + ZT * L * 2
            + self.TTs * S * 2
            + self.TT * Ie * 2
            + self.NW * 2 * self.TT * 4
            + 8 * 16  # alignment padding of the allocations
        )
        fit = (SMEM_BUDGET - other) // (self.SLOT * 2 + 8)
        self.NS = stages or min(4, fit)
        if not 2 <= self.NS <= fit:
            raise ValueError(
                f"moe_experts pipe: {self.NS} stages of {self.SLOT * 2} B do not fit beside "
                f"{other} B of other shared memory (T={T}, L={L}, Ie={Ie})"
            )

    def smem_bytes(self) -> int:
        ZT = self.T if self.prestage else self.TT
        return (3 * self.T * self.K * 4 + self.E * 4 + 3 * self.NA * 4 + 16 + ZT * self.L * 2
                + self.TTs * self.S * 2 + self.TT * self.Ie * 2 + self.NW * 2 * self.TT * 4
                + self.NS * (self.SLOT * 2 + 8))  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        mY: cute.Tensor,
        mBias: cute.Tensor,
        mW13: cute.Tensor,
        mW2: cute.Tensor,
        mWs2: cute.Tensor,
        mH: cute.Tensor,
        mAcc: cute.Tensor,
        mShared: cute.Tensor,
        mDone: cute.Tensor,
        mIds: cute.Tensor,
        mTw: cute.Tensor,
    ):
        T, E, K, L, Ie, S = self.T, self.E, self.K, self.L, self.Ie, self.S
        TT, NS, SLOT, nc = self.TT, self.NS, self.SLOT, self.num_ctas
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()

        smem = cutlass.memory.SmemAllocator()
        sRing = smem.allocate_tensor(BFloat16, cute.make_layout(NS * SLOT), byte_alignment=128)
        sBar = smem.allocate_tensor(Int64, cute.make_layout(NS), byte_alignment=8)
        sIds = smem.allocate_tensor(Int32, cute.make_layout(T * K), byte_alignment=16)
        sTw = smem.allocate_tensor(Float32, cute.make_layout(T * K), byte_alignment=16)
        sPairs = smem.allocate_tensor(Int32, cute.make_layout(T * K), byte_alignment=16)
        sCnt = smem.allocate_tensor(Int32, cute.make_layout(E), byte_alignment=16)
        sActE = smem.allocate_tensor(Int32, cute.make_layout(self.NA), byte_alignment=16)
        sActOff = smem.allocate_tensor(Int32, cute.make_layout(self.NA), byte_alignment=16)
        sActN = smem.allocate_tensor(Int32, cute.make_layout(self.NA), byte_alignment=16)
        sNact = smem.allocate_tensor(Int32, cute.make_layout(4), byte_alignment=16)
        sRed = smem.allocate_tensor(Float32, cute.make_layout(self.NW * 2 * TT), byte_alignment=16)
        ZT = T if const_expr(self.prestage) else TT
        sZ = smem.allocate_tensor(
            BFloat16, cute.make_ordered_layout((ZT, L), order=(1, 0)), byte_alignment=16
        )
        sA = smem.allocate_tensor(
            BFloat16, cute.make_ordered_layout((self.TTs, S), order=(1, 0)), byte_alignment=16
        )
        sHx = smem.allocate_tensor(
            BFloat16, cute.make_ordered_layout((TT, Ie), order=(1, 0)), byte_alignment=16
        )

        if tid == 0:
            for s in cutlass.range_constexpr(NS):
                cute.arch.mbarrier_init(sBar.iterator + s, 1)
            cute.arch.mbarrier_init_fence()
        cute.arch.barrier()
        nsh = self.NSB  # tiles [0, nsh): shared down; [nsh, n13): w13; [n13, total): w2
        if tid == 0:
            # shared-expert tiles need no routing and no front output: stream them now
            for k in cutlass.range_constexpr(NS):
                if bid + k * nc < nsh:
                    self._issue(mW13, mW2, mWs2, sActE, sRing, sBar, nsh, nsh, nsh, bid + k * nc,
                                k)  # fmt: skip
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
        self._routing(mY, mBias, mIds, mTw, sIds, sTw, sPairs, sCnt, sActE, sActOff, sActN,
                      sNact, sZ)  # fmt: skip

        nact = sNact[0]
        n13 = nsh + nact * self.NRB13
        total = n13 + nact * self.NRB2
        if tid == 0:
            for k in cutlass.range_constexpr(NS):
                tk = bid + k * nc
                if tk >= nsh and tk < total:
                    self._issue(mW13, mW2, mWs2, sActE, sRing, sBar, nsh, n13, total, tk, k)

        gYv = cute.zipped_divide(mY, (1, VEC))
        sZv = cute.zipped_divide(sZ, (1, VEC))
        sAv = cute.zipped_divide(sA, (1, VEC))
        sHv = cute.zipped_divide(sHx, (1, VEC))
        gHv = cute.zipped_divide(mH, (1, VEC))
        acc13 = cute.make_rmem_tensor((2, TT), Float32)
        accs = cute.make_rmem_tensor((self.Rs, self.TTs), Float32)
        acc2 = cute.make_rmem_tensor((self.R2, TT), Float32)

        tile = bid
        kk = Int32(0)
        zk = Int32(-1)  # expert whose (one-chunk) z is staged in sZ
        run = Int32(0)  # w13 tiles of the current expert finished by this CTA, not yet published
        hk = Int32(-1)  # expert whose (one-chunk) h rows are staged in sHx
        we = Int32(-1)  # expert whose done counter this CTA last saw complete
        while tile < total:
            slot = kk % NS
            cute.arch.mbarrier_wait(sBar.iterator + slot, (kk // NS) % 2)
            base = sRing.iterator + slot * SLOT
            rel = Int32(-1)  # expert whose finished w13 tiles to publish after the closing barrier
            reln = Int32(0)
            if tile < nsh:
                # ---- shared experts: down GEMM over SiTU(gate, up) ----
                sWv = cute.zipped_divide(
                    cute.make_tensor(base, cute.make_ordered_layout((self.rowss, S), order=(1, 0))),
                    (1, VEC),
                )
                grp = lane // self.LPRs
                li = lane % self.LPRs
                r0l = (warp * self.Gs + grp) * self.Rs
                ws = load_rows(sWv, r0l, 1, li, self.Rs, self.LPRs, self.NCHs)
                row0 = tile * self.rowss + r0l
                TTs = self.TTs
                for t0 in cutlass.range(0, (T // TTs) * TTs, TTs, unroll=1):
                    self._shared_tile(ws, gYv, sAv, mShared, accs, t0, row0, li, TTs)
                if const_expr(T % TTs):
                    self._shared_tile(ws, gYv, sAv, mShared, accs, T - T % TTs, row0, li, T % TTs)
            elif tile < n13:
                # ---- w13 + SiTU: P13 (gate, up) row pairs, TPP threads per pair ----
                f = self._grouped(tile - nsh, n13 - nsh)
                a = f // self.NRB13
                r0 = (f % self.NRB13) * self.P13
                e = sActE[a]
                start = sActOff[a]
                n = sActN[a]
                sWv = cute.zipped_divide(
                    cute.make_tensor(
                        base, cute.make_ordered_layout((2 * self.P13, L), order=(1, 0))
                    ),
                    (1, VEC),
                )
                q = cutlass.min(tid // self.TPP, self.P13 - 1)
                j = tid % self.TPP
                ws = load_rows(sWv, q, self.P13, j, 2, self.TPP, self.NCHp)
                # z of a one-chunk expert staged by this CTA's previous tile is still in sZ
                stz = (n > TT) | (e != zk)
                p0 = Int32(0)
                while p0 < n:  # pairs in chunks of 1, 2 or up to TT: no FMAs on empty slots
                    rem = n - p0
                    if rem == 1:
                        self._w13p_chunk(ws, gYv, sZv, sPairs, sRed, mH, acc13, start, n, p0,
                                         r0, j, stz, 1)  # fmt: skip
                    elif rem == 2:
                        self._w13p_chunk(ws, gYv, sZv, sPairs, sRed, mH, acc13, start, n, p0,
                                         r0, j, stz, 2)  # fmt: skip
                    else:
                        self._w13p_chunk(ws, gYv, sZv, sPairs, sRed, mH, acc13, start, n, p0,
                                         r0, j, stz, TT)  # fmt: skip
                    p0 = p0 + cutlass.min(rem, TT)
                zk = cutlass.select_(n > TT, Int32(-1), e)
                # publish once per run of this CTA's tiles on one expert (the grouped order
                # makes them consecutive): one GPU-scope release per run, not one per tile
                run = run + 1
                tn = tile + nc
                if (tn >= n13) | (self._grouped(tn - nsh, n13 - nsh) // self.NRB13 != a):
                    rel = e
                    reln = run
                    run = Int32(0)
            else:
                # ---- w2 + routing-weighted sum ----
                f = self._grouped(tile - n13, total - n13)
                a = f // self.NRB2
                rb = f % self.NRB2
                e = sActE[a]
                start = sActOff[a]
                n = sActN[a]
                sWv = cute.zipped_divide(
                    cute.make_tensor(
                        base, cute.make_ordered_layout((self.rows2, Ie), order=(1, 0))
                    ),
                    (1, VEC),
                )
                grp = lane // self.LPR2
                li = lane % self.LPR2
                r0l = (warp * self.G2 + grp) * self.R2
                ws = load_rows(sWv, r0l, 1, li, self.R2, self.LPR2, self.NCH2)
                row0 = rb * self.rows2 + r0l
                if e != we:  # this CTA has not yet seen the expert's w13 tiles all done
                    if tid == 0:
                        d = cute.arch.load(mDone.iterator + e, Int32, sem="acquire", scope="gpu")
                        while d < self.NRB13:
                            d = cute.arch.load(
                                mDone.iterator + e, Int32, sem="acquire", scope="gpu"
                            )
                    cute.arch.barrier()
                    cute.arch.fence_acq_rel_gpu()
                we = e
                # h of a one-chunk expert staged by this CTA's previous tile is still in sHx
                sth = (n > TT) | (e != hk)
                p0 = Int32(0)
                while p0 < n:
                    rem = n - p0
                    if rem == 1:
                        self._w2p_chunk(ws, gHv, sHv, sPairs, sTw, mAcc, acc2, start, n, p0,
                                        row0, li, sth, 1)  # fmt: skip
                    elif rem == 2:
                        self._w2p_chunk(ws, gHv, sHv, sPairs, sTw, mAcc, acc2, start, n, p0,
                                        row0, li, sth, 2)  # fmt: skip
                    else:
                        self._w2p_chunk(ws, gHv, sHv, sPairs, sTw, mAcc, acc2, start, n, p0,
                                        row0, li, sth, TT)  # fmt: skip
                    p0 = p0 + cutlass.min(rem, TT)
                hk = cutlass.select_(n > TT, Int32(-1), e)
            # every thread is past its reads of this slot (and its h stores): refill the slot
            # with the tile NS ahead, then publish a finished run of w13 tiles (thread 0's
            # cumulative GPU-scope release after the barrier), off the other warps' path
            cute.arch.barrier()
            if tid == 0:
                nxt = tile + NS * nc
                if nxt < total:
                    self._issue(mW13, mW2, mWs2, sActE, sRing, sBar, nsh, n13, total, nxt,
                                slot)  # fmt: skip
                if rel >= 0:
                    cute.arch.fence_acq_rel_gpu()
                    cute.arch.atomic_add(mDone.iterator + rel, reln, sem="release",
                                         scope="gpu")  # fmt: skip
            tile = tile + nc
            kk = kk + 1

    @cute.jit
    def _grouped(self, t, N):
        return grouped_index(t, N, self.num_ctas, cutlass.min)

    @cute.jit
    def _copy(self, dst, src, bar, nbytes):
        prims.cp_async_bulk_shared_cluster_global(dst, src.align(16), bar, nbytes)

    @cute.jit
    def _issue(self, mW13, mW2, mWs2, sActE, sRing, sBar, nsh, n13, total, tile, slot):
        """Thread 0: arm slot ``slot``'s mbarrier with the tile's bytes and issue its bulk copies
        (weights only: never waits on anything)."""
        L, Ie, S, H = self.L, self.Ie, self.S, self.H
        dst = sRing.iterator + slot * self.SLOT
        bar = sBar.iterator + slot
        if tile < nsh:
            r0 = tile * self.rowss
            nb = (cutlass.min(r0 + self.rowss, H) - r0) * (S * 2)
            cute.arch.mbarrier_arrive_and_expect_tx(bar, nb)
            self._copy(dst, mWs2.iterator + Int64(r0) * S, bar, nb)
        elif tile < n13:
            f = self._grouped(tile - nsh, n13 - nsh)
            e = sActE[f // self.NRB13]
            r0 = (f % self.NRB13) * self.P13
            nb = (cutlass.min(r0 + self.P13, Ie) - r0) * (L * 2)
            src = mW13.iterator + (Int64(e) * (2 * Ie * L) + Int64(r0) * L)
            cute.arch.mbarrier_arrive_and_expect_tx(bar, 2 * nb)
            self._copy(dst, src, bar, nb)
            self._copy(dst + self.P13 * L, src + Ie * L, bar, nb)
        else:
            f = self._grouped(tile - n13, total - n13)
            e = sActE[f // self.NRB2]
            r0 = (f % self.NRB2) * self.rows2
            nb = (cutlass.min(r0 + self.rows2, L) - r0) * (Ie * 2)
            src = mW2.iterator + (Int64(e) * (L * Ie) + Int64(r0) * Ie)
            cute.arch.mbarrier_arrive_and_expect_tx(bar, nb)
            self._copy(dst, src, bar, nb)

    @cute.jit
    def _w13p_chunk(
        self, ws, gYv, sZv, sPairs, sRed, mH, acc13, start, n, p0, r0, j, stz,
        TTc: cutlass.Constexpr[int],
    ):  # fmt: skip
        """Pairs p0 .. p0+TTc of one expert against this thread's slice of its gate/up pair
        ``tid // TPP`` (weights ``ws`` from the slot); SiTU, ``h`` stores."""
        TPP, P13, TT = self.TPP, self.P13, self.TT
        tid, _, _ = cute.arch.thread_idx()
        warp = cute.arch.warp_idx()
        lane = cute.arch.lane_idx()
        if const_expr(self.prestage):
            toks = [sPairs[start + cutlass.min(p0 + t, n - 1)] // self.K for t in range(TTc)]
        else:
            if stz:
                NT = self.NW * 32
                KV = self.L // VEC
                for i in cutlass.range(tid, TTc * KV, NT, unroll=2):
                    ts = i // KV
                    c = i % KV
                    slot = cutlass.min(p0 + ts, n - 1)
                    tok = sPairs[start + slot] // self.K
                    v = gYv[(0, None), (tok, self.E // VEC + c)].load()
                    if p0 + ts >= n:
                        v = cute.zeros_like(v)
                    sZv[(0, None), (ts, c)].store(v.to(BFloat16))
                cute.arch.barrier()
            toks = list(range(TTc))
        # whole warps past the tile's pairs (2 of 8 at L = 3584) skip the math (warp-uniform:
        # the reduction shuffles need every lane of a warp)
        busy = tid < -(-P13 * TPP // 32) * 32
        if busy:
            dot_rows_grp(ws, sZv, toks, acc13, j, 2, TTc, TPP, self.NCHp, self.RED13)
        q = tid // TPP
        if const_expr(self.WPP == 1):
            if j == 0 and q < P13 and r0 + q < self.Ie:
                for t in cutlass.range_constexpr(TTc):
                    if p0 + t < n:
                        p = sPairs[start + p0 + t]
                        mH[p, r0 + q] = situ(acc13[0, t], acc13[1, t], self.beta, self.lbeta).to(
                            BFloat16
                        )
        else:
            # TPP spans WPP warps: each warp's lane 0 leaves its partial sums, then one thread
            # per (pair, token) adds them, applies SiTU and stores
            if busy & (lane == 0):
                for t in cutlass.range_constexpr(TTc):
                    sRed[(warp * 2) * TT + t] = acc13[0, t]
                    sRed[(warp * 2 + 1) * TT + t] = acc13[1, t]
            cute.arch.barrier()
            if tid < P13 * TTc:
                qq = tid // TTc
                t = tid % TTc
                g = Float32(0.0)
                u = Float32(0.0)
                for w in cutlass.range_constexpr(self.WPP):
                    g = g + sRed[((qq * self.WPP + w) * 2) * TT + t]
                    u = u + sRed[((qq * self.WPP + w) * 2 + 1) * TT + t]
                if r0 + qq < self.Ie and p0 + t < n:
                    p = sPairs[start + p0 + t]
                    mH[p, r0 + qq] = situ(g, u, self.beta, self.lbeta).to(BFloat16)
        cute.arch.barrier()


# -- torch-facing --------------------------------------------------------------------------


def kernel_variant() -> tuple[str, int]:
    """Which expert kernel runs: ``DECODESCOPE_MOE_EXPERTS=pipe`` (weights streamed into shared
    memory by bulk copies, :class:`MoeExpertsPipe`), ``old`` (:class:`MoeExperts`, weights
    loaded into registers per tile) or ``auto`` (default, :func:`resolve_variant`: the pipe
    below 8 tokens, the old kernel from 8 on, as measured on the H200 at 15:15);
    ``DECODESCOPE_MOE_STAGES`` (0 = as many as fit, at most 4) sets the pipe's ring depth. Read
    at each call, part of the compile key."""
    v = os.environ.get("DECODESCOPE_MOE_EXPERTS", "auto")
    if v not in ("auto", "pipe", "old"):
        raise ValueError(f"DECODESCOPE_MOE_EXPERTS={v!r}: expected 'auto', 'pipe' or 'old'")
    st = os.environ.get("DECODESCOPE_MOE_STAGES", "0")
    if not st.isdigit():
        raise ValueError(f"DECODESCOPE_MOE_STAGES={st!r}: expected an integer")
    return v, int(st)


# H200, 2026-11-30 15:15 (notes/gpu-logs/s4/moe_ab_tp8.log.xz), TP8 expert kernel old vs pipe:
# 74.7 vs 63.4 us at 1 token, 397.1 vs 407.4 at 8, 1148.4 vs 1557.8 at 32, 1879.4 vs 2902.7 at 64
PIPE_BELOW = 8


def resolve_variant(v, T, E, K, L, Ie, H, S, stages=0) -> str:
    """``auto`` -> ``pipe`` below ``PIPE_BELOW`` tokens where :class:`MoeExpertsPipe` fits these
    shapes, else ``old``."""
    if v != "auto":
        return v
    if T >= PIPE_BELOW:
        return "old"
    try:
        MoeExpertsPipe(T, E, K, L, Ie, H, S, 1.0, 1.0, 1.0, 132, stages=stages)
    except ValueError:
        return "old"
    return "pipe"


def _build(T, E, K, L, Ie, H, S, scaling, beta, lbeta, num_ctas, pdl=True, variant="pipe",
           stages=0):  # fmt: skip
    if variant == "pipe":
        op = MoeExpertsPipe(T, E, K, L, Ie, H, S, scaling, beta, lbeta, num_ctas, pdl=pdl,
                            stages=stages)  # fmt: skip
    else:
        op = MoeExperts(T, E, K, L, Ie, H, S, scaling, beta, lbeta, num_ctas, pdl=pdl)
    NF = E + L + 2 * S
    args = (
        itf.fake(torch.float32, (T, NF)),
        itf.fake(torch.float32, (E,)),
        itf.fake(torch.bfloat16, (E, 2 * Ie, L)),
        itf.fake(torch.bfloat16, (E, L, Ie)),
        itf.fake(torch.bfloat16, (H, S)),
        itf.fake(torch.bfloat16, (T * K, Ie)),
        itf.fake(torch.float32, (T * L,)),
        itf.fake(torch.float32, (T, H)),
        itf.fake(torch.int32, (E,)),
        itf.fake(torch.int32, (T * K,)),
        itf.fake(torch.float32, (T * K,)),
        itf.env_stream(),
    )
    return op, args


def num_sms(device: torch.device | None = None) -> int:
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(device or 0).multi_processor_count
    return 132  # H200


def moe_experts(
    y_front,
    router_bias,
    w13,
    w2,
    shared_w2,
    h,
    acc,
    shared_out,
    done,
    topk_ids,
    topk_w,
    *,
    top_k: int,
    scaling: float,
    beta: float,
    lbeta: float,
) -> None:
    """Launch :class:`MoeExperts` on the current stream (see the module docstring).

    ``acc`` [T, L] FP32 and ``done`` [E] int32 must be zero (the front kernel zeroes them);
    ``topk_ids`` / ``topk_w`` [T, k] receive the routing; ``h`` [T*k, Ie] BF16 is scratch."""
    E, twoI, L = w13.shape
    Ie = twoI // 2
    H, S = shared_w2.shape
    T = y_front.shape[0]
    itf.check(y_front, "y_front", (T, E + L + 2 * S), torch.float32)
    itf.check(router_bias, "router_bias", (E,), torch.float32)
    itf.check(w2, "w2", (E, L, Ie), torch.bfloat16)
    itf.check(h, "h", (T * top_k, Ie), torch.bfloat16)
    itf.check(shared_out, "shared_out", (T, H), torch.float32)
    nsm = num_sms(y_front.device)
    pdl = pdl_enabled()
    var, st = kernel_variant()
    var = resolve_variant(var, T, E, top_k, L, Ie, H, S, st)
    key = ("moe_experts", T, E, top_k, L, Ie, H, S, scaling, beta, lbeta, nsm, pdl, var, st)
    fn = itf.compiled(
        key, lambda: _build(T, E, top_k, L, Ie, H, S, scaling, beta, lbeta, nsm, pdl, var, st)
    )
    fn(
        y_front,
        router_bias,
        w13,
        w2,
        shared_w2,
        h,
        acc.view(-1),
        shared_out,
        done,
        topk_ids.view(-1),
        topk_w.view(-1),
    )


def moe_experts_ref(z, shared_gu, ids, tw, w13, w2, shared_w2, beta, lbeta):
    """Torch reference (FP32): routed latent sum ``acc [T, L]`` and ``shared_out [T, H]`` from
    the latent ``z [T, L]``, shared gate/up ``shared_gu [T, 2S]`` and the routing."""
    from decodescope.kernels.reference import situ_ref

    T, K = ids.shape
    zb = z.to(torch.bfloat16).float()
    acc = torch.zeros(T, z.shape[1], dtype=torch.float32, device=z.device)
    Ie = w13.shape[1] // 2
    for t in range(T):
        for k in range(K):
            e = int(ids[t, k])
            gu = w13[e].float() @ zb[t]
            hh = situ_ref(gu[:Ie], gu[Ie:], beta, lbeta).to(torch.bfloat16).float()
            acc[t] += float(tw[t, k]) * (w2[e].float() @ hh)
    S = shared_gu.shape[1] // 2
    a = situ_ref(shared_gu[:, :S], shared_gu[:, S:], beta, lbeta).to(torch.bfloat16).float()
    return acc, a @ shared_w2.float().T
