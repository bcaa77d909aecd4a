"""LatentMoE front: router GEMM + latent down-projection + shared-expert gate_up, one launch.

All three read the same normalized hidden state ``h [T, H]``, so the specialized path packs their
weights into one matrix ``w_front [E + L + 2S, H]`` (router rows, latent_down rows, shared gate
rows, shared up rows) and reads ``h`` once per CTA. The rows are split over CTAs (the router GEMM
"split into parts": 896 rows of 7168 become 112 CTAs of 8 rows at TP8, beside 448 latent CTAs
and 192 shared CTAs); every CTA loads its weight rows into registers once, stages ``h`` in
shared memory (8 tokens at a time) and its warps run the skinny GEMV of :mod:`moe_common`.
Output: FP32 ``y_front [T, E + L + 2S]`` (router logits, latent z, shared gate/up
pre-activations).

The same launch zeroes what the next kernel accumulates into: the routed-sum buffer
``acc [T, L]`` (FP32 atomics in ``moe_experts``) and the per-expert completion counters.

Sigmoid + bias + top-k + renormalization (:func:`select_topk`) need all E logits of a token,
so they run after this grid completes: in the prologue of ``moe_experts`` (every CTA of that
persistent kernel ranks the T tokens itself, a few microseconds at T <= 8, and builds its
per-expert token lists in shared memory: no extra launch, no host sync, no global metadata).
Launch count: this kernel is 1 launch.

Math matched: ``kernels/reference.py`` ``routing_ref`` (scores = sigmoid(logits), selection by
scores + bias, weights = selected scores renormalized, times ``routed_scaling``).
"""

from __future__ import annotations

import os

import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32, const_expr

from decodescope.kernels.specialized import interface as itf
from decodescope.kernels.specialized.moe_common import (
    VEC,
    dot_rows,
    lanes_per_row,
    load_rows,
    sigmoid,
)

NEG_INF = -3.0e38


class FrontGemv:
    """``y[T, NF] = x[T, K] @ w[NF, K]^T`` in FP32 over row-split CTAs; zeroes ``acc``/``done``.

    Compile-time facts: T tokens, K (hidden), NF (packed rows), the shapes of the buffers it
    zeroes, tokens per staged tile TT, warps per CTA NW, rows per lane group R.
    """

    def __init__(
        self,
        T: int,
        K: int,
        NF: int,
        n_acc: int,
        n_done: int,
        TT: int = 8,
        NW: int = 8,
        R: int = 1,
        pdl: bool = True,
        norm: bool = False,
        eps: float = 1e-5,
        add_residual: bool = True,
    ):
        self.T, self.K, self.NF, self.n_acc, self.n_done = T, K, NF, n_acc, n_done
        self.pdl, self.norm, self.eps = pdl, norm, eps
        self.add_residual = norm and add_residual
        if norm and min(TT, T) > NW:
            raise ValueError("the fused residual norm uses one warp per staged token: TT <= NW")
        self.TT, self.NW, self.R = min(TT, T), NW, R
        self.LPR = lanes_per_row(K)
        self.G = 32 // self.LPR
        self.NCH = K // VEC // self.LPR
        self.rows_per_cta = NW * self.G * R
        self.grid = -(-NF // self.rows_per_cta)

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,
        mW: cute.Tensor,
        mY: cute.Tensor,
        mAcc: cute.Tensor,
        mDone: cute.Tensor,
        mR: cute.Tensor,
        mNW: cute.Tensor,
        mROut: cute.Tensor,
        stream,
    ):
        self.kernel(mX, mW, mY, mAcc, mDone, mR, mNW, mROut).launch(
            grid=[self.grid, 1, 1],
            block=[self.NW * 32, 1, 1],
            stream=stream,
            use_pdl=self.pdl,
        )

    @cute.kernel
    def kernel(
        self,
        mX: cute.Tensor,
        mW: cute.Tensor,
        mY: cute.Tensor,
        mAcc: cute.Tensor,
        mDone: cute.Tensor,
        mR: cute.Tensor,
        mNW: cute.Tensor,
        mROut: cute.Tensor,
    ):
        NT = self.NW * 32
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()

        grp = lane // self.LPR
        li = lane % self.LPR
        row0 = bid * self.rows_per_cta + (warp * self.G + grp) * self.R
        gWv = cute.zipped_divide(mW, (1, VEC))
        # this lane's weight chunks first: they stay in registers for every token tile
        ws = load_rows(gWv, cutlass.min(row0, self.NF - self.R), 1, li, self.R, self.LPR, self.NCH)

        if const_expr(self.pdl):
            # launched early (programmatic dependent launch): the weight loads above overlap the
            # previous kernel's tail; everything below may read or overwrite what it wrote
            cute.arch.griddepcontrol_wait()
        # zero the routed-sum accumulator and the expert completion counters (grid-stride)
        for i in cutlass.range(bid * NT + tid, self.n_acc, self.grid * NT):
            mAcc[i] = Float32(0.0)
        for i in cutlass.range(bid * NT + tid, self.n_done, self.grid * NT):
            mDone[i] = Int32(0)
        if const_expr(self.pdl):
            # the expert kernel may launch once every CTA of this grid has started; it waits for
            # this grid's completion before reading anything
            cute.arch.griddepcontrol_launch_dependents()

        smem = cutlass.memory.SmemAllocator()
        sX = smem.allocate_tensor(
            BFloat16, cute.make_ordered_layout((self.TT, self.K), order=(1, 0)), byte_alignment=16
        )
        sRstd = smem.allocate_tensor(Float32, cute.make_layout(8), byte_alignment=16)
        gXv = cute.zipped_divide(mX, (1, VEC))
        sXv = cute.zipped_divide(sX, (1, VEC))
        # optional fused residual-add + RMSNorm (the AttnRes stand-in before the MoE block)
        gRv = cute.zipped_divide(mR, (1, VEC))
        gROv = cute.zipped_divide(mROut, (1, VEC))
        nw_len = self.K if const_expr(self.norm) else VEC
        gNv = cute.zipped_divide(
            cute.make_tensor(mNW.iterator, cute.make_layout((1, nw_len))), (1, VEC)
        )
        acc = cute.make_rmem_tensor((self.R, self.TT), Float32)
        # full token tiles in a loop (code size independent of T), then the remainder
        for t0 in cutlass.range(0, (self.T // self.TT) * self.TT, self.TT, unroll=1):
            self._token_tile(ws, gXv, gRv, gROv, gNv, sRstd, sXv, mY, acc, t0, row0, li, self.TT)
        if const_expr(self.T % self.TT):
            self._token_tile(ws, gXv, gRv, gROv, gNv, sRstd, sXv, mY, acc,
                             self.T - self.T % self.TT, row0, li, self.T % self.TT)  # fmt: skip

    @cute.jit
    def _token_tile(self, ws, gXv, gRv, gROv, gNv, sRstd, sXv, mY, acc, t0, row0, li,
                    nt: cutlass.Constexpr[int]):  # fmt: skip
        """Stage tokens t0 .. t0+nt of h, multiply by this lane's rows, store FP32 sums.

        With ``norm``: h = bf16(bf16(x' * rstd) * w_norm), x' = x or, with ``add_residual``,
        bf16(x + r) (vLLM's fused_add_rms_norm rounding); every CTA takes the per-token rstd
        itself (one warp per token) and CTA 0 writes the new residual x'."""
        NT = self.NW * 32
        KV = self.K // VEC
        tid, _, _ = cute.arch.thread_idx()
        if const_expr(self.norm):
            lane = cute.arch.lane_idx()
            warp = cute.arch.warp_idx()
            bid, _, _ = cute.arch.block_idx()
            if warp < nt:
                ss = Float32(0.0)
                for c in cutlass.range(lane, KV, 32, unroll=4):
                    hv = gXv[(0, None), (t0 + warp, c)].load()
                    if const_expr(self.add_residual):
                        hv = (
                            hv.to(Float32) + gRv[(0, None), (t0 + warp, c)].load().to(Float32)
                        ).to(BFloat16)
                        if bid == 0:
                            gROv[(0, None), (t0 + warp, c)].store(hv)
                    hf = hv.to(Float32)
                    ss = ss + (hf * hf).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                ss = cute.arch.warp_reduction(ss, lambda a, b: a + b)
                if lane == 0:
                    sRstd[warp] = cute.math.rsqrt(ss / Float32(self.K) + Float32(self.eps))
            cute.arch.barrier()
            for i in cutlass.range(tid, nt * KV, NT, unroll=4):
                t = i // KV
                c = i % KV
                hv = gXv[(0, None), (t0 + t, c)].load()
                if const_expr(self.add_residual):
                    hv = (hv.to(Float32) + gRv[(0, None), (t0 + t, c)].load().to(Float32)).to(
                        BFloat16
                    )
                hn = (hv.to(Float32) * sRstd[t]).to(BFloat16).to(Float32)
                wn = gNv[(0, None), (0, c)].load().to(Float32)
                sXv[(0, None), (t, c)].store((hn * wn).to(BFloat16))
        else:
            for i in cutlass.range(tid, nt * KV, NT, unroll=4):
                t = i // KV
                c = i % KV
                sXv[(0, None), (t, c)].store(gXv[(0, None), (t0 + t, c)].load())
        cute.arch.barrier()
        dot_rows(ws, sXv, acc, li, self.R, nt, self.LPR, self.NCH)
        if li == 0:
            for r in cutlass.range_constexpr(self.R):
                if row0 + r < self.NF:
                    for t in cutlass.range_constexpr(nt):
                        mY[t0 + t, row0 + r] = acc[r, t]
        cute.arch.barrier()


@cute.jit
def select_topk(
    mY: cute.Tensor,
    mBias: cute.Tensor,
    t,
    lane,
    sIds: cute.Tensor,
    sW: cute.Tensor,
    sCnt: cute.Tensor,
    E: cutlass.Constexpr[int],
    K: cutlass.Constexpr[int],
    scaling: cutlass.Constexpr[float],
):
    """One warp ranks token ``t``: sigmoid(logit) + bias, top-K, renormalized weights.

    Lane l holds experts l, l+32, ...; K rounds of a warp argmax (larger value, then lower index)
    pick the experts. Writes ``sIds[t*K + k]``, ``sW[t*K + k]`` and counts each pick in
    ``sCnt[e]`` (shared-memory atomics).
    """
    EPL = E // 32
    LEVELS = (EPL - 1).bit_length()
    # every load issued before any use: computed as each load arrives, the sigmoid's IEEE
    # division (a slow-path branch) made ptxas issue the loads one after another, a full memory
    # latency each (the finding of route_topk.py; notes/specialized_moe.md)
    ys = [mY[t, lane + 32 * i] for i in range(EPL)]
    bs = [mBias[lane + 32 * i] for i in range(EPL)]
    score = []
    sel = []
    for i in cutlass.range_constexpr(EPL):
        s = sigmoid(ys[i])
        score.append(s)
        sel.append(s + bs[i])
    total = Float32(0.0)
    for k in cutlass.range_constexpr(K):
        # this lane's best as a tree of selects (depth log2(EPL), not a chain of EPL); on a
        # tie the lower expert index wins
        cand = [(sel[i], Int32(lane + 32 * i), score[i]) for i in range(EPL)]
        for _lvl in cutlass.range_constexpr(LEVELS):
            nxt = []
            for j in cutlass.range_constexpr(len(cand) // 2):
                v0, i0, s0 = cand[2 * j]
                v1, i1, s1 = cand[2 * j + 1]
                take = v1 > v0
                nxt.append(
                    (
                        cutlass.select_(take, v1, v0),
                        cutlass.select_(take, i1, i0),
                        cutlass.select_(take, s1, s0),
                    )
                )
            if const_expr(len(cand) % 2 == 1):
                nxt.append(cand[len(cand) - 1])
            cand = nxt
        bv, bi, bs = cand[0]
        for off in cutlass.range_constexpr(5):
            ov = cute.arch.shuffle_sync_bfly(bv, offset=1 << off)
            oi = cute.arch.shuffle_sync_bfly(bi, offset=1 << off)
            os_ = cute.arch.shuffle_sync_bfly(bs, offset=1 << off)
            take = (ov > bv) | ((ov == bv) & (oi < bi))
            bv = cutlass.select_(take, ov, bv)
            bi = cutlass.select_(take, oi, bi)
            bs = cutlass.select_(take, os_, bs)
        for i in cutlass.range_constexpr(EPL):
            sel[i] = cutlass.select_(bi == lane + 32 * i, Float32(NEG_INF), sel[i])
        total = total + bs
        if lane == 0:
            sIds[t * K + k] = bi
            sW[t * K + k] = bs
            cute.arch.atomic_add(sCnt.iterator + bi, Int32(1))
    cute.arch.sync_warp()
    if lane < K:
        sW[t * K + lane] = sW[t * K + lane] * (Float32(scaling) / total)
    cute.arch.sync_warp()


# -- torch-facing --------------------------------------------------------------------------


def pack_front_weights(w: dict[str, torch.Tensor]) -> torch.Tensor:
    """``w_front = [router; latent_down; shared_w13]`` (rows), BF16, contiguous."""
    parts = [w["router"], w["latent_down"]]
    if "shared_w13" in w:
        parts.append(w["shared_w13"])
    return torch.cat([p.to(torch.bfloat16) for p in parts], 0).contiguous()


def pdl_enabled() -> bool:
    """Programmatic dependent launch for the MoE kernels (``DECODESCOPE_MOE_PDL=0`` turns it
    off; read at each call, part of the compile keys)."""
    return os.environ.get("DECODESCOPE_MOE_PDL", "1") != "0"


def _build(
    T: int,
    K: int,
    NF: int,
    n_acc: int,
    n_done: int,
    pdl: bool = True,
    norm: bool = False,
    eps: float = 1e-5,
    add_residual: bool = True,
):
    op = FrontGemv(T, K, NF, n_acc, n_done, pdl=pdl, norm=norm, eps=eps,
                   add_residual=add_residual)  # fmt: skip
    tk = (T, K) if norm and add_residual else (1, VEC)  # placeholders when unused
    args = (
        itf.fake(torch.bfloat16, (T, K)),
        itf.fake(torch.bfloat16, (NF, K)),
        itf.fake(torch.float32, (T, NF)),
        itf.fake(torch.float32, (n_acc,)),
        itf.fake(torch.int32, (n_done,)),
        itf.fake(torch.bfloat16, tk),
        itf.fake(torch.bfloat16, (K if norm else VEC,)),
        itf.fake(torch.bfloat16, tk),
        itf.env_stream(),
    )
    return op, args


_PLACEHOLDERS: dict = {}


def _placeholder(shape, device) -> torch.Tensor:
    key = (tuple(shape), str(device))
    t = _PLACEHOLDERS.get(key)
    if t is None:
        t = _PLACEHOLDERS[key] = torch.zeros(shape, dtype=torch.bfloat16, device=device)
    return t


def front_gemv(
    x: torch.Tensor,
    w_front: torch.Tensor,
    y: torch.Tensor,
    acc: torch.Tensor,
    done: torch.Tensor,
    residual: torch.Tensor | None = None,
    norm_w: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> None:
    """Launch :class:`FrontGemv` on the current stream: ``y = h @ w_front^T`` (FP32), zero
    ``acc`` and ``done`` (flat views). ``h = x``; with ``norm_w``, ``h = rmsnorm(x) * norm_w``;
    with ``residual`` / ``residual_out`` as well, ``h = rmsnorm(x + residual) * norm_w`` and
    ``residual_out = x + residual`` (the norm before the MoE block fused: one launch less)."""
    T, K = x.shape
    NF = w_front.shape[0]
    itf.check(x, "x", (T, K), torch.bfloat16)
    itf.check(w_front, "w_front", (NF, K), torch.bfloat16)
    itf.check(y, "y_front", (T, NF), torch.float32)
    norm = norm_w is not None
    add = residual is not None
    if add and not norm:
        raise ValueError("residual needs norm_w (the fused residual-add + RMSNorm)")
    if norm:
        itf.check(norm_w, "norm_w", (K,), torch.bfloat16)
    else:
        norm_w = _placeholder((VEC,), x.device)
    if add:
        itf.check(residual, "residual", (T, K), torch.bfloat16)
        itf.check(residual_out, "residual_out", (T, K), torch.bfloat16)
        if residual_out.data_ptr() in (x.data_ptr(), residual.data_ptr()):
            # CTA 0 writes it while the other CTAs still read x and residual
            raise ValueError("residual_out must not alias x or residual")
    else:
        residual = residual_out = _placeholder((1, VEC), x.device)
    pdl = pdl_enabled()
    key = ("moe_front_gemv", T, K, NF, acc.numel(), done.numel(), pdl, norm, add, float(eps))
    fn = itf.compiled(
        key, lambda: _build(T, K, NF, acc.numel(), done.numel(), pdl, norm, float(eps), add)
    )
    fn(x, w_front, y, acc.view(-1), done.view(-1), residual, norm_w, residual_out)


def front_gemv_ref(x: torch.Tensor, w_front: torch.Tensor) -> torch.Tensor:
    """Torch reference of :class:`FrontGemv` (FP32 accumulate of BF16 operands)."""
    return x.float() @ w_front.float().T


def residual_norm_ref(x, residual, norm_w, eps: float):
    """The fused prologue's math: ``(h, residual_out)`` with vLLM's BF16 roundings."""
    r = (x.float() + residual.float()).to(torch.bfloat16)
    rf = r.float()
    hn = (rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + eps)).to(torch.bfloat16)
    return (hn.float() * norm_w.float()).to(torch.bfloat16), r


def router_topk_ref(logits: torch.Tensor, bias: torch.Tensor, k: int, scaling: float = 1.0):
    """Sigmoid + bias selection, top-k, renormalized sigmoid weights (``routing_ref``'s math).

    Returns ``(ids [T, k] int32, weights [T, k] fp32)``, ids in descending biased score."""
    scores = torch.sigmoid(logits.double())
    sel = scores + bias.double()
    ids = sel.topk(k, dim=-1).indices
    tw = scores.gather(1, ids)
    tw = tw / tw.sum(-1, keepdim=True) * scaling
    return ids.to(torch.int32), tw.float()
