"""Gated-MLA absorbed decode in one kernel: W_UK absorption + kv_a RMSNorm + cache insert +
attention over the 576-wide latent cache + W_UV + sigmoid output gate.

Inputs: ``a [B*T, 2112]`` (q_a | kv_a | k_pe, the fused down-projection's output), ``q [B*T,
heads*(nope+rope)]`` (q_b's output, q_a already RMS-normed by that GEMM's prologue), the gate
``g [B*T, heads*v]`` (g_proj), the cache ``[B, ctx+T, 576]`` (BF16) and the per-head ``w_uk
[heads, nope, 512]``, ``w_uv [heads, 512, v]``.

Grid: one CTA per (head, sequence), 4 warps. Prologue: the sequence's T new latent rows
(``rmsnorm(kv_a) * kv_a_norm | k_pe``) go to shared memory (FP32); the CTA of head 0 also writes
them into the cache (nobody reads those slots from the cache in this launch: every CTA uses its
shared copy, so there is no race). Per token t: ``q_lat = q_nope @ w_uk[h]`` (each thread 4 of
the 512 latent columns), then the keys ``0 .. ctx + t``: warp w takes keys w, w+4, ...; a lane
holds 16 of the 512 latent values (and 2 of the 64 rope ones), the score is a warp sum, the
softmax is online per warp, the four warps merge through shared memory, then ``o = o_lat @
w_uv[h]`` (thread v = one output column) times ``sigmoid(g)``.

Not done yet (notes/specialized.md): split-KV across CTAs for small batches (at batch 1 only
``heads`` CTAs run), FP8 cache reads, tensor-core score/PV MMAs for 1+7 tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32

from decodescope.kernels.specialized import interface as itf
from decodescope.kernels.specialized.utils import block_sum, load_vec8, sigmoid, warp_sum

WARPS = 4


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

    @property
    def lat(self) -> int:
        return self.kv_lora + self.rope

    @property
    def a_width(self) -> int:
        return self.q_lora + self.kv_lora + self.rope


class MLADecode:
    def __init__(self, plan: MLAPlan):
        self.p = plan
        self.threads = WARPS * 32
        if plan.kv_lora % self.threads and self.threads % plan.kv_lora:
            raise ValueError("kv_lora must be a multiple or divisor of 128")
        if plan.v_dim > self.threads or plan.nope > 1024:
            raise ValueError("v_dim must be <= 128")

    @cute.jit
    def __call__(
        self,
        mA: cute.Tensor,  # [B*T, a_width] bf16
        mQ: cute.Tensor,  # [B*T, heads*(nope+rope)] bf16
        mG: cute.Tensor,  # [B*T, heads*v] bf16
        mKvNorm: cute.Tensor,  # [kv_lora] bf16
        mWuk: cute.Tensor,  # [heads, nope, kv_lora] bf16
        mWuv: cute.Tensor,  # [heads, kv_lora, v] bf16
        mCache: cute.Tensor,  # [B, ctx+T, lat] bf16, new rows written
        mOut: cute.Tensor,  # [B*T, heads*v] bf16
        stream: cuda.CUstream,
    ):
        p = self.p

        @cute.struct
        class Smem:
            new: cute.struct.MemRange[Float32, p.tokens * p.lat]
            q: cute.struct.MemRange[Float32, p.lat]
            qn: cute.struct.MemRange[Float32, p.nope]
            o: cute.struct.MemRange[Float32, WARPS * p.kv_lora]
            ml: cute.struct.MemRange[Float32, 2 * WARPS]
            olat: cute.struct.MemRange[Float32, p.kv_lora]
            red: cute.struct.MemRange[Float32, 8]

        self.smem_cls = Smem
        self.kernel(mA, mQ, mG, mKvNorm, mWuk, mWuv, mCache, mOut).launch(
            grid=[p.heads, p.batch, 1],
            block=[self.threads, 1, 1],
            smem=Smem.size_in_bytes(),
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mA, mQ, mG, mKvNorm, mWuk, mWuv, mCache, mOut):
        p = self.p
        NT = self.threads
        L, R, KVL, T = p.lat, p.rope, p.kv_lora, p.tokens
        tidx, _, _ = cute.arch.thread_idx()
        h, b, _ = cute.arch.block_idx()
        warp = tidx // 32
        lane = tidx % 32

        smem = cutlass.utils.SmemAllocator()
        st = smem.allocate(self.smem_cls)
        sNew = st.new.get_tensor(cute.make_layout((T, L), stride=(L, 1)))
        sQ = st.q.get_tensor(cute.make_layout(L))
        sQn = st.qn.get_tensor(cute.make_layout(p.nope))
        sO = st.o.get_tensor(cute.make_layout((WARPS, KVL), stride=(KVL, 1)))
        sML = st.ml.get_tensor(cute.make_layout((2, WARPS), stride=(WARPS, 1)))
        sOlat = st.olat.get_tensor(cute.make_layout(KVL))
        sRed = st.red.get_tensor(cute.make_layout(8))

        # -- the T new latent rows: rmsnorm(kv_a) * kv_a_norm | k_pe ------------------------
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
                    sNew[t, c] = val
                    if h == 0:
                        mCache[b, p.ctx + t, c] = val.to(BFloat16)
        cute.arch.sync_threads()

        scale = Float32(1.0 / math.sqrt(p.nope + R))
        qw = p.nope + R
        for t in cutlass.range(T):
            row = b * T + t
            # -- absorbed query: q_lat = q_nope @ w_uk[h], q_pe as is -------------------------
            for i in cutlass.range_constexpr((p.nope + NT - 1) // NT):
                d = tidx + i * NT
                if d < p.nope:
                    sQn[d] = mQ[row, h * qw + d].to(Float32)
            if tidx < R:
                sQ[KVL + tidx] = mQ[row, h * qw + p.nope + tidx].to(Float32) * scale
            cute.arch.sync_threads()
            for i in cutlass.range_constexpr((KVL + NT - 1) // NT):
                c = tidx + i * NT
                if c < KVL:
                    acc = Float32(0.0)
                    for d in cutlass.range(p.nope, unroll=8):
                        acc = acc + sQn[d] * mWuk[h, d, c].to(Float32)
                    sQ[c] = acc * scale
            cute.arch.sync_threads()

            # -- attention over keys 0 .. ctx + t, online softmax per warp -------------------
            nvec = L // 8
            vpl = (nvec + 31) // 32  # 16-byte vectors per lane
            rq = cute.make_rmem_tensor((vpl, 8), Float32)
            for vi in cutlass.range_constexpr(vpl):
                v = lane + vi * 32
                for e in cutlass.range_constexpr(8):
                    rq[vi, e] = Float32(0.0)
                    if v < nvec:
                        rq[vi, e] = sQ[v * 8 + e]
            ro = cute.make_rmem_tensor((vpl, 8), Float32)
            ro.fill(0.0)
            mrun = Float32(-1.0e30)
            lrun = Float32(0.0)
            nkeys = p.ctx + t + 1
            for key in cutlass.range(warp, nkeys, WARPS):
                kvals = cute.make_rmem_tensor((vpl, 8), Float32)
                kvals.fill(0.0)
                for vi in cutlass.range_constexpr(vpl):
                    v = lane + vi * 32
                    if v < nvec:
                        if key < p.ctx:
                            kb = cute.make_rmem_tensor((8,), BFloat16)
                            load_vec8(mCache[b, key, None], v * 8, kb)
                            for e in cutlass.range_constexpr(8):
                                kvals[vi, e] = kb[e].to(Float32)
                        else:
                            for e in cutlass.range_constexpr(8):
                                kvals[vi, e] = sNew[key - p.ctx, v * 8 + e]
                s = Float32(0.0)
                for vi in cutlass.range_constexpr(vpl):
                    for e in cutlass.range_constexpr(8):
                        s = s + rq[vi, e] * kvals[vi, e]
                s = warp_sum(s)
                mnew = cute.arch.fmax(mrun, s)
                corr = cute.math.exp(mrun - mnew, fastmath=True)
                pk = cute.math.exp(s - mnew, fastmath=True)
                lrun = lrun * corr + pk
                for vi in cutlass.range_constexpr(vpl):
                    for e in cutlass.range_constexpr(8):
                        ro[vi, e] = ro[vi, e] * corr + pk * kvals[vi, e]
                mrun = mnew
            # -- merge the warps ---------------------------------------------------------
            for vi in cutlass.range_constexpr(vpl):
                v = lane + vi * 32
                if v * 8 < KVL:
                    for e in cutlass.range_constexpr(8):
                        sO[warp, v * 8 + e] = ro[vi, e]
            if lane == 0:
                sML[0, warp] = mrun
                sML[1, warp] = lrun
            cute.arch.sync_threads()
            mall = sML[0, 0]
            for w in cutlass.range_constexpr(1, WARPS):
                mall = cute.arch.fmax(mall, sML[0, w])
            lall = Float32(0.0)
            for w in cutlass.range_constexpr(WARPS):
                lall = lall + sML[1, w] * cute.math.exp(sML[0, w] - mall, fastmath=True)
            for i in cutlass.range_constexpr((KVL + NT - 1) // NT):
                c = tidx + i * NT
                if c < KVL:
                    acc = Float32(0.0)
                    for w in cutlass.range_constexpr(WARPS):
                        acc = acc + sO[w, c] * cute.math.exp(sML[0, w] - mall, fastmath=True)
                    sOlat[c] = acc / lall
            cute.arch.sync_threads()
            # -- o = o_lat @ w_uv[h], gate ----------------------------------------------------
            if tidx < p.v_dim:
                acc = Float32(0.0)
                for c in cutlass.range(KVL, unroll=8):
                    acc = acc + sOlat[c] * mWuv[h, c, tidx].to(Float32)
                gate = sigmoid(mG[row, h * p.v_dim + tidx].to(Float32))
                mOut[row, h * p.v_dim + tidx] = (acc * gate).to(BFloat16)
            cute.arch.sync_threads()


# -- torch-facing --------------------------------------------------------------------------


def plan_for(cfg, batch: int, tokens: int) -> MLAPlan:
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
        itf.fake(bf, (p.batch, p.ctx + p.tokens, p.lat)),
        itf.fake(bf, (M, p.heads * p.v_dim), align=4),
        itf.env_stream(),
    )


def compile_plan(p: MLAPlan):
    return itf.compiled(("mla_decode", p), lambda: (MLADecode(p), _fake_args(p)))


def mla_decode(cfg, w: dict, a, q, g, kv_cache, out, tokens: int) -> None:
    """One launch; writes ``out [B*T, heads*v]`` and the T new cache rows."""
    if kv_cache.dtype != torch.bfloat16:
        raise NotImplementedError("mla_decode: only a BF16 latent cache so far")
    batch = a.shape[0] // tokens
    fn = compile_plan(plan_for(cfg, batch, tokens))
    fn(a, q, g, w["kv_a_norm"], w["w_uk"], w["w_uv"], kv_cache, out)


def mla_decode_ref(cfg, w: dict, a, q, g, kv_cache, tokens: int):
    """FP32 torch reference of the kernel. Returns ``(out bf16, cache')`` (new tensors)."""
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
    kv = cache.to(f32)
    kv[:, ctx : ctx + T] = new
    qf = q.float().view(B * T, nh, m.qk_head_dim)
    q_nope, q_pe = qf.split([m.qk_nope_head_dim, m.qk_rope_head_dim], -1)
    q_lat = torch.einsum("nhd,hdl->nhl", q_nope, w["w_uk"].float())
    q576 = torch.cat([q_lat, q_pe], -1).view(B, T, nh, -1) / math.sqrt(m.qk_head_dim)
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
