"""LatentMoE front on tensor cores: ``y[T, NF] = h[T, K] @ w_front[NF, K]^T`` in FP32 with
``mma.sync.m16n8k16`` (BF16 in, FP32 accumulate), zeroing ``acc`` / ``done`` like
:class:`router_topk.FrontGemv`. For 8 and more tokens, where the SIMT GEMV of ``FrontGemv`` is
bound by FMAs and converts (H200, 14:25 run: 75.6 us at 8 tokens, 634 us at 64, against a
~21 us floor).

Swapped operands: the weight rows are the MMA's M (16 rows per tile), the tokens its N (8 per
MMA). Each CTA owns ``RT`` row tiles and all tokens; its 8 warps split K into contiguous
slices and their partial sums meet in shared memory. K is permuted inside each 32-wide chunk so
that lane (g = lane / 4, c = lane % 4) reads its A fragment as two 16-byte loads of contiguous
weights (rows g and g + 8, columns 8c .. 8c + 7) and its B fragment as one 16-byte load of
contiguous activations (token g of each 8-token tile, the same columns): chunk column
``8c + 4s + {0, 1}`` is MMA k ``2c + {0, 1}`` and ``8c + 4s + {2, 3}`` is ``2c + 8 + {0, 1}``
in MMA step s of the chunk; a dot product does not care about the order of K as long as A and
B use the same one. FP32 output: the router's logits stay FP32 for the top-k.

Launch count: 1 (replaces ``FrontGemv``). :class:`FrontMmaNorm` (``front_mma(...,
norm_w=...)``, up to ``NORM_MAX_T`` tokens) is the same kernel on ``h = rmsnorm(r) * norm_w``
with vLLM's BF16 roundings (``bf16(bf16(r * rstd) * w)``): after its PDL wait every CTA sums
the squares of the T rows of ``r`` (T x K BF16 from L2, one block reduction per token), and each
activation fragment is normalized as it is loaded, beside its 8 norm weights. It lets the
attention half drop its ``residual_norm`` launch (``SpecializedMoE.forward_norm``, the step's
``front_norm`` option); ``forward_residual`` (with the residual add) keeps the SIMT kernel.

``DECODESCOPE_FRONT_NORM_FOLD=1`` (opt-in; session 26): :class:`FrontMmaNorm` with ``fold``:
no rstd before the MMAs. Each activation fragment is multiplied by its norm weights as it is
loaded (``bf16(r * w)``), each lane sums the squares of the very activations it loads (every
element of the token's row exactly once per CTA, across its 4 lanes and the 8 warps' K slices),
and the epilogue scales the FP32 sums by the token's ``rstd`` (the squares summed in a fixed
order: every CTA computes the same rstd). RMSNorm is linear in ``r`` once ``rstd`` is known, so
``y = rstd * ((r * w) @ W^T)`` up to BF16 rounding (``bf16(r * w)`` here, vLLM's
``bf16(bf16(r * rstd) * w)`` in the reference): the prologue's row reduction after the PDL wait
(3 us in the layer, s15) leaves the critical path. H200 s27/n1 (batch 1, bench, specialized,
same call): correct (its GPU test passed, the whole step too) but slower than the default's
``residual_norm`` launch + unnormalized front: TP16 KDA / MLA layer shares 81.9 / 90.5 -> 84.7 /
93.2 us, TP8 112.1 / 113.6 -> 118.9 / 115.6 (the folded front alone 22.0 us of share at TP16
against 2.9 + 18.0 for the two launches); so it stays off.

``front_tile`` (the default from ``TILE_FROM`` = 32 tokens with the grouped experts, or
``DECODESCOPE_MOE_FRONT=tile``; issue #5): the same ``y`` through
:mod:`.tile_gemm` with FP32 outputs (its cp.async pipeline stages weights and activations in
shared memory, split-K with a last-CTA reduction: at 32..64 tokens the design above is
latency-bound, each warp re-reading the activations from L2 per chunk, ~93 CTAs at 64). It
zeroes neither ``acc`` nor ``done``: only the grouped expert kernels may follow it (their route
kernel zeroes ``acc`` with ``zero_acc``; they do not use ``done``), which
:meth:`.moe_block.SpecializedMoE.front` enforces.
"""

from __future__ import annotations

import os

import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32, const_expr

from decodescope.kernels.specialized import interface as itf
from decodescope.kernels.specialized import mma_common as mc
from decodescope.kernels.specialized import tile_gemm as tg
from decodescope.kernels.specialized.router_topk import pdl_enabled
from decodescope.kernels.specialized.utils import block_sum

ROWS = 16  # MMA M
KCH = 32  # k per chunk: two m16n8k16 steps
NW = 8  # warps per CTA (K slices)
RING_STAGES = 4
EARLY_SPLITS = (2, 4)  # FrontMmaEarly: CTAs per router row tile (K parts)
# FrontMmaEarly / RouteT1Early's int32 words: [0] the router CTAs' count, then global-timer stamps
# (ns, low and high word) of when each phase ended (STAMPS: the word of each)
EARLY_SIG_WORDS = 16
STAMPS = {"front_cta0": 2, "router_done": 4, "route_resident": 6, "route_counted": 8,
          "route_ranked": 10, "route_waited": 12}  # fmt: skip


NORM_MAX_T = 16  # FrontMmaNorm: each CTA re-reads the T rows of r for their norms


class FrontMma:
    """Compile-time facts: T tokens, K, NF packed rows, sizes of ``acc`` / ``done``."""

    norm = False  # FrontMmaNorm: the activations normalized as they are loaded
    fold = False  # FrontMmaNorm(fold=True): r * w loaded, rstd applied in the epilogue
    eps = 1e-5

    def __init__(self, T: int, K: int, NF: int, n_acc: int, n_done: int, pdl: bool = True,
                 load: str = "regs", rks: int = 1, n_router: int = 0):  # fmt: skip
        if load not in mc.LOADS:
            raise ValueError(f"front_mma: load {load!r}, expected one of {mc.LOADS}")
        self.load = load
        if not 1 <= T <= 64:
            raise ValueError(f"front_mma: 1..64 tokens, got {T}")
        if K % (KCH * NW):
            raise ValueError(f"front_mma: K={K} must be a multiple of {KCH * NW}")
        if NF % ROWS:
            raise ValueError(f"front_mma: NF={NF} must be a multiple of {ROWS}")
        self.T, self.K, self.NF, self.n_acc, self.n_done, self.pdl = T, K, NF, n_acc, n_done, pdl
        self.NJ = -(-T // 8)  # 8-token MMA tiles
        self.MP = self.NJ * 8
        # row tiles per CTA: each B fragment feeds RT MMAs (fewer activation re-reads at large T)
        self.RT = 1 if T <= 16 else (2 if T <= 32 else 4)
        self.ntiles = NF // ROWS
        self.grid = -(-self.ntiles // self.RT)
        self.CPW = K // KCH // NW  # chunks per warp
        u = 1
        for c in (4, 3, 2, 1):
            if self.CPW % c == 0 and c * self.RT <= 4:
                u = c
                break
        self.U = u
        self.NS = RING_STAGES  # "ring": chunks in flight per warp
        self._early(rks, n_router)

    def _early(self, rks: int, n_router: int) -> None:
        """``rks`` CTAs per router row tile (:class:`FrontMmaEarly`), each on ``1 / rks`` of K,
        so that the router's logits are complete early in the launch: the first ``NSIG = rks *
        ceil(n_router / 16)`` CTAs; ``rks = 1``: the kernel as before."""
        self.RKS, self.NRT_R, self.NSIG, self.CPWR, self.UR = rks, 0, 0, self.CPW, self.U
        if rks == 1:
            return
        if rks not in EARLY_SPLITS or self.RT != 1 or n_router % ROWS or n_router >= self.NF:
            raise ValueError(f"front_mma: router split {rks} (one of {EARLY_SPLITS}) needs one "
                             f"row tile per CTA and {n_router} router rows a multiple of {ROWS} "
                             f"below {self.NF}")  # fmt: skip
        if self.CPW % rks:
            raise ValueError(f"front_mma: {self.CPW} chunks per warp do not split in {rks}")
        self.NRT_R = n_router // ROWS
        self.NSIG = self.NRT_R * rks
        self.grid = self.ntiles + self.NRT_R * (rks - 1)
        self.CPWR = self.CPW // rks
        self.UR = next(c for c in (4, 3, 2, 1) if self.CPWR % c == 0)

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,
        mW: cute.Tensor,
        mY: cute.Tensor,
        mAcc: cute.Tensor,
        mDone: cute.Tensor,
        stream,
    ):
        self.kernel(mX, mW, mY, mAcc, mDone).launch(
            grid=[self.grid, 1, 1], block=[NW * 32, 1, 1], stream=stream, use_pdl=self.pdl
        )

    @cute.kernel
    def kernel(
        self,
        mX: cute.Tensor,
        mW: cute.Tensor,
        mY: cute.Tensor,
        mAcc: cute.Tensor,
        mDone: cute.Tensor,
    ):
        self.body(mX, mW, mY, mAcc, mDone, None)

    @cute.jit
    def body(self, mX, mW, mY, mAcc, mDone, mNorm, mPart=None, mSig=None):
        """The kernel (traced inline); ``mNorm`` [K] bf16: :class:`FrontMmaNorm`'s weights;
        ``mPart`` / ``mSig``: :class:`FrontMmaEarly`'s partial logits and arrival counter."""
        if const_expr(self.RKS == 1):  # t0 None: bid * RT (the same PTX as before the split)
            self._work(mX, mW, mY, mAcc, mDone, mNorm, None, 0, self.CPW, self.U, False, mPart)
        else:
            bid, _, _ = cute.arch.block_idx()
            if bid < self.NSIG:  # a K part of a router row tile
                if bid == 0:
                    tid0, _, _ = cute.arch.thread_idx()
                    if tid0 == 0:
                        stamp(mSig, STAMPS["front_cta0"])
                self._work(mX, mW, mY, mAcc, mDone, mNorm, bid // self.RKS, bid % self.RKS,
                           self.CPWR, self.UR, True, mPart)  # fmt: skip
                # every thread's logits stored before thread 0 counts the CTA in (release)
                cute.arch.fence_acq_rel_gpu()
                cute.arch.barrier()
                tid, _, _ = cute.arch.thread_idx()
                if tid == 0:
                    old = cute.arch.atomic_add(mSig.iterator, Int32(1), sem="acq_rel", scope="gpu")
                    if old == self.NSIG - 1:  # the last router CTA: the logits are complete
                        stamp(mSig, STAMPS["router_done"])
            else:
                self._work(mX, mW, mY, mAcc, mDone, mNorm, bid - self.NSIG + self.NRT_R, 0,
                           self.CPW, self.U, False, mPart)  # fmt: skip

    @cute.jit
    def _work(self, mX, mW, mY, mAcc, mDone, mNorm, t0, kpart, cpw: cutlass.Constexpr[int],
              U: cutlass.Constexpr[int], router: cutlass.Constexpr[bool], mPart):  # fmt: skip
        """One CTA's row tiles ``t0 ..`` (``RT`` of them) over K chunks ``kpart * cpw * NW``
        onward, ``cpw`` per warp; ``router``: partial logits, part ``kpart`` of ``RKS`` (part 0
        into ``y``, the others into ``mPart``)."""
        T, RT, NJ, MP = self.T, self.RT, self.NJ, self.MP
        NT = NW * 32
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        warp = tid // 32
        lane = tid % 32
        g = lane // 4
        c = lane % 4
        smem = cutlass.memory.SmemAllocator()
        sRed = smem.allocate_tensor(
            Float32,
            cute.make_layout((NW, ROWS, MP), stride=(ROWS * MP, MP, 1)),
            byte_alignment=16,
        )
        atom = mc.mma_atom()
        rows = []
        for q in cutlass.range_constexpr(RT):
            t_q = bid * RT + q if const_expr(t0 is None) else t0 + q  # t0 None: bid * RT
            rows.append(cutlass.min(t_q, self.ntiles - 1) * ROWS + g)
        toks = []
        for j in cutlass.range_constexpr(NJ):
            toks.append(cutlass.min(j * 8 + g, T - 1))  # rows past T: computed, never stored
        accs = mc.zero_accs(RT * NJ)
        fa, fb = mc.fragments()
        chunk0 = warp * cpw
        if const_expr(router):
            chunk0 = kpart * (cpw * NW) + warp * cpw
        NS = self.NS
        sR = None
        if const_expr(self.load == "ring"):
            sR = smem.allocate_tensor(BFloat16, mc.ring_layout(NW, NS, 2 * RT, 8), 16)

        def issue(v, slot):
            mc.ring_issue_rows(sR, warp, lane, slot, mW, rows, (chunk0 + v) * KCH + c * 8)

        rstd = []  # FrontMmaNorm: per token tile, the rstd of this lane's token

        ssq = None  # fold: per token tile, this lane's sum of squares of what it loaded
        if const_expr(self.fold):
            ssq = cute.make_rmem_tensor((NJ,), Float32)
            for j in cutlass.range_constexpr(NJ):
                ssq[j] = Float32(0.0)

        def act(k0):
            """The B fragments' loader at column ``k0``: ``j -> 8 activations of toks[j]``."""
            if const_expr(not self.norm):
                return lambda j: mc.load_row8(mX, toks[j], k0)
            gw = cute.make_rmem_tensor((8,), BFloat16)
            cute.autovec_copy(cute.local_tile(mNorm, (8,), (k0 // 8,)), gw)
            if const_expr(self.fold):
                return lambda j: fold_row8(mc.load_row8(mX, toks[j], k0), gw, ssq, j)
            return lambda j: norm_row8(mc.load_row8(mX, toks[j], k0), gw, rstd[j])

        def consume(v, slot):
            k0 = (chunk0 + v) * KCH + c * 8
            mc.ring_mma(atom, accs, fa, fb, sR, warp, lane, slot, RT, NJ, act(k0))

        if const_expr(self.load == "ring"):
            mc.ring_fill(cpw, NS, issue)  # weights: before the wait (never written upstream)
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
        for i in cutlass.range(bid * NT + tid, self.n_acc, self.grid * NT):
            mAcc[i] = Float32(0.0)
        for i in cutlass.range(bid * NT + tid, self.n_done, self.grid * NT):
            mDone[i] = Int32(0)
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()
        if const_expr(self.norm and not self.fold):
            # every token's rstd (r is the previous kernel's output: after the wait)
            sNs = smem.allocate_tensor(Float32, cute.make_layout(NW + MP), byte_alignment=16)
            nv = self.K // 8
            for t in cutlass.range_constexpr(T):
                ss = Float32(0.0)
                for i in cutlass.range_constexpr(-(-nv // NT)):
                    v8 = tid + i * NT
                    if v8 < nv:
                        xr = mc.load_row8(mX, t, v8 * 8)
                        for e in cutlass.range_constexpr(8):
                            xf = xr[e].to(Float32)
                            ss = ss + xf * xf
                ss = block_sum(ss, sNs, NW)
                if tid == 0:
                    sNs[NW + t] = cute.math.rsqrt(ss / Float32(self.K) + Float32(self.eps))
            cute.arch.barrier()
            for j in cutlass.range_constexpr(NJ):
                rstd.append(sNs[NW + toks[j]])

        if const_expr(self.load == "ring"):
            mc.ring_main(cpw, NS, issue, consume)
        else:
            for it in cutlass.range(cpw // U, unroll_full=T <= 16):
                mc.mma_chunks(
                    atom, accs, fa, fb, mW, rows, NJ, U,
                    lambda v, it=it: (chunk0 + it * U + v) * KCH + c * 8,
                    act,
                )  # fmt: skip

        sRs = None
        if const_expr(self.fold):
            # lane (g, c) loaded token toks[j]'s columns 8c..8c+7 of every chunk of its warp's K
            # slice: the 4 lanes of group g together hold the slice's sum of squares (a butterfly
            # over c), the 8 warps' slices meet in shared memory in warp order (the same order,
            # so the same rstd, in every CTA); slot 8j + g holds token toks[j]
            sSq = smem.allocate_tensor(Float32, cute.make_layout((NW, MP), stride=(MP, 1)),
                                       byte_alignment=16)  # fmt: skip
            sRs = smem.allocate_tensor(Float32, cute.make_layout(MP), byte_alignment=16)
            mc.stash_quad_sums(ssq, sSq, warp, g, c, NJ)
            cute.arch.barrier()
            if tid < T:
                tot = Float32(0.0)
                for w in cutlass.range_constexpr(NW):
                    tot = tot + sSq[w, tid]
                sRs[tid] = cute.math.rsqrt(tot / Float32(self.K) + Float32(self.eps))
            cute.arch.barrier()

        # lane (g, c), token tile j: (row g, tokens 8j + 2c + {0, 1}) and (row g + 8, same);
        # the warps' K slices are summed through shared memory, one row tile at a time
        for q in cutlass.range_constexpr(RT):
            for j in cutlass.range_constexpr(NJ):
                mc.stash_acc(sRed, warp, g, c, j, accs[q * NJ + j])
            cute.arch.barrier()
            t = bid * RT + q if const_expr(t0 is None) else t0 + q
            if t < self.ntiles:
                for i in cutlass.range_constexpr(-(-(ROWS * T) // NT)):
                    idx = tid + i * NT
                    if idx < ROWS * T:
                        r = idx % ROWS
                        m = idx // ROWS
                        val = Float32(0.0)
                        for w in cutlass.range_constexpr(NW):
                            val = val + sRed[w, r, m]
                        if const_expr(self.fold):
                            val = val * sRs[m]
                        if const_expr(router):
                            if kpart == 0:
                                mY[m, t * ROWS + r] = val
                            else:
                                mPart[((kpart - 1) * T + m) * (self.NRT_R * ROWS)
                                      + t * ROWS + r] = val  # fmt: skip
                        else:
                            mY[m, t * ROWS + r] = val
            cute.arch.barrier()


class FrontMmaEarly(FrontMma):
    """:class:`FrontMma` whose router row tiles (the first ``n_router`` packed rows) run as
    ``rks`` CTAs each, on ``1 / rks`` of K: part 0 writes its partial logits into ``y``, part
    ``p`` into ``part[p - 1]`` (FP32 ``[rks - 1, T, n_router]``), and each of those ``NSIG``
    CTAs then counts itself into ``sig[0]`` (its stores fenced at GPU scope, an acq_rel atomic).
    All of the launch's CTAs are resident at once at one token (0.5 waves on an H200), so a
    router CTA with a quarter of K is done about a quarter of the way in: the route kernel
    (:class:`.experts_t1.RouteT1Early`), resident beside the front under PDL, sums the parts
    and ranks the token while the front still streams its other rows
    (``DECODESCOPE_MOE_T1_EARLY``, opt-in, session 28; +9 us per MoE layer
    on the H200, s28/n7: the route ranked beside the saturating front)."""

    def __init__(self, T: int, K: int, NF: int, n_acc: int, n_done: int, pdl: bool = True,
                 load: str = "regs", rks: int = 4, n_router: int = 0):  # fmt: skip
        super().__init__(T, K, NF, n_acc, n_done, pdl, load, rks, n_router)
        if rks == 1:
            raise ValueError("front_mma: FrontMmaEarly needs a router split of 2 or 4")

    @cute.jit
    def __call__(self, mX, mW, mY, mAcc, mDone, mPart, mSig, stream):
        self.kernel(mX, mW, mY, mAcc, mDone, mPart, mSig).launch(
            grid=[self.grid, 1, 1], block=[NW * 32, 1, 1], stream=stream, use_pdl=self.pdl
        )

    @cute.kernel
    def kernel(self, mX, mW, mY, mAcc, mDone, mPart, mSig):
        self.body(mX, mW, mY, mAcc, mDone, None, mPart, mSig)


@cute.jit
def stamp(mSig, word: cutlass.Constexpr[int]):
    """The global timer (ns) into ``mSig[word]`` (low 32 bits) and ``mSig[word + 1]`` (high)."""
    from decodescope.kernels.specialized.comm import global_timer_ns

    t = global_timer_ns()
    mSig[word] = Int32(t & cutlass.Int64(0xFFFFFFFF))
    mSig[word + 1] = Int32(t >> cutlass.Int64(32))


def read_stamps(sig: torch.Tensor) -> dict[str, int]:
    """The early route's stamps (ns of the global timer) from its ``sig`` words (host side)."""
    w = sig.detach().to("cpu", torch.int64)
    return {k: int((w[i + 1] << 32) | (w[i] & 0xFFFFFFFF)) for k, i in STAMPS.items()}


class FrontMmaNorm(FrontMma):
    """:class:`FrontMma` on ``h = rmsnorm(r) * norm_w`` (the module docstring); up to
    ``NORM_MAX_T`` tokens."""

    norm = True

    def __init__(self, T: int, K: int, NF: int, n_acc: int, n_done: int, pdl: bool = True,
                 load: str = "regs", eps: float = 1e-5, fold: bool = False):  # fmt: skip
        super().__init__(T, K, NF, n_acc, n_done, pdl, load)
        if T > NORM_MAX_T:
            raise ValueError(f"front_mma with norm_w: 1..{NORM_MAX_T} tokens, got {T}")
        self.eps, self.fold = eps, fold

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,
        mW: cute.Tensor,
        mY: cute.Tensor,
        mAcc: cute.Tensor,
        mDone: cute.Tensor,
        mNorm: cute.Tensor,
        stream,
    ):
        self.kernel(mX, mW, mY, mAcc, mDone, mNorm).launch(
            grid=[self.grid, 1, 1], block=[NW * 32, 1, 1], stream=stream, use_pdl=self.pdl
        )

    @cute.kernel
    def kernel(
        self,
        mX: cute.Tensor,
        mW: cute.Tensor,
        mY: cute.Tensor,
        mAcc: cute.Tensor,
        mDone: cute.Tensor,
        mNorm: cute.Tensor,
    ):
        self.body(mX, mW, mY, mAcc, mDone, mNorm)


@cute.jit
def norm_row8(xb, gw, rstd):
    """``bf16(bf16(x * rstd) * g)`` of 8 activations (vLLM's RMSNorm roundings)."""
    out = cute.make_rmem_tensor((8,), BFloat16)
    for e in cutlass.range_constexpr(8):
        hn = (xb[e].to(Float32) * rstd).to(BFloat16)
        out[e] = (hn.to(Float32) * gw[e].to(Float32)).to(BFloat16)
    return out


@cute.jit
def fold_row8(xb, gw, ssq, j: cutlass.Constexpr):
    """``bf16(x * g)`` of 8 activations; their squares (FP32) added to ``ssq[j]``."""
    out = cute.make_rmem_tensor((8,), BFloat16)
    s = ssq[j]
    for e in cutlass.range_constexpr(8):
        xf = xb[e].to(Float32)
        s = s + xf * xf
        out[e] = (xf * gw[e].to(Float32)).to(BFloat16)
    ssq[j] = s
    return out


def front_fold_ref(r: torch.Tensor, norm_w: torch.Tensor, w_front: torch.Tensor,
                   eps: float = 1e-5) -> torch.Tensor:  # fmt: skip
    """Torch reference of the folded front's math: ``rstd(r) * (bf16(r * norm_w) @ w_front^T)``
    in FP32 (its rounding points; vLLM's RMSNorm then the GEMM differs from it by BF16
    rounding, ~3e-3 relative on the kimi-k3 shapes)."""
    rf = r.float()
    rstd = torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + eps)
    a = (rf * norm_w.float()).to(torch.bfloat16)
    return (a.float() @ w_front.float().T) * rstd


FOLD_ENV = "DECODESCOPE_FRONT_NORM_FOLD"


def fold_enabled() -> bool:
    """``DECODESCOPE_FRONT_NORM_FOLD``: ``1`` runs :class:`FrontMmaNorm` with ``fold`` (the
    squares summed beside the MMAs, rstd in the epilogue); ``0`` / unset the prologue norm."""
    from decodescope.kernels.specialized import env_knobs

    return env_knobs.read(FOLD_ENV, ("0", "1"), "0") == "1"


def _build(T, K, NF, n_acc, n_done, pdl=True, load="regs", norm_eps=None, fold=False,
           early=(1, 0)):  # fmt: skip
    """``norm_eps``: :class:`FrontMmaNorm` with that eps (the norm weights an extra argument),
    ``fold`` its folded form; ``early = (rks, n_router)`` with ``rks > 1``:
    :class:`FrontMmaEarly` (the partial logits and the counter extra arguments)."""
    rks, n_router = early
    if rks > 1:
        op = FrontMmaEarly(T, K, NF, n_acc, n_done, pdl, load, rks, n_router)
    elif norm_eps is None:
        op = FrontMma(T, K, NF, n_acc, n_done, pdl, load)
    else:
        op = FrontMmaNorm(T, K, NF, n_acc, n_done, pdl, load, norm_eps, fold)
    args = (
        itf.fake(torch.bfloat16, (T, K)),
        itf.fake(torch.bfloat16, (NF, K)),
        itf.fake(torch.float32, (T, NF)),
        itf.fake(torch.float32, (n_acc,)),
        itf.fake(torch.int32, (n_done,)),
    )
    if rks > 1:
        args += (
            itf.fake(torch.float32, ((rks - 1) * T * n_router,)),
            itf.fake(torch.int32, (EARLY_SIG_WORDS,)),
        )
    elif norm_eps is not None:
        args += (itf.fake(torch.bfloat16, (K,)),)
    return op, (*args, itf.env_stream())


def mma_load(kernel: str = "front", T: int = 8) -> str:
    """``DECODESCOPE_MOE_MMA_LOAD``: ``auto`` (default), ``regs`` or ``ring``: the weight loads
    of :class:`FrontMma` (``kernel="front"``) and :class:`.back_mma.BackMma` (``"back"``), the
    cp.async ring of :mod:`.mma_common` or registers. ``auto``: the ring for the front, and for
    the back up to 32 tokens (one or two row tiles per CTA). H200 TP8, graph medians
    (notes/gpu-logs/s7/r3): front 37.0 -> 26.2 us at 8 tokens, 63.5 -> 57.2 at 64; back 27.4 ->
    22.0 at 8, 62.4 -> 64.6 at 64 (255 registers and spills with four row tiles); with the
    back's post-norm (s8/r7): 38.7 -> 34.6 at 32 tokens, 48.3 -> 76.3 at 64. Read at each call,
    part of the compile keys."""
    v = mc.load_mode("DECODESCOPE_MOE_MMA_LOAD", "auto", ("auto", *mc.LOADS))
    if v != "auto":
        return v
    return "ring" if kernel == "front" or T <= 32 else "regs"


FRONT_VARIANTS = ("auto", "mma", "simt", "tile")


TILE_FROM = 32  # the auto front takes the tile GEMM from this many tokens (with grouped experts)


def front_variant(T: int, K: int, grouped: bool = False, nf: int = 0) -> str:
    """``DECODESCOPE_MOE_FRONT``: ``auto`` (default), ``mma``, ``simt``
    (:class:`router_topk.FrontGemv`) or ``tile`` (:func:`front_tile`: no zeroing, so only with
    the grouped experts, whose route kernel zeroes ``acc``). ``auto``: ``tile`` from
    ``TILE_FROM`` tokens where the grouped experts run (``grouped``) and the tile GEMM fits the
    shapes (``K`` a multiple of its 64-wide chunk, ``nf`` packed rows a multiple of 16), else
    tensor cores (:class:`FrontMma`) for 1..64 tokens where the shapes allow, else ``simt``. H200 TP8, kernel alone (notes/gpu-logs/s8/r4): tile 37.6 us against FrontMma's
    57.0 at 64 tokens, 26.2 against 25.6 at 8. Read at each call."""
    v = os.environ.get("DECODESCOPE_MOE_FRONT", "auto")
    if v not in FRONT_VARIANTS:
        raise ValueError(f"DECODESCOPE_MOE_FRONT={v!r}: expected one of {FRONT_VARIANTS}")
    if v != "auto":
        return v
    if grouped and TILE_FROM <= T <= 64 and K % tg.BK == 0 and nf > 0 and nf % 16 == 0:
        return "tile"
    # from 1 token since the ring (H200 TP8, 1 token: 28.7 us SIMT, 25.2 ring)
    return "mma" if 1 <= T <= 64 and K % (KCH * NW) == 0 else "simt"


def front_mma(x, w_front, y, acc, done, norm_w=None, eps: float = 1e-5, early=None) -> None:
    """Launch :class:`FrontMma`: ``y = x @ w_front^T`` (FP32), zero ``acc`` and ``done``; with
    ``norm_w`` [K] :class:`FrontMmaNorm`: ``y = (rmsnorm(x) * norm_w) @ w_front^T``; with
    ``early = (rks, n_router, part, sig)`` :class:`FrontMmaEarly` (not with ``norm_w``):
    ``y``'s first ``n_router`` columns hold part 0 of the logits, ``part`` the others, and
    ``sig[0]`` counts the router CTAs done (the route kernel that sums them resets it); the
    other words take the phases' timer stamps (``STAMPS``)."""
    T, K = x.shape
    NF = w_front.shape[0]
    itf.check(x, "x", (T, K), torch.bfloat16)
    itf.check(w_front, "w_front", (NF, K), torch.bfloat16)
    itf.check(y, "y_front", (T, NF), torch.float32)
    pdl = pdl_enabled()
    load = mma_load("front", T)
    if norm_w is not None and early is not None:
        raise ValueError("front_mma: the early router split runs without the norm prologue")
    if norm_w is not None:
        itf.check(norm_w, "norm_w", (K,), torch.bfloat16)
        fold = fold_enabled()
        key = ("moe_front_mma_norm", T, K, NF, acc.numel(), done.numel(), pdl, load, fold, eps)
        fn = itf.compiled(
            key,
            lambda: _build(
                T, K, NF, acc.numel(), done.numel(), pdl, load, norm_eps=eps, fold=fold
            ),  # fmt: skip
        )
        fn(x, w_front, y, acc.view(-1), done.view(-1), norm_w)
        return
    if early is not None:
        rks, n_router, part, sig = early
        itf.check(part, "early part", ((rks - 1) * T * n_router,), torch.float32)
        itf.check(sig, "early sig", (EARLY_SIG_WORDS,), torch.int32)
        key = ("moe_front_mma_early", T, K, NF, acc.numel(), done.numel(), pdl, load, rks,
               n_router)  # fmt: skip
        fn = itf.compiled(
            key,
            lambda: _build(
                T, K, NF, acc.numel(), done.numel(), pdl, load, early=(rks, n_router)
            ),  # fmt: skip
        )
        fn(x, w_front, y, acc.view(-1), done.view(-1), part, sig)
        return
    key = ("moe_front_mma", T, K, NF, acc.numel(), done.numel(), pdl, load)
    fn = itf.compiled(key, lambda: _build(T, K, NF, acc.numel(), done.numel(), pdl, load))
    fn(x, w_front, y, acc.view(-1), done.view(-1))


def tile_plan(T: int, K: int, NF: int) -> tg.TilePlan:
    """The :class:`.tile_gemm.TilePlan` of :func:`front_tile` (FP32 out, the MoE kernels' PDL
    switch ``DECODESCOPE_MOE_PDL``); ValueError where the tile GEMM does not fit the shapes."""
    return tg.TilePlan(m=T, k=K, segments=(NF,), out_f32=True, pdl=pdl_enabled())


def front_tile(x, w_front, y) -> None:
    """``y = x @ w_front^T`` (FP32) through :mod:`.tile_gemm` (one launch; split-K partials in
    its cached workspace). Zeroes nothing: see the module docstring."""
    T, K = x.shape
    NF = w_front.shape[0]
    itf.check(x, "x", (T, K), torch.bfloat16)
    itf.check(w_front, "w_front", (NF, K), torch.bfloat16)
    itf.check(y, "y_front", (T, NF), torch.float32)
    p = tile_plan(T, K, NF)
    tg.tile_gemm(x, [w_front], [y], pdl=p.pdl)


def front_tile_ref(x, w_front) -> torch.Tensor:
    """Torch reference of :func:`front_tile` in its summation order: per split of ``K`` (the
    plan's), the FP32 sum of BF16 products; the splits' partials summed in split order."""
    T, K = x.shape
    p = tile_plan(T, K, w_front.shape[0])
    xs = x.float().split(K // p.splits, dim=1)
    ws = w_front.float().split(K // p.splits, dim=1)
    out = xs[0] @ ws[0].T
    for a, b in zip(xs[1:], ws[1:], strict=True):
        out = out + a @ b.T
    return out
