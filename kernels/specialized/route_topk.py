"""Threshold top-k of the grouped route kernel (``DECODESCOPE_MOE_GROUPED_ROUTE=thresh``).

Same result as :func:`router_topk.select_topk` (ids in selection order, larger biased score
first, then the lower expert index; weights renormalized in the same summation order, times
``scaling``), without its ``K`` sequential rounds of a 28-candidate select tree and a 5-level
shuffle argmax (202 SASS instructions per round, ~3860 per token at E = 896, and a dependent
shuffle chain per round). One warp per token, lane ``l`` holding experts ``l + 32 i``:

1. all logits and biases are loaded before any arithmetic (the sigmoid's IEEE division has a
   slow-path branch: computed as each load arrives, the ptxas output issued the 28 loads one
   after another, each a full memory latency; notes/specialized_moe.md);
2. each lane's maximum biased score; ``tau`` = the K-th largest of the 32 lane maxima (rank by
   counting through shared memory): at least K experts score >= ``tau``, so the top K are
   among them;
3. the candidates (score >= ``tau``; ~20-40 of 896 for random logits) are compacted into the
   warp's shared-memory slice by ballots;
4. each candidate counts the candidates that beat it (larger value, then lower index): its
   rank; ranks below K are the picks, written at their rank; the weights' sum is taken in rank
   order (the rounds' order), then ``w * (scaling / sum)``.

More than ``cap`` candidates (ties or adversarial logits; or fewer than K, possible only with
NaN scores): the warp runs :func:`router_topk.select_topk` instead (same result, the old
speed). :func:`thresh_topk_emulate` is this algorithm in torch for CPU tests. H200 TP8, route
kernel alone (notes/gpu-logs/s8/r4): 7.3 / 9.7 us at 8 / 64 tokens against the rounds' 12.8 /
15.1, ids and weights bit for bit equal.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, const_expr

from decodescope.kernels.specialized.moe_common import sigmoid
from decodescope.kernels.specialized.router_topk import select_topk

CAP = 128  # candidates per warp kept in shared memory (4 per lane in the rank step)


@cute.jit
def load_bias(mBias: cute.Tensor, lane, E: cutlass.Constexpr[int]):
    """Lane ``lane``'s router biases (experts ``lane + 32 i``): a weight, not written by the
    previous kernel, so it may be loaded before ``griddepcontrol.wait``."""
    return [mBias[lane + 32 * i] for i in range(E // 32)]


@cute.jit
def thresh_topk(
    mY: cute.Tensor,
    mBias: cute.Tensor,
    bias: list,
    t,
    lane,
    warp,
    sIds: cute.Tensor,
    sW: cute.Tensor,
    sCnt: cute.Tensor,
    sM: cute.Tensor,
    sV: cute.Tensor,
    sI: cute.Tensor,
    sS: cute.Tensor,
    E: cutlass.Constexpr[int],
    K: cutlass.Constexpr[int],
    scaling: cutlass.Constexpr[float],
    cap: cutlass.Constexpr[int],
):
    """One warp ranks token ``t`` (module docstring). ``bias``: :func:`load_bias`'s registers.
    Scratch: ``sM`` (32 per warp), ``sV`` / ``sI`` / ``sS`` (``cap + 4`` per warp: slot ``cap``
    takes the stores of non-candidates). Writes ``sIds[t*K + k]``, ``sW[t*K + k]`` (k in
    selection order), counts each pick in ``sCnt[e]``; ends with a warp sync."""
    EPL = E // 32
    ys = [mY[t, lane + 32 * i] for i in range(EPL)]  # every load issued before any use
    score = [sigmoid(ys[i]) for i in range(EPL)]
    sel = [score[i] + bias[i] for i in range(EPL)]
    # this lane's maximum (a tree: depth log2(EPL))
    cand = list(sel)
    for _lvl in cutlass.range_constexpr((EPL - 1).bit_length()):
        nxt = [cutlass.select_(cand[2 * j + 1] > cand[2 * j], cand[2 * j + 1], cand[2 * j])
               for j in range(len(cand) // 2)]  # fmt: skip
        if const_expr(len(cand) % 2 == 1):
            nxt.append(cand[len(cand) - 1])
        cand = nxt
    m = cand[0]
    # rank of this lane's maximum among the warp's 32 (ties: the lower lane first); the lane of
    # rank K-1 holds tau
    mb = warp * 32
    sM[mb + lane] = m
    cute.arch.sync_warp()
    r = Int32(0)
    for j in cutlass.range_constexpr(32):
        o = sM[mb + j]
        r = r + cutlass.select_((o > m) | ((o == m) & (Int32(j) < lane)), Int32(1), Int32(0))
    b = cute.arch.vote_ballot_sync(r == K - 1)
    src = Int32(31) - cute.arch.clz(b)
    tau = cute.arch.shuffle_sync(m, src)
    # candidates: ballots per register slot; n (warp-uniform) of them
    lt = Int32(cute.arch.lanemask_lt())  # %lanemask_lt: the lanes below this one
    bal = [cute.arch.vote_ballot_sync(sel[i] >= tau) for i in range(EPL)]
    base = [Int32(0)]
    for i in cutlass.range_constexpr(EPL):
        base.append(base[i] + cute.arch.popc(bal[i]))
    n = base[EPL]
    if (n <= cap) & (n >= K):  # n < K only with NaN scores: the rounds write valid ids anyway
        cb = warp * (cap + 4)  # 16-byte aligned slices: vector loads in the rank loop
        for i in cutlass.range_constexpr(EPL):
            # unconditional stores (no branch per slot): a non-candidate writes the warp's
            # spare slot cap
            pos = cutlass.select_(sel[i] >= tau, base[i] + cute.arch.popc(bal[i] & lt), cap)
            sV[cb + pos] = sel[i]
            sI[cb + pos] = lane + 32 * i
            sS[cb + pos] = score[i]
        cute.arch.sync_warp()
        for jc in cutlass.range(0, n, 32, unroll=1):
            c = jc + lane
            cc = cutlass.min(c, n - 1)
            vc = sV[cb + cc]
            ic = sI[cb + cc]
            rk = Int32(0)
            for q in cutlass.range(n, unroll=4):
                vq = sV[cb + q]
                iq = sI[cb + q]
                rk = rk + cutlass.select_((vq > vc) | ((vq == vc) & (iq < ic)), Int32(1), Int32(0))
            if (c < n) & (rk < K):
                sIds[t * K + rk] = ic
                sW[t * K + rk] = sS[cb + cc]
                cute.arch.atomic_add(sCnt.iterator + ic, Int32(1))
        cute.arch.sync_warp()
        # the sum in selection order, as select_topk's rounds add it
        total = Float32(0.0)
        for k in cutlass.range_constexpr(K):
            total = total + sW[t * K + k]
        cute.arch.sync_warp()
        if lane < K:
            sW[t * K + lane] = sW[t * K + lane] * (Float32(scaling) / total)
        cute.arch.sync_warp()
    else:
        select_topk(mY, mBias, t, lane, sIds, sW, sCnt, E, K, scaling)


def thresh_topk_emulate(sel: torch.Tensor, k: int, cap: int = CAP):
    """The selection of :func:`thresh_topk` in torch (CPU tests): ``sel [T, E]`` biased scores
    (float32). Returns ``(ids [T, k] int64 in selection order, n_candidates [T], fell_back
    [T] bool)``; with ``fell_back`` the kernel runs the rounds of ``select_topk``, emulated
    here as a stable sort (larger value, then lower index)."""
    T, E = sel.shape
    lanes = sel.reshape(T, E // 32, 32)  # [t, i, lane]: expert lane + 32 i
    m = lanes.max(1).values  # [T, 32] lane maxima
    lane = torch.arange(32)
    beats = (m[:, None, :] > m[:, :, None]) | (
        (m[:, None, :] == m[:, :, None]) & (lane[None, None, :] < lane[None, :, None])
    )  # [t, l, j]: lane j's max beats lane l's
    rank = beats.sum(-1)
    tau = m.gather(1, (rank == k - 1).int().argmax(1, keepdim=True))  # [T, 1]
    cand = sel >= tau
    n = cand.sum(1)
    idx = torch.arange(E)
    ids = torch.empty(T, k, dtype=torch.int64)
    for t in range(T):
        ci = idx[cand[t]] if int(n[t]) <= cap else idx
        cv = sel[t, ci]
        rk = ((cv[None, :] > cv[:, None]) | ((cv[None, :] == cv[:, None]) & (ci[None, :] < ci[:, None]))).sum(1)  # fmt: skip
        order = torch.argsort(rk)
        ids[t] = ci[order[:k]]
    return ids, n, n > cap
