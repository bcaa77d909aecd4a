"""KDA decode with each head's value columns split over a thread-block cluster: the same
function as :class:`.kda_decode.KDADecode` (conv update + SiLU + decay gate with f_b fused +
beta + L2 norms + FP32 delta-rule recurrence in place + sigmoid-gated RMSNorm), for few
sequences.

Why (issue #5, batch 1; H200 ncu s13/r1, TP8 KDA layer, flushed caches): the one-CTA-per-head
kernel runs 12 CTAs at TP8 batch 1 (6 at TP16), 8.4 us for 1.3 MB, issue-bound on 12 SMs (8.9
cycles per instruction, LSU throttle on the state's 64 scalar loads per thread). The columns of
a head's state ``S [k, v]`` are independent given ``q``, ``k``, the decay and ``beta``: here
``vsplit`` CTAs share a head, each owning ``hd / vsplit`` value columns (``hd / vsplit`` x
``hd`` of the FP32 state in registers), so ``heads x vsplit`` CTAs stream the state.

Each CTA recomputes what the columns share (cheap next to the state): the short conv + SiLU and
the L2 norms of all ``hd`` q and k channels (one channel per thread: ``2 hd`` = 256 threads),
the ``hd`` decay gates (two lanes per row of ``f_b``, L2-resident after the first CTA), ``beta``.
The one quantity over all columns, the output RMSNorm's sum of squares, is exchanged through
distributed shared memory: each CTA leaves its partial in its own shared memory (two slots, by
token parity), a cluster barrier (release / acquire) publishes them, every thread adds the
``vsplit`` partials in rank order (the same sum in every CTA). A last cluster barrier keeps a
CTA resident until its peers have read its partial.

Within a CTA, thread ``t`` owns column ``r * CW + t // LPC`` (``CW = hd / vsplit`` columns of
CTA rank ``r``, ``LPC = 256 / CW`` lanes per column, consecutive) and rows ``ii * LPC + t %
LPC``: the per-column sums ``k^T S`` and ``q^T S`` are butterflies over ``LPC`` lanes. Writes:
the state columns by their owners, the output and the v conv history by each column's first
lane, the q / k conv history of channel ``c`` by the CTA with ``c // CW == r``.

Rounding: FP32 throughout, as the one-CTA kernel; the column sums and the norm's partials add
in a different order (results equal within FP32 rounding, not bit for bit).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32

from decodescope.kernels.specialized.kda_decode import ProjStage
from decodescope.kernels.specialized.mla_decode_tc import ld_cluster_f32, mapa
from decodescope.kernels.specialized.utils import (
    load_vec8,
    pdl_begin,
    sigmoid,
    warp_sum,
)

THREADS = 256
VSPLITS = (2, 4, 8)  # portable cluster sizes that divide head_dim 128 into >= 16 columns


class KDADecodeSplit(ProjStage):
    """``vsplit`` CTAs (one cluster) per (head, sequence); see the module docstring."""

    def __init__(self, plan):
        self.p = plan
        hd, vs = plan.head_dim, plan.vsplit
        if vs not in VSPLITS:
            raise ValueError(f"kda_decode_split: vsplit={vs}, expected one of {VSPLITS}")
        if 2 * hd != THREADS:
            raise ValueError(
                f"kda_decode_split: head_dim {hd}: the split kernel takes head_dim "
                f"{THREADS // 2} (one q or k channel per thread)"
            )
        self.vs = vs
        self.cw = hd // vs  # value columns per CTA
        self.lpc = THREADS // self.cw  # lanes per column (consecutive)
        self.rpt = hd // self.lpc  # state rows per thread
        self.lpc_log2 = self.lpc.bit_length() - 1  # butterfly steps of a column sum
        if self.lpc > 32:
            raise ValueError(f"kda_decode_split: {self.lpc} lanes per column exceed a warp")
        self.warps = THREADS // 32
        # the batched chain (``DECODESCOPE_KDA_CHAIN=batched``, :meth:`tokens_batched`):
        # per-token scratch rows and reduction slots for all tokens
        self.batched = plan.chain == "batched"
        self.nt = plan.tokens if self.batched else 1
        self.nred = 2 * plan.tokens * self.warps if self.batched else 16
        self.nosq = plan.tokens if self.batched else 2
        # the batched chain's projection staged (:class:`.kda_decode.ProjStage`,
        # ``DECODESCOPE_KDA_SPLIT_STAGE``): ``fa`` holds it, BF16
        self.threads = THREADS
        self.staged = self.batched and plan.split_stage
        self.stage_len = plan.tokens * 5 * hd + 16

    @cute.jit
    def __call__(
        self,
        mProj: cute.Tensor,  # [B*T, P] bf16
        mConvW: cute.Tensor,  # [3D, KC] bf16
        mConv: cute.Tensor,  # [B, 3D, KC-1] bf16, in place
        mFb: cute.Tensor,  # [D, hd] bf16
        mALog: cute.Tensor,  # [heads] f32
        mDt: cute.Tensor,  # [D] f32
        mONorm: cute.Tensor,  # [hd] bf16
        mS: cute.Tensor,  # [B, heads, hd, hd] f32, in place
        mOut: cute.Tensor,  # [B*T, D] bf16
        stream: cuda.CUstream,
    ):
        p = self.p
        hd, vs, nt = p.head_dim, self.vs, self.nt
        fa_t, fa_n = (BFloat16, self.stage_len) if self.staged else (Float32, nt * hd)

        @cute.struct
        class Smem:
            fa: cute.struct.Align[cute.struct.MemRange[fa_t, fa_n], 16]
            decay: cute.struct.MemRange[Float32, nt * hd]
            q: cute.struct.MemRange[Float32, nt * hd]
            k: cute.struct.MemRange[Float32, nt * hd]
            red: cute.struct.MemRange[Float32, self.nred]
            # this CTA's partial of the output norm: by token parity (per token), per token
            osq: cute.struct.MemRange[Float32, self.nosq]

        self.smem_cls = Smem
        self.kernel(mProj, mConvW, mConv, mFb, mALog, mDt, mONorm, mS, mOut).launch(
            grid=[p.heads * vs, p.batch, 1],
            block=[THREADS, 1, 1],
            cluster=[vs, 1, 1],
            smem=Smem.size_in_bytes(),
            stream=stream,
            use_pdl=p.pdl,
        )

    @cute.kernel
    def kernel(self, mProj, mConvW, mConv, mFb, mALog, mDt, mONorm, mS, mOut):
        p = self.p
        hd, D, KC, T = p.head_dim, p.dim, p.conv_kernel, p.tokens
        VS, CW, LPC, RPT, NW = self.vs, self.cw, self.lpc, self.rpt, self.warps
        tidx, _, _ = cute.arch.thread_idx()
        bx, b, _ = cute.arch.block_idx()
        h = bx // VS
        r = bx % VS  # rank in the cluster (clusters tile the grid's x in runs of VS)
        warp = tidx // 32
        lane = tidx % 32
        jl = tidx // LPC
        rp = tidx % LPC
        j = r * CW + jl  # this thread's value column in the head
        col = h * hd + j
        lead = rp == 0  # the lane that writes per-column results
        which = tidx // hd  # 0: a q channel, 1: a k channel
        ch = tidx % hd
        qkc = which * D + h * hd + ch  # its conv channel
        i_d = tidx // 2  # the decay row this thread helps compute
        half = tidx % 2

        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(self.smem_cls)
        lay = cute.make_layout(hd)
        if cutlass.const_expr(self.batched):
            lay = cute.make_layout((T, hd), stride=(hd, 1))
        sFa = st.fa.get_tensor(cute.make_layout(self.stage_len) if self.staged else lay)
        sDecay = st.decay.get_tensor(lay)
        sQ = st.q.get_tensor(lay)
        sK = st.k.get_tensor(lay)
        sRed = st.red.get_tensor(cute.make_layout(self.nred))
        sOsq = st.osq.get_tensor(cute.make_layout(self.nosq))

        if cutlass.const_expr(p.pdl and not p.early):
            pdl_begin()
        rS = cute.make_rmem_tensor((RPT,), Float32)
        for ii in cutlass.range_constexpr(self.rpt):
            rS[ii] = mS[b, h, ii * LPC + rp, j]
        # conv history and weights: this thread's q or k channel, and its column's v channel
        rHqk = cute.make_rmem_tensor((KC - 1,), Float32)
        rCqk = cute.make_rmem_tensor((KC,), Float32)
        rHv = cute.make_rmem_tensor((KC - 1,), Float32)
        rCv = cute.make_rmem_tensor((KC,), Float32)
        for i in cutlass.range_constexpr(KC - 1):
            rHqk[i] = mConv[b, qkc, i].to(Float32)
            rHv[i] = mConv[b, 2 * D + col, i].to(Float32)
        for i in cutlass.range_constexpr(KC):
            rCqk[i] = mConvW[qkc, i].to(Float32)
            rCv[i] = mConvW[2 * D + col, i].to(Float32)
        a_h = cute.math.exp(mALog[h], fastmath=False)
        dt = mDt[h * hd + i_d]
        onorm = mONorm[j].to(Float32)
        scale = Float32(hd**-0.5) if which == 0 else Float32(1.0)
        # this lane's half of f_b row h*hd + i_d, held across the tokens
        rFb = cute.make_rmem_tensor((8, hd // 16), BFloat16)  # column v: 8 contiguous
        for v in cutlass.range_constexpr(hd // 16):
            load_vec8(mFb[h * hd + i_d, None], (v * 2 + half) * 8, rFb[None, v])
        if cutlass.const_expr(p.pdl and p.early):
            pdl_begin()  # the loads above are in flight (kda_decode.early_enabled)

        if cutlass.const_expr(self.batched):
            self.tokens_batched(mProj, mOut, b, h, j, col, qkc, i_d, half, scale, a_h, dt, onorm,
                                rS, rHqk, rCqk, rHv, rCv, rFb,
                                (sFa, sDecay, sQ, sK, sRed, sOsq))  # fmt: skip
        if cutlass.const_expr(not self.staged):  # staged: batched, and sFa is BF16
            for t in cutlass.range(0 if self.batched else T, unroll_full=True):
                row = b * T + t
                # short conv + SiLU: this thread's q / k channel, and the column's v channel
                val = self.conv(mProj, row, qkc, rHqk, rCqk)
                vv = self.conv(mProj, row, 2 * D + col, rHv, rCv)
                if tidx < hd:
                    sFa[tidx] = mProj[row, 4 * D + tidx].to(Float32)
                gj = mProj[row, 3 * D + col].to(Float32)
                beta = sigmoid(mProj[row, 4 * D + hd + h].to(Float32))
                # sums of squares: warps [0, NW/2) hold q channels, [NW/2, NW) k channels
                ws = warp_sum(val * val)
                if lane == 0:
                    sRed[warp] = ws
                cute.arch.sync_threads()  # also publishes sFa
                ss = Float32(0.0)
                for w in cutlass.range_constexpr(self.warps // 2):
                    ss = ss + sRed[which * (NW // 2) + w]
                vn = val / cute.arch.fmax(cute.math.sqrt(ss), Float32(1e-12)) * scale
                if which == 0:
                    sQ[ch] = vn
                else:
                    sK[ch] = vn
                # decay of row i_d: f_b[h*hd + i_d, :] . f_a, two lanes per row
                f = Float32(0.0)
                for v in cutlass.range_constexpr(hd // 16):
                    k0 = (v * 2 + half) * 8
                    for e in cutlass.range_constexpr(8):
                        f = f + rFb[e, v].to(Float32) * sFa[k0 + e]
                f = f + cute.arch.shuffle_sync_bfly(f, offset=1)
                gk = Float32(p.lower_bound) * sigmoid(a_h * (f + dt))
                if half == 0:
                    sDecay[i_d] = cute.math.exp(gk, fastmath=False)
                cute.arch.sync_threads()  # sQ, sK, sDecay complete; sRed free
                kv = Float32(0.0)
                for ii in cutlass.range_constexpr(self.rpt):
                    i = ii * LPC + rp
                    rS[ii] = rS[ii] * sDecay[i]
                    kv = kv + sK[i] * rS[ii]
                for o in cutlass.range_constexpr(self.lpc_log2):
                    kv = kv + cute.arch.shuffle_sync_bfly(kv, offset=1 << o)
                u = beta * (vv - kv)
                cute.arch.sync_threads()  # as the one-CTA kernel: keeps sK / sQ out of registers
                o = Float32(0.0)
                for ii in cutlass.range_constexpr(self.rpt):
                    i = ii * LPC + rp
                    rS[ii] = rS[ii] + sK[i] * u
                    o = o + sQ[i] * rS[ii]
                for o_ in cutlass.range_constexpr(self.lpc_log2):
                    o = o + cute.arch.shuffle_sync_bfly(o, offset=1 << o_)
                # this CTA's columns' sum of squares, then the cluster's (DSMEM, rank order)
                o_sq = Float32(0.0)
                if lead:
                    o_sq = o * o
                ws2 = warp_sum(o_sq)
                if lane == 0:
                    sRed[warp] = ws2
                cute.arch.sync_threads()
                if tidx == 0:
                    part = Float32(0.0)
                    for w in cutlass.range_constexpr(self.warps):
                        part = part + sRed[w]
                    sOsq[t % 2] = part
                cute.arch.cluster_arrive()  # release: this CTA's partial of token t
                cute.arch.cluster_wait()  # acquire: every CTA's
                tot = Float32(0.0)
                for q in cutlass.range_constexpr(self.vs):
                    tot = tot + ld_cluster_f32(mapa(sOsq.iterator + t % 2, q))
                rstd = cute.math.rsqrt(tot / Float32(hd) + Float32(p.eps))
                if lead:
                    mOut[row, col] = (o * rstd * onorm * sigmoid(gj)).to(BFloat16)
                cute.arch.sync_threads()  # the next token rewrites sFa, sDecay, sQ, sK, sRed

        for ii in cutlass.range_constexpr(self.rpt):
            mS[b, h, ii * LPC + rp, j] = rS[ii]
        if lead:
            for i in cutlass.range_constexpr(KC - 1):
                mConv[b, 2 * D + col, i] = rHv[i].to(BFloat16)
        if ch // CW == r:
            for i in cutlass.range_constexpr(KC - 1):
                mConv[b, qkc, i] = rHqk[i].to(BFloat16)
        cute.arch.cluster_arrive()  # nobody exits while a peer may still read its partial
        cute.arch.cluster_wait()

    @cute.jit
    def conv(self, mProj, row, c, rH, rC):
        """Conv channel ``c`` at projection row ``row``: the short conv over the history and
        the new value, SiLU; the history shifts in the new value."""
        return self.conv_x(mProj[row, c].to(Float32), rH, rC)

    @cute.jit
    def conv_x(self, xn, rH, rC):
        """:meth:`conv` on the new value ``xn`` (FP32)."""
        KC = self.p.conv_kernel
        acc = xn * rC[KC - 1]
        for i in cutlass.range_constexpr(KC - 1):
            acc = acc + rH[i] * rC[i]
        for i in cutlass.range_constexpr(KC - 2):
            rH[i] = rH[i + 1]
        rH[KC - 2] = xn
        return acc * sigmoid(acc)

    @cute.jit
    def tokens_batched(self, mProj, mOut, b, h, j, col, qkc, i_d, half, scale, a_h, dt, onorm,
                       rS, rHqk, rCqk, rHv, rCv, rFb, sm):  # fmt: skip
        """The kernel's token loop with the state-free work of all ``T`` tokens first
        (``DECODESCOPE_KDA_CHAIN=batched``, as :meth:`.kda_decode.KDADecode.item_tokens_batched`):
        conv of this thread's q / k channel and its column's v channel, gate, beta and f_a rows
        for every token; the q / k norms of all tokens behind one block barrier; decay / q / k
        rows ``[t, hd]``; one more barrier; per token the two passes over the state; the output
        norms' partials of all tokens, one block barrier and one cluster barrier for all of
        them. The same sums in the same order as the per-token loop."""
        p = self.p
        hd, D, T = p.head_dim, p.dim, p.tokens
        LPC, NW = self.lpc, self.warps
        sFa, sDecay, sQ, sK, sRed, sOsq = sm
        tidx, _, _ = cute.arch.thread_idx()
        warp = tidx // 32
        lane = tidx % 32
        rp = tidx % LPC
        lead = rp == 0
        which = tidx // hd
        ch = tidx % hd
        val = cute.make_rmem_tensor((T,), Float32)
        vv = cute.make_rmem_tensor((T,), Float32)
        gj = cute.make_rmem_tensor((T,), Float32)
        beta = cute.make_rmem_tensor((T,), Float32)
        if cutlass.const_expr(self.staged):
            sP = sFa  # [t][q, k, v, g][hd], then f_a [t][hd], then beta [t]; BF16
            self.stage_proj(mProj, b, h, sP)
            for t in cutlass.range_constexpr(T):
                val[t] = self.conv_x(sP[(t * 4 + which) * hd + ch].to(Float32), rHqk, rCqk)
                vv[t] = self.conv_x(sP[(t * 4 + 2) * hd + j].to(Float32), rHv, rCv)
                gj[t] = sP[(t * 4 + 3) * hd + j].to(Float32)
                beta[t] = sigmoid(sP[T * 5 * hd + t].to(Float32))
        else:
            for t in cutlass.range_constexpr(T):
                row = b * T + t
                val[t] = self.conv(mProj, row, qkc, rHqk, rCqk)
                vv[t] = self.conv(mProj, row, 2 * D + col, rHv, rCv)
                gj[t] = mProj[row, 3 * D + col].to(Float32)
                beta[t] = sigmoid(mProj[row, 4 * D + hd + h].to(Float32))
            for e in cutlass.range_constexpr(-(-T * hd // THREADS)):
                idx = tidx + e * THREADS
                if idx < T * hd:
                    sFa[idx // hd, idx % hd] = mProj[b * T + idx // hd, 4 * D + idx % hd].to(
                        Float32
                    )
        # sums of squares: warps [0, NW/2) hold q channels, [NW/2, NW) k channels
        for t in cutlass.range_constexpr(T):
            ws = warp_sum(val[t] * val[t])
            if lane == 0:
                sRed[t * NW + warp] = ws
        cute.arch.sync_threads()  # also publishes sFa
        for t in cutlass.range_constexpr(T):
            ss = Float32(0.0)
            for w in cutlass.range_constexpr(NW // 2):
                ss = ss + sRed[t * NW + which * (NW // 2) + w]
            vn = val[t] / cute.arch.fmax(cute.math.sqrt(ss), Float32(1e-12)) * scale
            if which == 0:
                sQ[t, ch] = vn
            else:
                sK[t, ch] = vn
            # decay of row i_d: f_b[h*hd + i_d, :] . f_a, two lanes per row
            f = Float32(0.0)
            for v in cutlass.range_constexpr(hd // 16):
                k0 = (v * 2 + half) * 8
                if cutlass.const_expr(self.staged):
                    fa8 = cute.make_rmem_tensor((8,), BFloat16)
                    load_vec8(sFa, T * 4 * hd + t * hd + k0, fa8)
                    for e in cutlass.range_constexpr(8):
                        f = f + rFb[e, v].to(Float32) * fa8[e].to(Float32)
                else:
                    for e in cutlass.range_constexpr(8):
                        f = f + rFb[e, v].to(Float32) * sFa[t, k0 + e]
            f = f + cute.arch.shuffle_sync_bfly(f, offset=1)
            gk = Float32(p.lower_bound) * sigmoid(a_h * (f + dt))
            if half == 0:
                sDecay[t, i_d] = cute.math.exp(gk, fastmath=False)
        cute.arch.sync_threads()  # sQ, sK, sDecay complete
        ob = cute.make_rmem_tensor((T,), Float32)
        for t in cutlass.range_constexpr(T):
            kv = Float32(0.0)
            for ii in cutlass.range_constexpr(self.rpt):
                i = ii * LPC + rp
                rS[ii] = rS[ii] * sDecay[t, i]
                kv = kv + sK[t, i] * rS[ii]
            for o in cutlass.range_constexpr(self.lpc_log2):
                kv = kv + cute.arch.shuffle_sync_bfly(kv, offset=1 << o)
            u = beta[t] * (vv[t] - kv)
            cute.arch.sync_warp()  # keeps sK / sQ out of registers (no block barrier)
            o = Float32(0.0)
            for ii in cutlass.range_constexpr(self.rpt):
                i = ii * LPC + rp
                rS[ii] = rS[ii] + sK[t, i] * u
                o = o + sQ[t, i] * rS[ii]
            for o_ in cutlass.range_constexpr(self.lpc_log2):
                o = o + cute.arch.shuffle_sync_bfly(o, offset=1 << o_)
            ob[t] = o
            cute.arch.sync_warp()
        # every token's partial of the output norm (slots after the q / k sums'), then the
        # cluster's (DSMEM, rank order)
        for t in cutlass.range_constexpr(T):
            o_sq = Float32(0.0)
            if lead:
                o_sq = ob[t] * ob[t]
            ws2 = warp_sum(o_sq)
            if lane == 0:
                sRed[(T + t) * NW + warp] = ws2
        cute.arch.sync_threads()
        if tidx < T:
            part = Float32(0.0)
            for w in cutlass.range_constexpr(NW):
                part = part + sRed[(T + tidx) * NW + w]
            sOsq[tidx] = part
        cute.arch.cluster_arrive()  # release: this CTA's partials
        cute.arch.cluster_wait()  # acquire: every CTA's
        for t in cutlass.range_constexpr(T):
            tot = Float32(0.0)
            for q in cutlass.range_constexpr(self.vs):
                tot = tot + ld_cluster_f32(mapa(sOsq.iterator + t, q))
            rstd = cute.math.rsqrt(tot / Float32(hd) + Float32(p.eps))
            if lead:
                mOut[b * T + t, col] = (ob[t] * rstd * onorm * sigmoid(gj[t])).to(BFloat16)
