"""KDA decode in one kernel: conv update + SiLU + decay gate (f_b fused) + beta + L2 norms +
FP32 delta-rule recurrence in place + sigmoid-gated RMSNorm.

Grid: one CTA per (head, sequence); ``head_dim`` threads, thread ``j`` owns column ``j`` (a
value channel) of the head's state ``S [k, v]``: its ``head_dim`` FP32 entries live in registers
for all the sequence's tokens (1..8), read once and written once (coalesced: the threads of a
row ``i`` touch consecutive words). Everything per token is per column except four reductions
over the head (the L2 norms of q and k, and the output RMSNorm; ``k^T S`` and ``q^T S`` are
per-column sums over rows, local to each thread).

Inputs come straight from the merged input projection's output ``proj [B*T, P]`` (q, k, v, g,
f_a, b, pad; :attr:`Config.kda_in_proj_sizes`): ``f_b_proj`` (``head_dim -> D``, 32 KB per
head) is folded in here, so the standard path's separate f_b GEMM has no launch of its own.

Math (:func:`decodescope.kernels.reference.kda_attn_ref`), per token t, head h, column j::

    conv  = silu(sum_i window[i] * conv_w[ch, i])    for q, k, v channels; window shifts in
    f_j   = f_b[h*hd + j, :] . f_a + dt_bias[h*hd + j]
    gk_j  = lower_bound * sigmoid(exp(A_log[h]) * f_j);  beta = sigmoid(b[h])
    q = normalize(q) / sqrt(hd);  k = normalize(k)
    S[i, :] *= exp(gk_i);  u = beta * (v - k^T S);  S += k u^T;  o = q^T S
    out = rmsnorm(o) * o_norm * sigmoid(g)

How the tokens are walked (:func:`chain_mode`, ``DECODESCOPE_KDA_CHAIN``): per token as above,
or batched (everything that does not read the state for all tokens first, then only the passes
over the state per token); the default since H200 session 30 is batched except in the cluster
split at one token. Other forms of the same function: :mod:`.kda_decode_split` (a cluster per
head, few sequences) and :mod:`.kda_decode_stream` (persistent CTAs, opt-in).
"""

# no `from __future__ import annotations`: the smem structs read their field annotations

import math
import os
from dataclasses import dataclass, field

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32

from decodescope.kernels.specialized import interface as itf
from decodescope.kernels.specialized.utils import (
    block_sum,
    block_sums,
    load_vec8,
    pdl_begin,
    pdl_enabled,
    sigmoid,
)


@dataclass(frozen=True)
class KDAPlan:
    batch: int
    tokens: int  # per sequence, 1..8
    heads: int  # per rank
    head_dim: int
    conv_kernel: int
    proj_width: int  # P, columns of the in_proj output
    lower_bound: float = -5.0
    eps: float = 1e-5
    pdl: bool = field(default_factory=pdl_enabled)
    vsplit: int = 1  # > 1: :class:`.kda_decode_split.KDADecodeSplit` (clusters per head)
    # the split's state, conv history and weights before the PDL wait (:func:`early_enabled`)
    early: bool = field(default_factory=lambda: early_enabled())
    # > 0 (with vsplit 1): :class:`.kda_decode_stream.KDADecodeStream`, this many states in
    # flight per CTA, ``stream_cpsm`` CTAs per SM (:func:`stream_for`)
    stream: int = 0
    stream_cpsm: int = 1
    # "token": the per-token chain (three block reductions a token); "batched": everything
    # that does not read the state first, for all tokens (:func:`chain_mode`; plan_for takes
    # the environment's choice, the field's default is the per-token chain)
    chain: str = "token"
    # CTAs per SM the batched chain asks ptxas to fit from 2 tokens (:func:`occ_for`)
    occ: int = 1
    # the batched chain's token loop as a loop (:func:`roll_enabled`), not unrolled
    roll: bool = False
    # the batched chain's projection staged in shared memory by 16-byte loads (:func:`stage_enabled`)
    stage: bool = True
    # the cluster split's batched chain staged the same way (:func:`split_stage_enabled`)
    split_stage: bool = True

    @property
    def dim(self) -> int:
        return self.heads * self.head_dim


VSPLIT_ENV = "DECODESCOPE_KDA_VSPLIT"
EARLY_ENV = "DECODESCOPE_KDA_EARLY"
STREAM_ENV = "DECODESCOPE_KDA_STREAM"
CHAIN_ENV = "DECODESCOPE_KDA_CHAIN"
OCC_ENV = "DECODESCOPE_KDA_OCC"
ROLL_ENV = "DECODESCOPE_KDA_ROLL"
STAGE_ENV = "DECODESCOPE_KDA_STAGE"
SPLIT_STAGE_ENV = "DECODESCOPE_KDA_SPLIT_STAGE"


def early_enabled() -> bool:
    """``DECODESCOPE_KDA_EARLY``: the cluster split (:mod:`.kda_decode_split`) loads what the
    previous kernel of the step does not write (the FP32 state and the conv history, last
    written by this layer's kernel one step earlier, and the weights) before its PDL wait, so
    those loads overlap the input projection's tail; only the projection's row waits. Sound
    because every specialized kernel waits before it lets its dependents launch (a kernel's
    early part runs after everything but its predecessor is complete) and no two consecutive
    kernels of a step touch the same layer's state. Unset or ``1`` (the default since H200
    s14/r1: TP8 1x1 in the layer, bench shares, the KDA decode 11.3 us one-CTA -> 8.2 split 8
    with early loads, the KDA layer 112.5 -> 109.6); ``0``: everything after the wait. The
    one-CTA kernel ignores it (ptxas: 128 -> 254 registers at 1 token, spills at 8)."""
    v = os.environ.get(EARLY_ENV, "") or "1"
    if v not in ("0", "1"):
        raise ValueError(f"{EARLY_ENV}={v!r}: expected 0 or 1")
    return v == "1"


NUM_SMS = 132  # H200


def vsplit_for(batch: int, heads: int, head_dim: int, tokens: int = 1) -> int:
    """``DECODESCOPE_KDA_VSPLIT``: CTAs (a cluster) per (head, sequence). ``1``: the one-CTA
    kernel; ``2`` / ``4`` / ``8``: :mod:`.kda_decode_split` (head_dim 128 only); ``0`` or
    unset: auto, the largest split that keeps ``batch x heads x split`` within the SMs, 1 from
    half the SMs (``batch x heads >= 66``) or for other head dims. H200, bench shares in the
    layer: TP8 1x8 the KDA decode 43.0 us one-CTA (s13/r5), 30.9 split 8 (s13/r4); TP8 1x1 no
    better split alone (s13/r3 / r4), 11.3 -> 8.2 us split 8 with the early loads of
    :func:`early_enabled` (s14/r1), so auto at every token count since then. A bad value raises
    a one-line ``ValueError``."""
    v = os.environ.get(VSPLIT_ENV, "") or "0"
    if v not in ("0", "1", "2", "4", "8"):
        raise ValueError(f"{VSPLIT_ENV}={v!r}: expected 0 (auto), 1, 2, 4 or 8")
    n = int(v)
    if n:
        return n
    if head_dim != 128 or 2 * batch * heads > NUM_SMS:
        return 1
    for vs in (8, 4, 2):
        if batch * heads * vs <= NUM_SMS:
            return vs
    return 1


def stream_for(vsplit: int) -> tuple[int, int]:
    """``DECODESCOPE_KDA_STREAM``: ``(stages, CTAs per SM)`` of the persistent state stream
    (:mod:`.kda_decode_stream`) where the split does not run (``vsplit`` 1); ``(0, 1)``: the
    one-CTA kernel. Values: ``0`` or unset (off), ``S`` (S stages, one CTA per SM) or ``SxC``
    (``1x2``: one stage, two CTAs per SM). A bad value raises a one-line ``ValueError``."""
    v = os.environ.get(STREAM_ENV, "") or "0"
    ok = {"0": (0, 1), "1": (1, 1), "2": (2, 1), "3": (3, 1), "1x1": (1, 1), "1x2": (1, 2),
          "2x1": (2, 1), "3x1": (3, 1)}  # fmt: skip
    if v not in ok:
        raise ValueError(f"{STREAM_ENV}={v!r}: expected 0 (off), 1, 2, 3, 1x2, 2x1 or 3x1")
    return ok[v] if vsplit == 1 else (0, 1)


def chain_mode(tokens: int = 1, vsplit: int = 1) -> str:
    """``DECODESCOPE_KDA_CHAIN``: how the kernels walk an item's tokens. ``token``: per token
    the conv, the q / k L2 norms (two block reductions), the decay gate, the two passes over
    the state and the output norm (a third), ten block barriers a token (the cluster split:
    five and a cluster barrier). ``batched``: first, for all the item's tokens, everything that
    does not read the state (conv, gates, beta, the q / k norms in one block reduction of
    ``2T`` sums, the decay, q and k into shared memory), one barrier; then per token only the
    two passes over the state (no block barrier; in the one-CTA kernel and the stream each
    lane's rows are contiguous, read four per 16-byte shared-memory load, summed in four
    partial sums); then the output norms of all tokens in one reduction (the split: one
    cluster barrier for all of them). ``auto`` or unset (the default since H200 s30, n2-n6):
    batched, except the cluster split at one token (alone, TP8 1x1: 5.5 us per-token, 6.1
    batched). Measured for it, bench, specialized, same call: 1x8 KDA layer TP8 330.8 / 330.7
    -> 326.3 / 326.5 us, TP16 212.8 -> 208.4; 64x8 TP8 2178.0 -> 2164.6, TP16 1165.6 ->
    1151.1; 64x1 TP8 1065.8 -> 1063.0. A bad value raises a one-line ``ValueError``."""
    v = os.environ.get(CHAIN_ENV, "") or "auto"
    if v not in ("auto", "token", "batched"):
        raise ValueError(f"{CHAIN_ENV}={v!r}: expected auto, token or batched")
    if v == "auto":
        return "token" if vsplit > 1 and tokens == 1 else "batched"
    return v


# a CTA's time at two CTAs per SM over its time at one, for the batched chain at 8 tokens
# (H200, s31 n4, the kernel alone: 1.46 to 1.57 over TP8 / TP16 x 32 / 64 x 8)
OCC_COST = 1.5


def occ_for(batch: int = 1, heads: int = 1, tokens: int = 1) -> int:
    """``DECODESCOPE_KDA_OCC``: CTAs per SM the one-CTA kernel's batched chain asks ptxas to fit
    from 2 tokens (``min_blocks_per_mp``). ``1``: 183 registers at 8 tokens, one CTA (8 warps)
    per SM; ``2``: at most 128 registers (ptxas: about 200 bytes of spills at 8 tokens), two
    CTAs per SM. At one token it is always two. ``auto`` (unset): the fewer waves of
    ``batch x heads`` CTAs, a wave at two per SM costing :data:`OCC_COST` waves at one:
    two where ``ceil(n / 2 SMs) x 1.5 < ceil(n / SMs)``.

    H200, the kernel alone (s31 n4, ``scripts/gpu_kda_split.py``, 8 tokens), one / two per SM:
    TP8 64 x 8 (768 CTAs, 6 / 3 waves) 191.2 / 149.9 us; TP16 32 x 8 (192, 2 / 1) 62.6 / 48.6;
    TP8 32 x 8 and TP16 64 x 8 (384, 3 / 2) 97.0 / 95.9 and 99.1 / 96.2; TP8 8 x 8 (96, one
    wave either way) 32.0 / 34.7, TP16 8 x 8 30.4 / 33.8. Auto takes two for the first two only.
    A bad value raises a one-line ``ValueError``."""
    v = os.environ.get(OCC_ENV, "") or "auto"
    if v not in ("auto", "1", "2"):
        raise ValueError(f"{OCC_ENV}={v!r}: expected auto, 1 or 2")
    if v != "auto":
        return int(v)
    if tokens < 2:
        return 1
    n = batch * heads
    one, two = -(-n // NUM_SMS), -(-n // (2 * NUM_SMS))
    return 2 if two * OCC_COST < one else 1


def roll_enabled() -> bool:
    """``DECODESCOPE_KDA_ROLL=1``: the batched chain's per-token passes as a loop over the
    tokens instead of unrolled (v, beta and each token's output through shared memory
    ``[t, hd]``, not per-token registers). Why: unrolled over 8 tokens the one-CTA kernel's
    PTX is 5267 lines and its cubin 108 KB (ptxas 13.0 on the CPU; 70 KB rolled), and on the
    H200 (s30, alone, TP16) 64x8 takes 95.9 us against 23.8 at 64x1, about 3.5 us per extra
    token and wave of CTAs. The hypothesis, not yet measured on a GPU: the unrolled code does
    not fit the SM's instruction caches. Off (unset or ``0``). Only the batched chain from two tokens reads it. A bad value
    raises a one-line ``ValueError``."""
    v = os.environ.get(ROLL_ENV, "") or "0"
    if v not in ("0", "1"):
        raise ValueError(f"{ROLL_ENV}={v!r}: expected 0 or 1")
    return v == "1"


def stage_enabled() -> bool:
    """``DECODESCOPE_KDA_STAGE``: the batched chain copies what an item reads of the projection
    (q, k, v, g, f_a, beta of all its tokens) into shared memory by 16-byte loads, all issued
    before any is used (:meth:`ProjStage.stage_proj`). ``1`` (unset): on; ``0``: each value
    loaded where it is used (session 30's prologue, kept for the A/B). A bad value raises a
    one-line ``ValueError``."""
    v = os.environ.get(STAGE_ENV, "") or "1"
    if v not in ("0", "1"):
        raise ValueError(f"{STAGE_ENV}={v!r}: expected 0 or 1")
    return v == "1"


def split_stage_enabled() -> bool:
    """``DECODESCOPE_KDA_SPLIT_STAGE``: the cluster split's batched chain (1 x 8 tokens: TP8
    96 CTAs, TP16 48) stages its projection reads as the one-CTA kernel does
    (:class:`ProjStage`; each CTA of a cluster stages the whole item: 10 KB at 8 tokens, from
    L2); unstaged, its per-token loads (q or k, v, g, beta: 32 at 8 tokens) stand one at a
    time between the sigmoids' slow paths. ``1`` (unset): on; ``0``: off. H200 (s31 m3 / m4,
    same call): the split alone at 1 x 8 TP8 16.21 -> 14.57 us, TP16 14.96 -> 12.47; the TP16
    1 x 8 KDA layer 198.8 -> 196.6 us. A bad value raises a one-line ``ValueError``."""
    v = os.environ.get(SPLIT_STAGE_ENV, "") or "1"
    if v not in ("0", "1"):
        raise ValueError(f"{SPLIT_STAGE_ENV}={v!r}: expected 0 or 1")
    return v == "1"


class ProjStage:
    """The projection staged in shared memory, for the batched chains (the one-CTA kernel's,
    :meth:`KDADecode.item_tokens_batched`, and the cluster split's,
    :meth:`.kda_decode_split.KDADecodeSplit.tokens_batched`). Needs ``self.p`` (a
    :class:`KDAPlan`) and ``self.threads``."""

    @cute.jit
    def stage_proj(self, mProj, b, h, sP):
        """Copy what item ``(b, h)`` reads of the projection into shared memory (``sP``, BF16,
        flat): per token ``t`` the q, k, v, g columns of head ``h`` at ``(t * 4 + c) * hd``,
        then the f_a rows at ``T * 4 * hd + t * hd``, then beta at ``T * 5 * hd + t``; ends
        with a block barrier. Every 16-byte load of the CTA is issued before any store: one
        round trip to L2 for all tokens. Loaded one value at a time where it is used (the
        per-token chain's way), each load waited on its own: ptxas does not hoist a load over
        the sigmoids' division slow paths between them (Nsight Compute, H200 s31: 42% of the
        batched kernel's stall samples at TP16 64 x 8 were in these loads)."""
        p = self.p
        hd, D, T = p.head_dim, p.dim, p.tokens
        tidx, _, _ = cute.arch.thread_idx()
        VPC = hd // 8  # 16-byte vectors per hd columns
        nq = T * 4 * VPC  # q, k, v, g vectors
        n = nq + T * VPC  # and f_a
        nit = -(-n // self.threads)
        regs = cute.make_rmem_tensor((8, nit), BFloat16)
        for it in cutlass.range_constexpr(nit):
            idx = tidx + it * self.threads
            lo, hi = it * self.threads, (it + 1) * self.threads
            if cutlass.const_expr(hi <= nq):  # q, k, v, g only
                self.stage_load(mProj, b, h, idx, False, regs[None, it])
            elif cutlass.const_expr(lo >= nq and hi <= n):  # f_a only
                self.stage_load(mProj, b, h, idx - nq, True, regs[None, it])
            elif idx < nq:
                self.stage_load(mProj, b, h, idx, False, regs[None, it])
            elif idx < n:
                self.stage_load(mProj, b, h, idx - nq, True, regs[None, it])
        braw = BFloat16(0.0)
        if tidx < T:
            braw = mProj[b * T + tidx, 4 * D + hd + h]
        for it in cutlass.range_constexpr(nit):
            idx = tidx + it * self.threads
            if cutlass.const_expr((it + 1) * self.threads <= n):  # noqa: SIM114 (trace-time test)
                cute.autovec_copy(regs[None, it], cute.local_tile(sP, (8,), (idx,)))
            elif idx < n:
                cute.autovec_copy(regs[None, it], cute.local_tile(sP, (8,), (idx,)))
        if tidx < T:
            sP[T * 5 * hd + tidx] = braw
        cute.arch.sync_threads()

    @cute.jit
    def stage_load(self, mProj, b, h, i, fa: bool, dst):
        """Vector ``i`` of :meth:`stage_proj`'s q / k / v / g part (``fa`` False: token
        ``i // (4 VPC)``, channel ``i // VPC % 4``) or of its f_a part into ``dst``."""
        p = self.p
        hd, D, T = p.head_dim, p.dim, p.tokens
        VPC = hd // 8
        if cutlass.const_expr(fa):
            load_vec8(mProj[b * T + i // VPC, None], 4 * D + (i % VPC) * 8, dst)
        else:
            c = (i // VPC) % 4
            load_vec8(mProj[b * T + i // (4 * VPC), None], c * D + h * hd + (i % VPC) * 8, dst)


class KDADecode(ProjStage):
    def __init__(self, plan: KDAPlan):
        self.p = plan
        if plan.chain not in ("token", "batched"):
            raise ValueError(f"KDA decode: chain {plan.chain!r}: expected token or batched")
        if plan.head_dim % 32 or plan.head_dim > 256:
            raise ValueError(f"head_dim must be a multiple of 32 up to 256, got {plan.head_dim}")
        # two lanes per state column from head_dim 64 up: half the FP32 state in each lane's
        # registers (64 of 128 rows), the column sums joined with one shuffle
        self.split = 2 if plan.head_dim >= 64 else 1
        self.threads = plan.head_dim * self.split
        self.warps = self.threads // 32
        self.batched = plan.chain == "batched"
        # per-token scratch rows (f_a, decay, q, k) and reduction scratch (floats)
        self.nt = plan.tokens if self.batched else 1
        self.nred = 3 * plan.tokens * self.warps if self.batched else 16
        self.roll = self.batched and plan.roll and plan.tokens > 1
        # the batched chain's staged projection (:meth:`stage_proj`): per token the q, k, v, g
        # columns of this head and the f_a row (hd each), then one beta per token (16 slots)
        self.staged = self.batched and plan.stage
        self.stage_len = plan.tokens * 5 * plan.head_dim + 16

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
        self.smem_cls = self.smem_struct()
        self.kernel(mProj, mConvW, mConv, mFb, mALog, mDt, mONorm, mS, mOut).launch(
            grid=self.grid(),
            block=[self.threads, 1, 1],
            smem=self.smem_cls.size_in_bytes(),
            stream=stream,
            use_pdl=self.p.pdl,
            **self.occupancy(),
        )

    def grid(self) -> list:
        return [self.p.heads, self.p.batch, 1]

    def ctas_per_sm(self) -> int:
        """CTAs per SM the batched chain asks ptxas to fit (``min_blocks_per_mp``): two at one
        token (at most 128 registers, as the per-token chain's build), from two tokens the
        plan's ``occ`` (:func:`occ_for`)."""
        return 2 if self.p.tokens == 1 else self.p.occ

    def occupancy(self) -> dict:
        if not self.batched or self.ctas_per_sm() < 2:
            return {}
        # preferred_smem_carveout set: min_blocks_per_mp then queries no device at compile time
        return {"min_blocks_per_mp": self.ctas_per_sm(), "preferred_smem_carveout": -1}

    def srow(self, ii, half):
        """The state row of register ``ii`` of a column's lane ``half``: interleaved
        (``ii * 2 + half``) for the per-token chain, contiguous (``half * hd / 2 + ii``) for
        the batched one, whose passes read four rows' decay / q / k per shared-memory load."""
        if self.batched:
            return half * (self.p.head_dim // self.split) + ii
        return ii * self.split + half

    def smem_struct(self):
        """The per-token scratch (f_a, decay, q, k rows; reduction slots) as a struct. The
        batched chain keeps no f_a rows in FP32: its ``fa`` field is the staged projection
        (:meth:`stage_proj`, BF16), :attr:`stage_len` elements."""
        hd, nt = self.p.head_dim, self.nt
        al = 16 if self.batched else 4  # the batched passes' 16-byte loads
        fa_t, fa_n = (BFloat16, self.stage_len) if self.staged else (Float32, nt * hd)

        @cute.struct
        class Scratch:
            fa: cute.struct.Align[cute.struct.MemRange[fa_t, fa_n], al]
            decay: cute.struct.Align[cute.struct.MemRange[Float32, nt * hd], al]
            q: cute.struct.Align[cute.struct.MemRange[Float32, nt * hd], al]
            k: cute.struct.Align[cute.struct.MemRange[Float32, nt * hd], al]
            red: cute.struct.MemRange[Float32, self.nred]

        if not self.roll:
            return Scratch

        @cute.struct
        class ScratchRoll:  # and the rolled token loop's v, outputs and beta per token
            base: Scratch
            v: cute.struct.Align[cute.struct.MemRange[Float32, nt * hd], al]
            o: cute.struct.Align[cute.struct.MemRange[Float32, nt * hd], al]
            beta: cute.struct.Align[cute.struct.MemRange[Float32, 16], al]

        return ScratchRoll

    @cute.kernel
    def kernel(self, mProj, mConvW, mConv, mFb, mALog, mDt, mONorm, mS, mOut):
        p = self.p
        hd, SP = p.head_dim, self.split
        rows = hd // SP  # state rows per thread
        tidx, _, _ = cute.arch.thread_idx()
        h, b, _ = cute.arch.block_idx()
        j = tidx // SP  # value column of this thread
        half = tidx % SP  # which rows of it: self.srow(ii, half)
        sh = self.shared(cutlass.memory.SmemAllocator().allocate(self.smem_cls))

        if cutlass.const_expr(p.pdl):
            pdl_begin()
        col = h * hd + j
        # this thread's rows of state column j, FP32, in registers
        rS = cute.make_rmem_tensor((rows,), Float32)
        for ii in cutlass.range_constexpr(rows):
            rS[ii] = mS[b, h, self.srow(ii, half), j]
        rHist, rCw, rFb = self.item_regs()
        a_h, dt, onorm = self.item_loads(mConvW, mConv, mFb, mALog, mDt, mONorm, b, h, col,
                                         rHist, rCw, rFb)  # fmt: skip
        self.tokens(mProj, mFb, mOut, b, h, col, a_h, dt, onorm, rS, rHist, rCw, rFb, sh)
        self.item_store(mConv, mS, b, h, col, rS, rHist)

    def shared(self, st):
        """The per-token scratch of :attr:`smem_cls` as tensors: (f_a, decay, q, k, red);
        ``[token, hd]`` for the batched chain, ``[hd]`` for the per-token one; the rolled
        loop's (v, o, beta) after them."""
        hd = self.p.head_dim
        lay = cute.make_layout(hd)
        fa_lay = lay
        if self.batched:
            lay = cute.make_layout((self.nt, hd), stride=(hd, 1))
            fa_lay = cute.make_layout(self.stage_len) if self.staged else lay
        base = st.base if self.roll else st
        sh = (
            base.fa.get_tensor(fa_lay),
            base.decay.get_tensor(lay),
            base.q.get_tensor(lay),
            base.k.get_tensor(lay),
            base.red.get_tensor(cute.make_layout(self.nred)),
        )
        if self.roll:
            sh += (
                st.v.get_tensor(lay),
                st.o.get_tensor(lay),
                st.beta.get_tensor(cute.make_layout(16)),
            )
        return sh

    @cute.jit
    def tokens(self, mProj, mFb, mOut, b, h, col, a_h, dt, onorm, rS, rHist, rCw, rFb, sh):
        """An item's tokens by the plan's chain (:func:`chain_mode`)."""
        if cutlass.const_expr(self.batched):
            self.item_tokens_batched(mProj, mFb, mOut, b, h, col, a_h, dt, onorm, rS, rHist, rCw,
                                     rFb, sh)  # fmt: skip
        else:
            self.item_tokens(mProj, mFb, mOut, b, h, col, a_h, dt, onorm, rS, rHist, rCw, rFb, sh)

    def item_regs(self):
        """Registers of one (head, sequence) besides its state: the q / k / v channels' conv
        history and weights, and (from 2 tokens) this lane's half of the f_b row."""
        p = self.p
        KC = p.conv_kernel
        rHist = cute.make_rmem_tensor((3, KC - 1), Float32)
        rCw = cute.make_rmem_tensor((3, KC), Float32)
        rFb = None
        if cutlass.const_expr(p.tokens > 1 and not self.batched):
            rFb = cute.make_rmem_tensor((8, p.head_dim // 8 // self.split), BFloat16)
        return rHist, rCw, rFb

    @cute.jit
    def item_loads(self, mConvW, mConv, mFb, mALog, mDt, mONorm, b, h, col, rHist, rCw, rFb):
        """Load what head ``h`` of sequence ``b`` needs besides its state and its projection
        rows; returns ``(exp(A_log[h]), dt_bias[col], o_norm[j])``."""
        p = self.p
        hd, D, KC, SP = p.head_dim, p.dim, p.conv_kernel, self.split
        tidx, _, _ = cute.arch.thread_idx()
        j = tidx // SP
        half = tidx % SP
        # conv history and weights of column j's q, k, v channels
        for c in cutlass.range_constexpr(3):
            for i in cutlass.range_constexpr(KC - 1):
                rHist[c, i] = mConv[b, c * D + col, i].to(Float32)
            for i in cutlass.range_constexpr(KC):
                rCw[c, i] = mConvW[c * D + col, i].to(Float32)
        a_h = cute.math.exp(mALog[h], fastmath=False)
        dt = mDt[col]
        onorm = mONorm[j].to(Float32)
        # from 2 tokens: this lane's half of f_b row col held across the tokens (its L2 round
        # trips out of the per-token chain; the same products in the same order). At 1 token
        # it is loaded in the loop as before (128 registers: two CTAs per SM at large batch);
        # the batched chain loads each piece once for all tokens in its prologue
        if cutlass.const_expr(p.tokens > 1 and not self.batched):
            for v in cutlass.range_constexpr(hd // 8 // SP):
                load_vec8(mFb[col, None], (v * SP + half) * 8, rFb[None, v])
        return a_h, dt, onorm

    @cute.jit
    def conv_step(self, mProj, row, col, c, rHist, rCw):
        """Channel ``c`` (q, k, v) of column ``col`` at projection row ``row``: the short conv
        over the history and the new value, SiLU; the history shifts in the new value."""
        return self.conv_x(mProj[row, c * self.p.dim + col].to(Float32), c, rHist, rCw)

    @cute.jit
    def conv_x(self, xn, c, rHist, rCw):
        """:meth:`conv_step` on the new value ``xn`` (FP32) of channel ``c``."""
        KC = self.p.conv_kernel
        acc = xn * rCw[c, KC - 1]
        for i in cutlass.range_constexpr(KC - 1):
            acc = acc + rHist[c, i] * rCw[c, i]
        for i in cutlass.range_constexpr(KC - 2):
            rHist[c, i] = rHist[c, i + 1]
        rHist[c, KC - 2] = xn
        return acc * sigmoid(acc)

    @cute.jit
    def item_tokens(self, mProj, mFb, mOut, b, h, col, a_h, dt, onorm, rS, rHist, rCw, rFb, sh):
        """The tokens of head ``h`` of sequence ``b``: conv, gates, the recurrence on ``rS``
        (this thread's rows of its state column) and the gated norm into ``mOut``. ``col`` is
        ``h * head_dim + j``, this thread's value column ``j`` of the head."""
        p = self.p
        hd, D, T, SP = p.head_dim, p.dim, p.tokens, self.split
        rows = hd // SP
        sFa, sDecay, sQ, sK, sRed = sh[:5]
        tidx, _, _ = cute.arch.thread_idx()
        j = tidx // SP
        half = tidx % SP
        lead = half == 0  # the lane that writes per-column results
        NV = hd // 8 // SP
        HOLD = T > 1
        for t in cutlass.range(T, unroll_full=True):
            row = b * T + t
            # short conv + SiLU on q, k, v (both lanes of a column compute it)
            qkv = cute.make_rmem_tensor((3,), Float32)
            for c in cutlass.range_constexpr(3):
                qkv[c] = self.conv_step(mProj, row, col, c, rHist, rCw)
            if tidx < hd:
                sFa[tidx] = mProj[row, 4 * D + tidx].to(Float32)
            gj = mProj[row, 3 * D + col].to(Float32)
            beta = sigmoid(mProj[row, 4 * D + hd + h].to(Float32))
            q_sq = Float32(0.0)
            k_sq = Float32(0.0)
            if lead:
                q_sq = qkv[0] * qkv[0]
                k_sq = qkv[1] * qkv[1]
            qss = block_sum(q_sq, sRed, self.warps)  # its barriers also publish sFa
            kss = block_sum(k_sq, sRed, self.warps)
            cute.arch.sync_threads()  # sFa complete even when block_sum has no barrier
            qn = qkv[0] / cute.arch.fmax(cute.math.sqrt(qss), Float32(1e-12)) * Float32(hd**-0.5)
            kn = qkv[1] / cute.arch.fmax(cute.math.sqrt(kss), Float32(1e-12))
            # decay gate of channel j (a k row of S): f_b[col, :] . f_a, split over the lanes
            f = Float32(0.0)
            if cutlass.const_expr(HOLD):
                for v in cutlass.range_constexpr(NV):
                    k0 = (v * SP + half) * 8
                    for e in cutlass.range_constexpr(8):
                        f = f + rFb[e, v].to(Float32) * sFa[k0 + e]
            else:
                for v in cutlass.range(hd // 8 // SP, unroll_full=True):
                    k0 = (v * SP + half) * 8
                    fb = cute.make_rmem_tensor((8,), BFloat16)  # f_b row: L1/L2-resident
                    load_vec8(mFb[col, None], k0, fb)
                    for e in cutlass.range_constexpr(8):
                        f = f + fb[e].to(Float32) * sFa[k0 + e]
            if cutlass.const_expr(SP == 2):
                f = f + cute.arch.shuffle_sync_bfly(f, offset=1)
            f = f + dt
            gk = Float32(p.lower_bound) * sigmoid(a_h * f)
            if lead:
                sDecay[j] = cute.math.exp(gk, fastmath=False)
                sQ[j] = qn
                sK[j] = kn
            cute.arch.sync_threads()
            kv = Float32(0.0)
            for ii in cutlass.range_constexpr(rows):
                i = ii * SP
                rS[ii] = rS[ii] * sDecay[i + half]
                kv = kv + sK[i + half] * rS[ii]
            if cutlass.const_expr(SP == 2):
                kv = kv + cute.arch.shuffle_sync_bfly(kv, offset=1)
            u = beta * (qkv[2] - kv)
            # a barrier between the two passes: keeps the compiler from holding sK (and
            # hoisting sQ) in registers beside the state (255 registers and spills without it)
            cute.arch.sync_threads()
            o = Float32(0.0)
            for ii in cutlass.range_constexpr(rows):
                i = ii * SP
                rS[ii] = rS[ii] + sK[i + half] * u
                o = o + sQ[i + half] * rS[ii]
            if cutlass.const_expr(SP == 2):
                o = o + cute.arch.shuffle_sync_bfly(o, offset=1)
            o_sq = Float32(0.0)
            if lead:
                o_sq = o * o
            oss = block_sum(o_sq, sRed, self.warps)
            rstd = cute.math.rsqrt(oss / Float32(hd) + Float32(p.eps))
            if lead:
                mOut[row, col] = (o * rstd * onorm * sigmoid(gj)).to(BFloat16)
            cute.arch.sync_threads()  # the next token rewrites sFa, sDecay, sQ, sK

    @cute.jit
    def item_tokens_batched(self, mProj, mFb, mOut, b, h, col, a_h, dt, onorm, rS, rHist, rCw,
                            rFb, sh):  # fmt: skip
        """:meth:`item_tokens`'s function with the state-free work of all ``T`` tokens first
        (``DECODESCOPE_KDA_CHAIN=batched``): every projection load issued at once, the q / k
        norms of all tokens in one block reduction, decay / q / k rows into shared memory
        ``[t, hd]`` (:meth:`batched_prologue`); per token only the two passes over the state
        (a warp barrier between them keeps q and k out of registers); then all output norms
        in one reduction (:meth:`batched_state`)."""
        qkv, gj, beta = self.batched_regs()
        self.batched_prologue(mProj, mFb, b, h, col, a_h, dt, rHist, rCw, rFb, sh, qkv, gj, beta)
        self.batched_state(mOut, b, col, onorm, rS, sh, qkv, gj, beta)

    def batched_regs(self):
        """What the batched chain carries from its prologue to the state passes: the conv +
        SiLU of q / k / v, the output gate and beta, per token."""
        T = self.p.tokens
        return (
            cute.make_rmem_tensor((3, T), Float32),
            cute.make_rmem_tensor((T,), Float32),
            cute.make_rmem_tensor((T,), Float32),
        )

    @cute.jit
    def batched_prologue(self, mProj, mFb, b, h, col, a_h, dt, rHist, rCw, rFb, sh, qkv, gj,
                         beta):  # fmt: skip
        """The batched chain's state-free part, for all tokens; ends with a block barrier
        after the decay / q / k rows."""
        p = self.p
        hd, T, SP, W = p.head_dim, p.tokens, self.split, self.warps
        sFa, sDecay, sQ, sK, sRed = sh[:5]
        tidx, _, _ = cute.arch.thread_idx()
        j = tidx // SP
        half = tidx % SP
        lead = half == 0  # the lane that writes per-column results
        sP = sFa  # staged: the projection, BF16 (:meth:`stage_proj`); else f_a rows, FP32
        if cutlass.const_expr(self.staged):
            self.stage_proj(mProj, b, h, sP)
            # -- every token's projection values: conv + SiLU of q / k / v, the gate, beta
            for t in cutlass.range_constexpr(T):
                for c in cutlass.range_constexpr(3):
                    xn = sP[(t * 4 + c) * hd + j].to(Float32)
                    qkv[c, t] = self.conv_x(xn, c, rHist, rCw)
                gj[t] = sP[(t * 4 + 3) * hd + j].to(Float32)
                beta[t] = sigmoid(sP[T * 5 * hd + t].to(Float32))
        else:
            D = p.dim
            for t in cutlass.range_constexpr(T):
                row = b * T + t
                for c in cutlass.range_constexpr(3):
                    qkv[c, t] = self.conv_step(mProj, row, col, c, rHist, rCw)
                gj[t] = mProj[row, 3 * D + col].to(Float32)
                beta[t] = sigmoid(mProj[row, 4 * D + hd + h].to(Float32))
            for e in cutlass.range_constexpr(-(-T * hd // self.threads)):
                idx = tidx + e * self.threads
                if idx < T * hd:
                    sFa[idx // hd, idx % hd] = mProj[b * T + idx // hd, 4 * D + idx % hd].to(
                        Float32
                    )
        # -- the q / k L2 norms of all tokens: one reduction (its barrier publishes an unstaged
        # sFa)
        ss = cute.make_rmem_tensor((2 * T,), Float32)
        for t in cutlass.range_constexpr(T):
            ss[2 * t] = Float32(0.0)
            ss[2 * t + 1] = Float32(0.0)
            if lead:
                ss[2 * t] = qkv[0, t] * qkv[0, t]
                ss[2 * t + 1] = qkv[1, t] * qkv[1, t]
        block_sums(ss, sRed, W, 2 * T)
        # decay gate of channel j (a k row of S): f_b[col, :] . f_a[t], split over the lanes;
        # each 8-wide piece of the f_b row loaded once for all tokens (L1/L2-resident)
        NV = hd // 8 // SP
        fs = cute.make_rmem_tensor((T,), Float32)
        for t in cutlass.range_constexpr(T):
            fs[t] = Float32(0.0)
        fa8 = cute.make_rmem_tensor((8,), BFloat16)
        for v in cutlass.range(NV, unroll_full=True):
            k0 = (v * SP + half) * 8
            fb = cute.make_rmem_tensor((8,), BFloat16)
            load_vec8(mFb[col, None], k0, fb)
            for t in cutlass.range_constexpr(T):
                if cutlass.const_expr(self.staged):
                    load_vec8(sP, T * 4 * hd + t * hd + k0, fa8)
                    for e in cutlass.range_constexpr(8):
                        fs[t] = fs[t] + fb[e].to(Float32) * fa8[e].to(Float32)
                else:
                    for e in cutlass.range_constexpr(8):
                        fs[t] = fs[t] + fb[e].to(Float32) * sFa[t, k0 + e]
        for t in cutlass.range_constexpr(T):
            qn = (
                qkv[0, t]
                / cute.arch.fmax(cute.math.sqrt(ss[2 * t]), Float32(1e-12))
                * Float32(hd**-0.5)
            )
            kn = qkv[1, t] / cute.arch.fmax(cute.math.sqrt(ss[2 * t + 1]), Float32(1e-12))
            f = fs[t]
            if cutlass.const_expr(SP == 2):
                f = f + cute.arch.shuffle_sync_bfly(f, offset=1)
            f = f + dt
            gk = Float32(p.lower_bound) * sigmoid(a_h * f)
            if lead:
                sDecay[t, j] = cute.math.exp(gk, fastmath=False)
                sQ[t, j] = qn
                sK[t, j] = kn
                if cutlass.const_expr(self.roll):
                    sh[5][t, j] = qkv[2, t]
            if cutlass.const_expr(self.roll):  # noqa: SIM102 (a trace-time test, then a runtime one)
                if tidx == 0:
                    sh[7][t] = beta[t]
        cute.arch.sync_threads()

    @cute.jit
    def batched_state(self, mOut, b, col, onorm, rS, sh, qkv, gj, beta):
        """The batched chain's passes over the state (``rS``), then the gated output norms
        of all tokens."""
        p = self.p
        hd, T, SP, W = p.head_dim, p.tokens, self.split, self.warps
        rows = hd // SP
        sFa, sDecay, sQ, sK, sRed = sh[:5]
        tidx, _, _ = cute.arch.thread_idx()
        half = tidx % SP
        lead = half == 0
        # -- the recurrence: per token two passes over this thread's rows of the state (rows
        # half * rows + ii: contiguous, four per 16-byte load; NACC partial sums per pass)
        q0 = half * (rows // 4)  # this lane's first 4-row group
        ob = cute.make_rmem_tensor((T,), Float32)
        if cutlass.const_expr(self.roll):
            sV, sO, sBeta = sh[5:]
            j = tidx // SP
            for t in cutlass.range(T, unroll=1):
                o = self.passes(sDecay, sK, sQ, rS, t, q0, sBeta[t], sV[t, j])
                if lead:
                    sO[t, j] = o
                cute.arch.sync_warp()
            for t in cutlass.range_constexpr(T):
                ob[t] = sO[t, j]  # this column's lead lane wrote it (same warp)
        else:
            for t in cutlass.range_constexpr(T):
                ob[t] = self.passes(sDecay, sK, sQ, rS, t, q0, beta[t], qkv[2, t])
                cute.arch.sync_warp()
        # -- the gated RMSNorm of every token's output: one reduction
        oss = cute.make_rmem_tensor((T,), Float32)
        for t in cutlass.range_constexpr(T):
            oss[t] = Float32(0.0)
            if lead:
                oss[t] = ob[t] * ob[t]
        block_sums(oss, sRed, W, T, off=2 * T * W)
        for t in cutlass.range_constexpr(T):
            rstd = cute.math.rsqrt(oss[t] / Float32(hd) + Float32(p.eps))
            if lead:
                mOut[b * T + t, col] = (ob[t] * rstd * onorm * sigmoid(gj[t])).to(BFloat16)

    @cute.jit
    def passes(self, sDecay, sK, sQ, rS, t, q0, beta_t, v_t):
        """Token ``t``'s two passes over this thread's rows ``rS`` (decay and ``k^T S``, then
        ``S += k u^T`` and ``q^T S``); returns the column's output ``o`` (both lanes)."""
        p = self.p
        SP = self.split
        rows = p.head_dim // SP
        NACC = 4
        v4 = cute.make_rmem_tensor((2, 4), Float32)
        acc = [Float32(0.0)] * NACC
        for g in cutlass.range_constexpr(rows // 4):
            cute.autovec_copy(cute.local_tile(sDecay[t, None], (4,), (q0 + g,)), v4[0, None])
            cute.autovec_copy(cute.local_tile(sK[t, None], (4,), (q0 + g,)), v4[1, None])
            for e in cutlass.range_constexpr(4):
                ii = g * 4 + e
                rS[ii] = rS[ii] * v4[0, e]
                acc[ii % NACC] = acc[ii % NACC] + v4[1, e] * rS[ii]
        kv = (acc[0] + acc[1]) + (acc[2] + acc[3])
        if cutlass.const_expr(SP == 2):
            kv = kv + cute.arch.shuffle_sync_bfly(kv, offset=1)
        u = beta_t * (v_t - kv)
        cute.arch.sync_warp()
        acc = [Float32(0.0)] * NACC
        for g in cutlass.range_constexpr(rows // 4):
            cute.autovec_copy(cute.local_tile(sK[t, None], (4,), (q0 + g,)), v4[0, None])
            cute.autovec_copy(cute.local_tile(sQ[t, None], (4,), (q0 + g,)), v4[1, None])
            for e in cutlass.range_constexpr(4):
                ii = g * 4 + e
                rS[ii] = rS[ii] + v4[0, e] * u
                acc[ii % NACC] = acc[ii % NACC] + v4[1, e] * rS[ii]
        o = (acc[0] + acc[1]) + (acc[2] + acc[3])
        if cutlass.const_expr(SP == 2):
            o = o + cute.arch.shuffle_sync_bfly(o, offset=1)
        return o

    @cute.jit
    def item_store(self, mConv, mS, b, h, col, rS, rHist):
        """Write back this thread's state rows and (one lane per column) the conv history."""
        p = self.p
        hd, D, KC, SP = p.head_dim, p.dim, p.conv_kernel, self.split
        tidx, _, _ = cute.arch.thread_idx()
        j = tidx // SP
        half = tidx % SP
        for ii in cutlass.range_constexpr(hd // SP):
            mS[b, h, self.srow(ii, half), j] = rS[ii]
        if half == 0:
            for c in cutlass.range_constexpr(3):
                for i in cutlass.range_constexpr(KC - 1):
                    mConv[b, c * D + col, i] = rHist[c, i].to(BFloat16)


# -- torch-facing --------------------------------------------------------------------------


def _fake_args(p: KDAPlan):
    bf, f32 = torch.bfloat16, torch.float32
    D, hd, KC = p.dim, p.head_dim, p.conv_kernel
    return (
        itf.fake(bf, (p.batch * p.tokens, p.proj_width)),
        itf.fake(bf, (3 * D, KC), align=4),
        itf.fake(bf, (p.batch, 3 * D, KC - 1), align=2),
        itf.fake(bf, (D, hd)),
        itf.fake(f32, (p.heads,), align=4),
        itf.fake(f32, (D,), align=4),
        itf.fake(bf, (hd,), align=4),
        itf.fake(f32, (p.batch, p.heads, hd, hd)),
        itf.fake(bf, (p.batch * p.tokens, D)),
        itf.env_stream(),
    )


def make_op(p: KDAPlan):
    """The kernel object of plan ``p``: the one-CTA kernel, the cluster split or the
    persistent state stream."""
    if p.vsplit > 1:
        from decodescope.kernels.specialized.kda_decode_split import KDADecodeSplit

        return KDADecodeSplit(p)
    if p.stream:
        from decodescope.kernels.specialized.kda_decode_stream import KDADecodeStream

        return KDADecodeStream(p)
    return KDADecode(p)


def compile_plan(p: KDAPlan):
    return itf.compiled(("kda_decode", p), lambda: (make_op(p), _fake_args(p)))


def plan_for(cfg, batch: int, tokens: int) -> KDAPlan:
    k = cfg.kda
    vs = vsplit_for(batch, cfg.kda_heads, k.head_dim, tokens)
    ns, cpsm = stream_for(vs)
    return KDAPlan(
        batch=batch,
        tokens=tokens,
        heads=cfg.kda_heads,
        head_dim=k.head_dim,
        conv_kernel=k.conv_kernel,
        proj_width=cfg.kda_in_proj_out,
        lower_bound=k.gate_lower_bound,
        eps=cfg.eps,
        vsplit=vs,
        stream=ns,
        stream_cpsm=cpsm,
        chain=chain_mode(tokens, vs),
        occ=occ_for(batch, cfg.kda_heads, tokens),
        roll=roll_enabled(),
        stage=stage_enabled(),
        split_stage=split_stage_enabled(),
    )


def kda_decode(cfg, w: dict, proj, kda_state, conv_state, out, tokens: int) -> None:
    """One launch: ``out [B*T, D]`` from ``proj [B*T, P]``; updates both states in place."""
    batch = proj.shape[0] // tokens
    fn = compile_plan(plan_for(cfg, batch, tokens))
    fn(
        proj, w["conv_w"], conv_state, w["f_b"], w["A_log"], w["dt_bias"], w["o_norm"],
        kda_state, out,
    )  # fmt: skip


def kda_decode_ref(cfg, w: dict, proj, kda_state, conv_state, tokens: int):
    """FP32 torch reference of the kernel (same math as ``kda_attn_ref`` minus the GEMMs).

    Returns ``(out [B*T, D] bf16, kda_state', conv_state')`` (new tensors)."""
    k = cfg.kda
    nh, hd, D = cfg.kda_heads, k.head_dim, cfg.kda_dim
    T = tokens
    B = proj.shape[0] // T
    f32 = torch.float32
    p = proj.to(f32)
    q, kk, v, g = (p[:, i * D : (i + 1) * D] for i in range(4))
    f_a = p[:, 4 * D : 4 * D + hd]
    bb = p[:, 4 * D + hd : 4 * D + hd + nh]
    qkv = torch.cat([q, kk, v], -1).view(B, T, 3 * D)
    cw = w["conv_w"].to(f32)
    KC = cw.shape[1]
    window = torch.cat([conv_state.to(f32), qkv.transpose(1, 2)], dim=2)
    conv = torch.stack([(window[:, :, t : t + KC] * cw).sum(-1) for t in range(T)], dim=1)
    conv = torch.nn.functional.silu(conv)
    new_conv = window[:, :, T:].to(conv_state.dtype)
    q, kk, v = conv.split(D, dim=-1)
    f = f_a @ w["f_b"].to(f32).T + w["dt_bias"].to(f32)
    a = torch.exp(w["A_log"].to(f32)).repeat_interleave(hd)
    gk = (k.gate_lower_bound * torch.sigmoid(a * f)).view(B, T, nh, hd)
    beta = torch.sigmoid(bb).view(B, T, nh)
    q = torch.nn.functional.normalize(q.view(B, T, nh, hd), dim=-1) / math.sqrt(hd)
    kk = torch.nn.functional.normalize(kk.view(B, T, nh, hd), dim=-1)
    v = v.view(B, T, nh, hd)
    S = kda_state.to(f32).clone()
    outs = []
    for t in range(T):
        S = S * torch.exp(gk[:, t]).unsqueeze(-1)
        kv_mem = torch.einsum("bhk,bhkv->bhv", kk[:, t], S)
        u = beta[:, t].unsqueeze(-1) * (v[:, t] - kv_mem)
        S = S + kk[:, t].unsqueeze(-1) * u.unsqueeze(-2)
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    o = torch.stack(outs, dim=1)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + cfg.eps) * w["o_norm"].to(f32)
    o = o * torch.sigmoid(g.view(B, T, nh, hd))
    return o.reshape(B * T, D).to(torch.bfloat16), S, new_conv
