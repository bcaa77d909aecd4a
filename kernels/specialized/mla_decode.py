"""Gated-MLA absorbed decode in one launch: W_UK absorption + kv_a RMSNorm + cache insert +
split-KV attention over the 576-wide latent cache + combine + W_UV + sigmoid output gate.

Inputs: ``a [B*T, 2112]`` (q_a | kv_a | k_pe, the fused down-projection's output), ``q [B*T,
heads*(nope+rope)]`` (q_b's output, q_a already RMS-normed by that GEMM's prologue), the gate
``g [B*T, heads*v]`` (g_proj), the cache ``[B, ctx+T, 576]`` (BF16) and the per-head ``w_uk
[heads, nope, 512]``, ``w_uv [heads, 512, v]``.

Grid: (head, sequence, split) with ``splits`` chosen so that the grid covers the SMs at small
batch (at batch 1, TP8: 12 heads x 16 splits of 64 cached keys); 8 warps per CTA.

1. The sequence's T new latent rows (``rmsnorm(kv_a) * kv_a_norm | k_pe``) go to shared memory
   (FP32); the CTA (head 0, split 0) also writes them into the cache. Nobody reads those slots
   from the cache in this launch (every CTA uses its shared copy), so there is no race.
2. Per token t: ``q_lat = q_nope @ w_uk[h]`` (thread c: latent columns c, c + 256, ...), then
   the split's cached keys in blocks of ``KB`` per warp (all loads of a block issued before its
   scores: 8 warps x 4 keys x 1152 B = 36 KB in flight per CTA), online softmax per warp; the
   last split also takes the new rows ``ctx .. ctx + t`` (causal among the new tokens). The
   warps merge through shared memory and the CTA writes its partial ``(m, l, o_lat[512])``.
3. The CTA that finishes a (sequence, head) last (an acq_rel atomic counter, reset by that CTA
   for the next launch / graph replay) merges the splits and computes ``o = o_lat @ w_uv[h]``
   times ``sigmoid(g)``. With one split the CTA does it directly.

The default for a BF16 cache is :mod:`.mla_decode_split` (three phases in one launch:
absorption once per head, the keys split over many CTAs with the heads as MMA rows, merge +
W_UV + gate; several tokens per sequence in head groups at TP8 / TP16 since session 15);
shapes it does not take go to :mod:`.mla_decode_tc` (heads x tokens as the MMA rows, keys
staged in shared memory once per CTA) with several tokens or from 16 sequences on, else to
this one, which also serves the FP8 cache and stays selectable
(``DECODESCOPE_MLA_KERNEL=simt|tc|split``, :func:`kernel_choice`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32

from decodescope.kernels.specialized import interface as itf
from decodescope.kernels.specialized.utils import (
    block_sum,
    load_vec8,
    pdl_begin,
    pdl_enabled,
    sigmoid,
    warp_sum,
)

WARPS = 8
KB = 4  # keys per warp per block
NUM_SMS = 132
MIN_KEYS_PER_SPLIT = 64


@dataclass(frozen=True)
class MLAPlan:
    batch: int
    tokens: int
    heads: int
    q_lora: int
    kv_lora: int  # 512
    nope: int  # 128
    rope: int  # 64
    v_dim: int  # 128
    ctx: int  # cached rows before this step
    eps: float = 1e-5
    cache_dtype: str = "bf16"  # or "fp8_e4m3" (plain cast, no scale: what the standard stores)
    pdl: bool = field(default_factory=pdl_enabled)
    heads_per_cta: int = 1  # heads sharing one CTA's key reads (their warps hit the same lines)

    @property
    def hg(self) -> int:
        return self.heads_per_cta

    @property
    def wph(self) -> int:
        """Warps per head."""
        return WARPS // self.heads_per_cta

    @property
    def lat(self) -> int:
        return self.kv_lora + self.rope

    @property
    def cache_type(self) -> type:
        return cutlass.Float8E4M3FN if self.cache_dtype == "fp8_e4m3" else BFloat16

    @property
    def a_width(self) -> int:
        return self.q_lora + self.kv_lora + self.rope

    @property
    def splits(self) -> int:
        want = -(-2 * NUM_SMS // (self.heads // self.hg * self.batch))
        most = max(1, self.ctx // MIN_KEYS_PER_SPLIT)
        return max(1, min(want, most, 64))

    @property
    def keys_per_split(self) -> int:
        blk = self.wph * KB
        return -(-self.ctx // (self.splits * blk)) * blk


class MLADecode:
    def __init__(self, plan: MLAPlan):
        self.p = plan
        self.threads = WARPS * 32
        if plan.v_dim > self.threads or plan.rope > self.threads:
            raise ValueError("v_dim and rope must be <= 256")
        if plan.lat % 8:
            raise ValueError("the latent width must be a multiple of 8")
        if WARPS % plan.hg or plan.heads % plan.hg:
            raise ValueError(f"heads_per_cta={plan.hg} must divide {WARPS} warps and the heads")
        ncg, nvg = plan.kv_lora // 8, plan.v_dim // 8
        if plan.kv_lora % 8 or self.threads % ncg or plan.nope % (self.threads // ncg):
            raise ValueError("kv_lora / 8 must divide 256 threads and nope their quotient")
        if plan.v_dim % 8 or self.threads % nvg or plan.kv_lora % (self.threads // nvg):
            raise ValueError("v_dim / 8 must divide 256 threads and kv_lora their quotient")
        self.part_size = max(self.threads // ncg * plan.kv_lora, self.threads // nvg * plan.v_dim)

    @cute.jit
    def __call__(
        self,
        mA: cute.Tensor,  # [B*T, a_width] bf16
        mQ: cute.Tensor,  # [B*T, heads*(nope+rope)] bf16
        mG: cute.Tensor,  # [B*T, heads*v] bf16
        mKvNorm: cute.Tensor,  # [kv_lora] bf16
        mWuk: cute.Tensor,  # [heads, nope, kv_lora] bf16
        mWuv: cute.Tensor,  # [heads, kv_lora, v] bf16
        mCache: cute.Tensor,  # [B, ctx+T, lat] bf16 or fp8 e4m3, new rows written
        mPart: cute.Tensor,  # [B*T, heads, splits, kv_lora + 2] f32 workspace
        mCnt: cute.Tensor,  # [B, heads] int32, zero between launches
        mOut: cute.Tensor,  # [B*T, heads*v] bf16
        stream: cuda.CUstream,
    ):
        p = self.p

        @cute.struct
        class Smem:
            new: cute.struct.MemRange[Float32, p.tokens * p.lat]
            q: cute.struct.MemRange[Float32, p.hg * p.lat]
            qn: cute.struct.MemRange[Float32, p.hg * p.nope]
            o: cute.struct.MemRange[Float32, WARPS * p.kv_lora]
            ml: cute.struct.MemRange[Float32, 2 * WARPS]
            olat: cute.struct.MemRange[Float32, p.hg * p.kv_lora]
            part: cute.struct.MemRange[Float32, self.part_size]
            red: cute.struct.MemRange[Float32, 8]
            last: cute.struct.MemRange[Int32, 1]

        self.smem_cls = Smem
        self.kernel(mA, mQ, mG, mKvNorm, mWuk, mWuv, mCache, mPart, mCnt, mOut).launch(
            grid=[p.heads // p.hg, p.batch, p.splits],
            block=[self.threads, 1, 1],
            smem=Smem.size_in_bytes(),
            stream=stream,
            use_pdl=p.pdl,
        )

    @cute.kernel
    def kernel(self, mA, mQ, mG, mKvNorm, mWuk, mWuv, mCache, mPart, mCnt, mOut):
        p = self.p
        NT = self.threads
        L, R, KVL, T, S = p.lat, p.rope, p.kv_lora, p.tokens, p.splits
        tidx, _, _ = cute.arch.thread_idx()
        hgi, b, sp = cute.arch.block_idx()
        warp = tidx // 32
        lane = tidx % 32
        HG, WPH = p.hg, p.wph
        h0 = hgi * HG  # first head of this CTA
        hh = warp // WPH  # this warp's head (local index) and its slot among the head's warps
        ws = warp % WPH

        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(self.smem_cls)
        sNew = st.new.get_tensor(cute.make_layout((T, L), stride=(L, 1)))
        sQ = st.q.get_tensor(cute.make_layout((HG, L), stride=(L, 1)))
        sQn = st.qn.get_tensor(cute.make_layout((HG, p.nope), stride=(p.nope, 1)))
        sO = st.o.get_tensor(cute.make_layout((WARPS, KVL), stride=(KVL, 1)))
        sML = st.ml.get_tensor(cute.make_layout((2, WARPS), stride=(WARPS, 1)))
        sOlat = st.olat.get_tensor(cute.make_layout((HG, KVL), stride=(KVL, 1)))
        sPart = st.part.get_tensor(cute.make_layout(self.part_size))
        sRed = st.red.get_tensor(cute.make_layout(8))
        sLast = st.last.get_tensor(cute.make_layout(1))

        if cutlass.const_expr(p.pdl):
            pdl_begin()
        # -- 1. the T new latent rows: rmsnorm(kv_a) * kv_a_norm | k_pe ---------------------
        for t in cutlass.range(T):
            row = b * T + t
            ss = Float32(0.0)
            for i in cutlass.range_constexpr((KVL + NT - 1) // NT):
                c = tidx + i * NT
                if c < KVL:
                    x = mA[row, p.q_lora + c].to(Float32)
                    sNew[t, c] = x
                    ss = ss + x * x
            ss = block_sum(ss, sRed, WARPS)
            rstd = cute.math.rsqrt(ss / Float32(KVL) + Float32(p.eps))
            for i in cutlass.range_constexpr((L + NT - 1) // NT):
                c = tidx + i * NT
                if c < L:
                    val = Float32(0.0)
                    if c < KVL:
                        y = (sNew[t, c] * rstd).to(BFloat16).to(Float32)
                        val = (y * mKvNorm[c].to(Float32)).to(BFloat16).to(Float32)
                    else:
                        val = mA[row, p.q_lora + c].to(Float32)
                    # what the cache stores is what every key read sees (FP8: rounded)
                    sNew[t, c] = val.to(p.cache_type).to(Float32)
                    if hgi == 0 and sp == 0:
                        mCache[b, p.ctx + t, c] = val.to(p.cache_type)
        cute.arch.sync_threads()

        scale = Float32(1.0 / math.sqrt(p.nope + R))
        qw = p.nope + R
        nvec = L // 8
        vpl = (nvec + 31) // 32  # 16-byte vectors per lane
        k_begin = sp * p.keys_per_split
        nblk = p.keys_per_split // (WPH * KB)
        for t in cutlass.range(T):
            row = b * T + t
            # -- 2a. absorbed queries: q_lat = q_nope @ w_uk[h], q_pe as is, each head --------
            for j in cutlass.range_constexpr(HG):
                hj = h0 + j
                for i in cutlass.range_constexpr((p.nope + NT - 1) // NT):
                    d = tidx + i * NT
                    if d < p.nope:
                        sQn[j, d] = mQ[row, hj * qw + d].to(Float32)
                if tidx < R:
                    sQ[j, KVL + tidx] = mQ[row, hj * qw + p.nope + tidx].to(Float32) * scale
                cute.arch.sync_threads()
                self.absorb_q(mWuk, sQn[j, None], sQ[j, None], sPart, hj, tidx, scale)

            # -- 2b. this split's keys, online softmax per warp -----------------------------
            rq = cute.make_rmem_tensor(cute.make_layout((vpl, 8), stride=(8, 1)), Float32)
            for vi in cutlass.range_constexpr(vpl):
                v = lane + vi * 32
                for e in cutlass.range_constexpr(8):
                    rq[vi, e] = Float32(0.0)
                    if v < nvec:
                        rq[vi, e] = sQ[hh, v * 8 + e]
            ro = cute.make_rmem_tensor(cute.make_layout((vpl, 8), stride=(8, 1)), Float32)
            ro.fill(0.0)
            mrun = Float32(-1.0e30)
            lrun = Float32(0.0)
            for blk in cutlass.range(nblk):
                key0 = k_begin + (blk * WPH + ws) * KB
                kb = cute.make_rmem_tensor(  # row-major: kb[q, vi, :] is 16 contiguous bytes
                    cute.make_layout((KB, vpl, 8), stride=(vpl * 8, 8, 1)), p.cache_type
                )
                kb.fill(0.0)
                for q in cutlass.range_constexpr(KB):
                    if key0 + q < p.ctx:
                        for vi in cutlass.range_constexpr(vpl):
                            v = lane + vi * 32
                            if cutlass.const_expr(vi * 32 + 32 <= nvec) or v < nvec:
                                load_vec8(mCache[b, key0 + q, None], v * 8, kb[q, vi, None])
                sc = cute.make_rmem_tensor((KB,), Float32)
                for q in cutlass.range_constexpr(KB):
                    s = Float32(0.0)
                    for vi in cutlass.range_constexpr(vpl):
                        for e in cutlass.range_constexpr(8):
                            s = s + rq[vi, e] * kb[q, vi, e].to(Float32)
                    sc[q] = warp_sum(s)
                    if key0 + q >= p.ctx:
                        sc[q] = Float32(-1.0e30)
                mnew = mrun
                for q in cutlass.range_constexpr(KB):
                    mnew = cute.arch.fmax(mnew, sc[q])
                corr = cute.math.exp(mrun - mnew, fastmath=True)
                lrun = lrun * corr
                for vi in cutlass.range_constexpr(vpl):
                    for e in cutlass.range_constexpr(8):
                        ro[vi, e] = ro[vi, e] * corr
                for q in cutlass.range_constexpr(KB):
                    pk = cute.math.exp(sc[q] - mnew, fastmath=True)
                    if key0 + q >= p.ctx:
                        pk = Float32(0.0)
                    lrun = lrun + pk
                    for vi in cutlass.range_constexpr(vpl):
                        for e in cutlass.range_constexpr(8):
                            ro[vi, e] = ro[vi, e] + pk * kb[q, vi, e].to(Float32)
                mrun = mnew
            # the new rows ctx .. ctx + t: last split, first warp of each head
            if sp == S - 1 and ws == 0:
                for key in cutlass.range(t + 1):
                    s = Float32(0.0)
                    for vi in cutlass.range_constexpr(vpl):
                        v = lane + vi * 32
                        if v < nvec:
                            for e in cutlass.range_constexpr(8):
                                s = s + rq[vi, e] * sNew[key, v * 8 + e]
                    s = warp_sum(s)
                    mnew = cute.arch.fmax(mrun, s)
                    corr = cute.math.exp(mrun - mnew, fastmath=True)
                    pk = cute.math.exp(s - mnew, fastmath=True)
                    lrun = lrun * corr + pk
                    for vi in cutlass.range_constexpr(vpl):
                        v = lane + vi * 32
                        for e in cutlass.range_constexpr(8):
                            kv = Float32(0.0)
                            if v < nvec:
                                kv = sNew[key, v * 8 + e]
                            ro[vi, e] = ro[vi, e] * corr + pk * kv
                    mrun = mnew
            # -- 2c. merge the warps, write this split's partial ------------------------------
            for vi in cutlass.range_constexpr(vpl):
                v = lane + vi * 32
                if v * 8 < KVL:
                    for e in cutlass.range_constexpr(8):
                        sO[warp, v * 8 + e] = ro[vi, e]
            if lane == 0:
                sML[0, warp] = mrun
                sML[1, warp] = lrun
            cute.arch.sync_threads()
            for j in cutlass.range_constexpr(HG):  # each head: merge its WPH warps
                w0 = j * WPH
                mall = sML[0, w0]
                for w in cutlass.range_constexpr(w0 + 1, w0 + WPH):
                    mall = cute.arch.fmax(mall, sML[0, w])
                lall = Float32(0.0)
                for w in cutlass.range_constexpr(w0, w0 + WPH):
                    lall = lall + sML[1, w] * cute.math.exp(sML[0, w] - mall, fastmath=True)
                for i in cutlass.range_constexpr((KVL + NT - 1) // NT):
                    c = tidx + i * NT
                    if c < KVL:
                        acc = Float32(0.0)
                        for w in cutlass.range_constexpr(w0, w0 + WPH):
                            acc = acc + sO[w, c] * cute.math.exp(sML[0, w] - mall, fastmath=True)
                        if cutlass.const_expr(S == 1):
                            sOlat[j, c] = acc / lall
                        else:
                            mPart[row, h0 + j, sp, c] = acc
                if cutlass.const_expr(S > 1):  # noqa: SIM102 (compile-time, then run-time)
                    if tidx == 0:
                        mPart[row, h0 + j, sp, KVL] = mall
                        mPart[row, h0 + j, sp, KVL + 1] = lall
            if cutlass.const_expr(S == 1):
                cute.arch.sync_threads()
                for j in cutlass.range_constexpr(HG):
                    self.finish(mG, mWuv, mOut, sOlat[j, None], sPart, row, h0 + j, tidx)
                    cute.arch.sync_threads()
            cute.arch.sync_threads()

        # -- 3. the last split of (b, head group) merges the partials ------------------------
        if cutlass.const_expr(S > 1):
            cute.arch.fence_acq_rel_gpu()
            cute.arch.sync_threads()
            if tidx == 0:
                old = cute.arch.atomic_add(mCnt.iterator + (b * p.heads + h0), Int32(1),
                                           sem="acq_rel", scope="gpu")  # fmt: skip
                sLast[0] = old
            cute.arch.sync_threads()
            if sLast[0] == S - 1:
                cute.arch.fence_acq_rel_gpu()
                for t in cutlass.range(T):
                    row = b * T + t
                    for j in cutlass.range_constexpr(HG):
                        hj = h0 + j
                        mall = Float32(-1.0e30)
                        for s2 in cutlass.range(S):
                            mall = cute.arch.fmax(mall, mPart[row, hj, s2, KVL])
                        lall = Float32(0.0)
                        for s2 in cutlass.range(S):
                            wgt = cute.math.exp(mPart[row, hj, s2, KVL] - mall, fastmath=True)
                            lall = lall + mPart[row, hj, s2, KVL + 1] * wgt
                        for i in cutlass.range_constexpr((KVL + NT - 1) // NT):
                            c = tidx + i * NT
                            if c < KVL:
                                acc = Float32(0.0)
                                for s2 in cutlass.range(S):
                                    m2 = mPart[row, hj, s2, KVL]
                                    wgt = cute.math.exp(m2 - mall, fastmath=True)
                                    acc = acc + mPart[row, hj, s2, c] * wgt
                                sOlat[j, c] = acc / lall
                        cute.arch.sync_threads()
                        self.finish(mG, mWuv, mOut, sOlat[j, None], sPart, row, hj, tidx)
                        cute.arch.sync_threads()
                if tidx == 0:
                    mCnt[b, h0] = Int32(0)

    @cute.jit
    def absorb_q(self, mWuk, sQn, sQ, sPart, h, tidx, scale):
        """``sQ[:512] = (q_nope @ w_uk[h]) * scale``. Thread = (8 latent columns, a slice of
        the nope rows): 16-byte loads of w_uk, all of a thread's in flight at once, partial sums
        joined through shared memory (one scalar 2-byte load per column and row would be 128
        dependent round trips)."""
        p = self.p
        KVL = p.kv_lora
        ncg = KVL // 8
        dg = self.threads // ncg
        per = p.nope // dg
        cg = tidx % ncg
        g = tidx // ncg
        acc = cute.make_rmem_tensor((8,), Float32)
        acc.fill(0.0)
        for i in cutlass.range(per, unroll_full=True):
            d = g * per + i
            wv = cute.make_rmem_tensor((8,), BFloat16)
            load_vec8(mWuk[h, d, None], cg * 8, wv)
            qd = sQn[d]
            for e in cutlass.range_constexpr(8):
                acc[e] = acc[e] + qd * wv[e].to(Float32)
        for e in cutlass.range_constexpr(8):
            sPart[g * KVL + cg * 8 + e] = acc[e]
        cute.arch.sync_threads()
        for i in cutlass.range_constexpr((KVL + self.threads - 1) // self.threads):
            c = tidx + i * self.threads
            if c < KVL:
                tot = Float32(0.0)
                for gg in cutlass.range_constexpr(dg):
                    tot = tot + sPart[gg * KVL + c]
                sQ[c] = tot * scale
        cute.arch.sync_threads()

    @cute.jit
    def finish(self, mG, mWuv, mOut, sOlat, sPart, row, h, tidx):
        """``out[row, h] = (o_lat @ w_uv[h]) * sigmoid(g[row, h])``; thread = (8 output
        columns, a slice of the 512 latent rows), 16-byte loads, partials joined in smem."""
        p = self.p
        V = p.v_dim
        nvg = V // 8
        cgs = self.threads // nvg
        per = p.kv_lora // cgs
        vg = tidx % nvg
        g = tidx // nvg
        acc = cute.make_rmem_tensor((8,), Float32)
        acc.fill(0.0)
        for i in cutlass.range(per, unroll_full=True):
            c = g * per + i
            wv = cute.make_rmem_tensor((8,), BFloat16)
            load_vec8(mWuv[h, c, None], vg * 8, wv)
            oc = sOlat[c]
            for e in cutlass.range_constexpr(8):
                acc[e] = acc[e] + oc * wv[e].to(Float32)
        for e in cutlass.range_constexpr(8):
            sPart[g * V + vg * 8 + e] = acc[e]
        cute.arch.sync_threads()
        if tidx < V:
            tot = Float32(0.0)
            for gg in cutlass.range_constexpr(cgs):
                tot = tot + sPart[gg * V + tidx]
            gate = sigmoid(mG[row, h * V + tidx].to(Float32))
            mOut[row, h * V + tidx] = (tot * gate).to(BFloat16)


# -- torch-facing --------------------------------------------------------------------------


def plan_for(cfg, batch: int, tokens: int, cache_dtype: str | None = None) -> MLAPlan:
    m = cfg.mla
    return MLAPlan(
        batch=batch,
        tokens=tokens,
        heads=cfg.mla_heads,
        q_lora=m.q_lora_rank,
        kv_lora=m.kv_lora_rank,
        nope=m.qk_nope_head_dim,
        rope=m.qk_rope_head_dim,
        v_dim=m.v_head_dim,
        ctx=cfg.context_len,
        eps=cfg.eps,
        cache_dtype=cache_dtype or cfg.kv_cache_dtype,
    )


def _fake_args(p: MLAPlan):
    bf = torch.bfloat16
    M = p.batch * p.tokens
    return (
        itf.fake(bf, (M, p.a_width), align=4),
        itf.fake(bf, (M, p.heads * (p.nope + p.rope)), align=4),
        itf.fake(bf, (M, p.heads * p.v_dim), align=4),
        itf.fake(bf, (p.kv_lora,), align=4),
        itf.fake(bf, (p.heads, p.nope, p.kv_lora)),
        itf.fake(bf, (p.heads, p.kv_lora, p.v_dim)),
        itf.fake(p.cache_type, (p.batch, p.ctx + p.tokens, p.lat)),
        itf.fake(torch.float32, (M, p.heads, p.splits, p.kv_lora + 2), align=4),
        itf.fake(torch.int32, (p.batch, p.heads), align=4),
        itf.fake(bf, (M, p.heads * p.v_dim), align=4),
        itf.env_stream(),
    )


def compile_plan(p: MLAPlan):
    return itf.compiled(("mla_decode", p), lambda: (MLADecode(p), _fake_args(p)))


KERNELS = ("tc", "simt", "split")


TC_MIN_SEQS = 16  # one token per sequence: tc from this many sequences on


def split_fits(cfg, batch: int, tokens: int, one_group: bool = False) -> bool:
    """Whether :mod:`.mla_decode_split` takes this shape (its dimension multiples, 1..16
    tokens per sequence: the heads split into groups where heads x tokens pass 16 MMA rows; the
    knobs in the environment valid); ``one_group``: and every head in one attention item (the
    shapes the default takes: kimi-k3 TP8 / TP16 at one token)."""
    from decodescope.kernels.specialized import mla_decode_split as sp

    try:
        p = sp.plan_for(cfg, batch, tokens)
    except ValueError:
        return False
    return p.groups == 1 or not one_group


# Several tokens per sequence go to the split kernel's head groups only with as few heads per
# rank as measured there (kimi-k3 TP8: 12, TP16: 6); TP2's 48 heads (24 groups) stay on tc.
SPLIT_GROUPED_MAX_HEADS = 12


def kernel_choice(
    kv_cache_dtype, kernel: str = "", batch: int = 64, tokens: int = 1, cfg=None
) -> str:
    """Which MLA decode kernel runs: ``tc`` (:mod:`.mla_decode_tc`, tensor cores, BF16 cache
    only), ``simt`` (this module's ``MLADecode``) or ``split`` (:mod:`.mla_decode_split`, the
    three-phase kernel of session 10, BF16 cache; head groups from session 14).

    ``kernel`` or ``DECODESCOPE_MLA_KERNEL`` chooses; by default, for a BF16 cache: ``split``
    where its plan fits ``cfg`` (:func:`split_fits`; without a ``cfg``: assumed, as for the
    kimi-k3 TP8 / TP16 shapes), with one token per sequence in one head group, with several
    (verify steps) in head groups up to :data:`SPLIT_GROUPED_MAX_HEADS` heads; else ``tc``
    with several tokens per sequence or from 16 sequences on, else ``simt``; ``simt`` for an
    FP8 cache. H200 s10/r2 (TP8, kernel alone, us): split 13.5 / 19.4 / 31.3 / 48.0 at 1x1 /
    8x1 / 32x1 / 64x1 against simt 19.5 / 61.6 and tc 17.5 / 55.0 / 60.0 / 61.5. Verify steps,
    H200 s15 (bench shares, TP8 1+7 tokens): split in 6 head groups of 2 23.3 us against tc
    42.4 (``DECODESCOPE_MLA_KERNEL=tc`` for the old choice)."""
    k = kernel or os.environ.get("DECODESCOPE_MLA_KERNEL", "")
    if k and k not in KERNELS:
        raise ValueError(f"DECODESCOPE_MLA_KERNEL / kernel: one of {KERNELS}, got {k!r}")
    if kv_cache_dtype != torch.bfloat16:
        if k in ("tc", "split"):
            raise NotImplementedError(f"mla_decode_{k}: BF16 latent cache only")
        return "simt"
    if k:
        return k
    if cfg is None:  # assumed a kimi-k3 TP8 / TP16 shape: the split takes up to 16 tokens
        fits = tokens <= 16
    else:
        fits = split_fits(cfg, batch, tokens, one_group=tokens == 1) and (
            tokens == 1 or cfg.mla_heads <= SPLIT_GROUPED_MAX_HEADS
        )
    if fits:
        return "split"
    return "tc" if tokens > 1 or batch >= TC_MIN_SEQS else "simt"


def compile_for(cfg, batch: int, tokens: int, kernel: str = "") -> object:
    """Compile (cached) the kernel :func:`mla_decode` would run for this shape."""
    dt = torch.float8_e4m3fn if cfg.kv_cache_dtype == "fp8_e4m3" else torch.bfloat16
    choice = kernel_choice(dt, kernel, batch, tokens, cfg)
    if choice == "split":
        from decodescope.kernels.specialized import mla_decode_split as sp

        return sp.compile_plan(sp.plan_for(cfg, batch, tokens))
    if choice == "tc":
        from decodescope.kernels.specialized import mla_decode_tc as tc

        hpc = int(os.environ.get("DECODESCOPE_MLA_HEADS_PER_CTA", "0") or 0)
        return tc.compile_plan(tc.plan_for(cfg, batch, tokens, hpc))
    hpc = int(os.environ.get("DECODESCOPE_MLA_HEADS_PER_CTA", "1") or 1)
    return compile_plan(dataclasses.replace(plan_for(cfg, batch, tokens), heads_per_cta=hpc))


def mla_decode(
    cfg, w: dict, a, q, g, kv_cache, out, tokens: int, heads_per_cta: int = 0, kernel: str = "",
    q_raw: bool = False,
) -> None:  # fmt: skip
    """One launch; writes ``out [B*T, heads*v]`` and the T new cache rows.

    ``kernel``: see :func:`kernel_choice` (by batch and tokens for a BF16 cache).
    ``q_raw``: ``q`` came from the raw ``q_a`` through q_b's norm-folded weight; only the split
    kernel takes it (:attr:`.mla_decode_split.MLASplitPlan.qnorm`, ``DECODESCOPE_WIDE_QNORM``).
    ``heads_per_cta`` (0: ``DECODESCOPE_MLA_HEADS_PER_CTA``, else the kernel's default: 1 for
    ``simt``, by batch for ``tc``): heads sharing one CTA's key reads."""
    cache_dtype = {torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8_e4m3"}.get(kv_cache.dtype)
    if cache_dtype is None:
        raise NotImplementedError(f"mla_decode: no {kv_cache.dtype} latent cache (bf16, fp8 e4m3)")
    env_hpc = int(os.environ.get("DECODESCOPE_MLA_HEADS_PER_CTA", "0") or 0)
    choice = kernel_choice(kv_cache.dtype, kernel, a.shape[0] // tokens, tokens, cfg)
    if q_raw and choice != "split":
        raise ValueError(f"mla_decode: q_raw needs the split kernel, not {choice!r}")
    if choice == "split":
        from decodescope.kernels.specialized.mla_decode_split import mla_decode_split

        mla_decode_split(cfg, w, a, q, g, kv_cache, out, tokens, q_raw=q_raw)
        return
    if choice == "tc":
        from decodescope.kernels.specialized.mla_decode_tc import mla_decode_tc

        mla_decode_tc(cfg, w, a, q, g, kv_cache, out, tokens, heads_per_cta or env_hpc)
        return
    batch = a.shape[0] // tokens
    hpc = heads_per_cta or env_hpc or 1
    plan = dataclasses.replace(plan_for(cfg, batch, tokens, cache_dtype), heads_per_cta=hpc)
    fn = compile_plan(plan)
    part, cnt = _workspace(plan, a.device)
    fn(a, q, g, w["kv_a_norm"], w["w_uk"], w["w_uv"], kv_cache, part, cnt, out)


_WS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(p: MLAPlan, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Split partials and the per-(sequence, head) counters (zeroed once; the kernel re-zeroes
    each counter it used, so the same buffers serve every launch and graph replay). Shared by
    the layers of one plan: launches on one stream run one after another."""
    key = (p, str(device))
    ws = _WS.get(key)
    if ws is None:
        part = torch.empty(p.batch * p.tokens, p.heads, p.splits, p.kv_lora + 2,
                           dtype=torch.float32, device=device)  # fmt: skip
        cnt = torch.zeros(p.batch, p.heads, dtype=torch.int32, device=device)
        ws = _WS[key] = (part, cnt)
    return ws


def mla_decode_ref(cfg, w: dict, a, q, g, kv_cache, tokens: int, q_raw: bool = False):
    """FP32 torch reference of the kernel. Returns ``(out bf16, cache')`` (new tensors).
    ``q_raw``: the scores of each row times ``rsqrt(mean(q_a^2) + eps)`` (``q_a = a[:, :q_lora]``),
    as the split kernel's ``qnorm`` applies it."""
    m = cfg.mla
    f32 = torch.float32
    nh, ctx, T = cfg.mla_heads, cfg.context_len, tokens
    B = a.shape[0] // T
    kv_a = a[:, m.q_lora_rank : m.q_lora_rank + m.kv_lora_rank].float()
    k_pe = a[:, m.q_lora_rank + m.kv_lora_rank :].float()
    rstd = torch.rsqrt(kv_a.pow(2).mean(-1, keepdim=True) + cfg.eps)
    kv_n = ((kv_a * rstd).to(torch.bfloat16).float() * w["kv_a_norm"].float()).to(torch.bfloat16)
    new = torch.cat([kv_n.float(), k_pe], -1).view(B, T, m.latent_dim)
    cache = kv_cache.clone()
    cache[:, ctx : ctx + T] = new.to(cache.dtype)
    kv = cache.to(f32)  # the new rows as stored (FP8: rounded), as the kernel reads them
    qf = q.float().view(B * T, nh, m.qk_head_dim)
    q_nope, q_pe = qf.split([m.qk_nope_head_dim, m.qk_rope_head_dim], -1)
    q_lat = torch.einsum("nhd,hdl->nhl", q_nope, w["w_uk"].float())
    q576 = torch.cat([q_lat, q_pe], -1).view(B, T, nh, -1) / math.sqrt(m.qk_head_dim)
    if q_raw:  # scores are linear in q: the q_a norm's rstd per row, applied to them
        q_a = a[:, : m.q_lora_rank].float()
        q576 = q576 * torch.rsqrt(q_a.pow(2).mean(-1) + cfg.eps).view(B, T, 1, 1)
    o_lat = torch.empty(B, T, nh, m.kv_lora_rank, dtype=f32, device=a.device)
    for t in range(T):
        keys = kv[:, : ctx + t + 1]
        s = torch.einsum("bhl,bsl->bhs", q576[:, t], keys)
        o_lat[:, t] = torch.einsum(
            "bhs,bsl->bhl", torch.softmax(s, -1), keys[..., : m.kv_lora_rank]
        )
    o = torch.einsum("nhl,hlv->nhv", o_lat.view(B * T, nh, -1), w["w_uv"].float())
    o = o * torch.sigmoid(g.float().view(B * T, nh, m.v_head_dim))
    return o.reshape(B * T, -1).to(torch.bfloat16), cache
