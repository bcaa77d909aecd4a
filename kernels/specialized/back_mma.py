"""LatentMoE back on tensor cores: ``out[T, H] = bf16(bf16(rmsnorm(acc) * latent_norm) @
latent_up^T + shared_out)``, the function of ``up_proj_shared_add.UpProjSharedAdd`` (its
reference ``up_proj_shared_add_ref``), with ``mma.sync.m16n8k16`` (from 1 token on since session
7), where the SIMT kernel is bound by FMAs and converts (H200, 14:25 run: 61.4 us at 8 tokens, 381.8 us
at 64, against a ~13 us floor).

Same MMA scheme as :mod:`front_mma` (weight rows as M, tokens as N, K permuted inside each
32-wide chunk so that A and B fragments are 16-byte loads; warps split K; partial sums through
shared memory). The B operand is built on the fly from the FP32 routed sum. Where the per-token
``rstd`` enters (``DECODESCOPE_MOE_BACK_NORM``, :func:`back_norm`):

- ``post`` (the default): each lane turns its 8 FP32 values of token g into
  ``bf16(acc * latent_norm)`` and adds their squares to the token's sum, from the same loads; the
  sums meet across the quad (shuffles) and the warps' K slices (shared memory) after the main
  loop, and the epilogue scales each token's FP32 dot products by its rstd. The per-element
  rounding differs from the reference's ``bf16(acc * rstd * latent_norm)`` by one BF16 rounding
  of a different product: the same function within BF16 tolerances (CPU emulation in the tests,
  H200 checks in notes/specialized_moe.md).
- ``pre``: every CTA first takes the per-token ``rstd`` of ``acc`` (each warp a share of the
  tokens, all of L: a chain of L2 round trips before the first MMA, ~14 us at 64 tokens), then
  feeds ``bf16(acc * rstd * latent_norm)``, the reference's rounding.

The epilogue adds the shared experts' FP32 output and rounds once to BF16.

Launch count: 1 (``DECODESCOPE_MOE_BACK=auto``, the default, from 1 token on; ``simt`` picks
``up_proj_shared_add``).
"""

from __future__ import annotations

import os

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, const_expr

from decodescope.kernels.specialized import back_tile as bt
from decodescope.kernels.specialized import interface as itf
from decodescope.kernels.specialized import mma_common as mc
from decodescope.kernels.specialized.front_mma import mma_load
from decodescope.kernels.specialized.router_topk import pdl_enabled
from decodescope.kernels.specialized.up_proj_shared_add import check_back_args, fake_back_args

ROWS = 16  # MMA M
KCH = 32  # k per chunk: two m16n8k16 steps
NORMS = ("pre", "post")  # where the per-token rstd enters (see the module docstring)


def _warps(L: int) -> int:
    chunks = L // KCH
    for w in (8, 4, 2, 1):
        if chunks % w == 0:
            return w
    return 1


class BackMma:
    """Compile-time facts: T tokens, L latent (K), H hidden (rows), eps."""

    def __init__(self, T: int, L: int, H: int, eps: float, pdl: bool = True, load: str = "regs",
                 norm: str = "post", rt: int = 0, trigger: str = "wait"):  # fmt: skip
        if load not in mc.LOADS:
            raise ValueError(f"back_mma: load {load!r}, expected one of {mc.LOADS}")
        if norm not in NORMS:
            raise ValueError(f"back_mma: norm {norm!r}, expected one of {NORMS}")
        self.load, self.norm = load, norm
        self.NS = 4  # "ring": chunks in flight per warp
        if not 1 <= T <= 64:
            raise ValueError(f"back_mma: 1..64 tokens, got {T}")
        if L % KCH:
            raise ValueError(f"back_mma: latent {L} must be a multiple of {KCH}")
        if H % ROWS:
            raise ValueError(f"back_mma: hidden {H} must be a multiple of {ROWS}")
        self.T, self.L, self.H, self.eps, self.pdl = T, L, H, eps, pdl
        if trigger not in bt.TRIGGERS:
            raise ValueError(f"back_mma: trigger {trigger!r}, expected one of {bt.TRIGGERS}")
        self.trigger = trigger  # where the PDL trigger sits (back_tile.back_trigger)
        self.NW = _warps(L)
        self.NJ = -(-T // 8)
        self.MP = self.NJ * 8
        # row tiles per CTA (0: by token count; an explicit value is for A/Bs)
        self.RT = rt or (1 if T <= 16 else (2 if T <= 32 else 4))
        if self.RT not in (1, 2, 4):
            raise ValueError(f"back_mma: row tiles per CTA must be 1, 2 or 4, got {self.RT}")
        self.ntiles = H // ROWS
        self.grid = -(-self.ntiles // self.RT)
        self.CPW = L // KCH // self.NW
        u = 1
        for c in (4, 3, 2, 1):
            if self.CPW % c == 0 and c * self.RT <= 4:
                u = c
                break
        self.U = u

    @cute.jit
    def __call__(
        self,
        mAcc: cute.Tensor,
        mNW: cute.Tensor,
        mW: cute.Tensor,
        mSh: cute.Tensor,
        mOut: cute.Tensor,
        stream,
    ):
        self.kernel(mAcc, mNW, mW, mSh, mOut).launch(
            grid=[self.grid, 1, 1], block=[self.NW * 32, 1, 1], stream=stream, use_pdl=self.pdl
        )

    @cute.kernel
    def kernel(
        self,
        mAcc: cute.Tensor,
        mNW: cute.Tensor,
        mW: cute.Tensor,
        mSh: cute.Tensor,
        mOut: cute.Tensor,
    ):
        T, L, RT, NJ, MP, U, NW = self.T, self.L, self.RT, self.NJ, self.MP, self.U, self.NW
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
        sRstd = smem.allocate_tensor(Float32, cute.make_layout(MP), byte_alignment=16)
        post = self.norm == "post"
        sSsq = None
        if const_expr(post):  # per-warp partial sums of squares of each token's K slice
            sSsq = smem.allocate_tensor(
                Float32, cute.make_layout((NW, MP), stride=(MP, 1)), byte_alignment=16
            )
        NS = self.NS
        rows = []
        for q in cutlass.range_constexpr(RT):
            rows.append(cutlass.min(bid * RT + q, self.ntiles - 1) * ROWS + g)
        chunk0 = warp * self.CPW
        sR = None
        if const_expr(self.load == "ring"):
            sR = smem.allocate_tensor(BFloat16, mc.ring_layout(NW, NS, 2 * RT, 8), 16)

        def issue(v, slot):
            mc.ring_issue_rows(sR, warp, lane, slot, mW, rows, (chunk0 + v) * KCH + c * 8)

        if const_expr(self.load == "ring"):
            mc.ring_fill(self.CPW, NS, issue)  # weights: before the wait (never written upstream)
        if const_expr(self.pdl):
            # acc is complete only when the expert kernel has finished
            cute.arch.griddepcontrol_wait()
            if const_expr(self.trigger == "wait"):
                cute.arch.griddepcontrol_launch_dependents()
        if const_expr(not post):
            # per-token rstd of the FP32 routed sum (every CTA for all tokens: an L2 read)
            for t in cutlass.range(warp, T, NW, unroll=1):
                ss = Float32(0.0)
                for k8 in cutlass.range(lane, L // 8, 32, unroll=4):
                    v = cute.make_rmem_tensor((8,), Float32)
                    cute.autovec_copy(cute.local_tile(mAcc[t, None], (8,), (k8,)), v)
                    for e in cutlass.range_constexpr(8):
                        ss = ss + v[e] * v[e]
                ss = cute.arch.warp_reduction(ss, lambda a, b: a + b)
                if lane == 0:
                    sRstd[t] = cute.math.rsqrt(ss / Float32(L) + Float32(self.eps))
            cute.arch.barrier()

        atom = mc.mma_atom()
        toks = []
        rstd = []
        for j in cutlass.range_constexpr(NJ):
            tk = cutlass.min(j * 8 + g, T - 1)  # rows past T: computed, never stored
            toks.append(tk)
            if const_expr(not post):
                rstd.append(sRstd[tk])
        ssq = None
        if const_expr(post):
            ssq = cute.make_rmem_tensor((NJ,), Float32)
            ssq.fill(0.0)
        accs = mc.zero_accs(RT * NJ)
        fa, fb = mc.fragments()

        def b_tiles(k0):
            if const_expr(post):
                return _b_loader(mAcc, mNW, toks, k0, ssq=ssq)
            return _b_loader(mAcc, mNW, toks, k0, rstd=rstd)

        def consume(v, slot):
            k0 = (chunk0 + v) * KCH + c * 8
            mc.ring_mma(atom, accs, fa, fb, sR, warp, lane, slot, RT, NJ, b_tiles(k0))

        issued = None
        if const_expr(self.pdl and self.trigger == "issued"):

            def issued():  # this warp's last weight chunk is in flight (first warp: the CTA)
                cute.arch.griddepcontrol_launch_dependents()

        if const_expr(self.load == "ring"):
            mc.ring_main(self.CPW, NS, issue, consume, issued)
        else:
            for it in cutlass.range(self.CPW // U, unroll_full=T <= 16):
                mc.mma_chunks(
                    atom, accs, fa, fb, mW, rows, NJ, U,
                    lambda v, it=it: (chunk0 + it * U + v) * KCH + c * 8,
                    b_tiles,
                )  # fmt: skip

        if const_expr(
            self.pdl
            and (self.trigger == "main" or (self.trigger == "issued" and self.load != "ring"))
        ):
            # every weight load of this CTA has landed (register loads: "issued" is here too):
            # the next layer's first kernel may now become resident (its CTAs park in their own
            # wait during this epilogue)
            cute.arch.griddepcontrol_launch_dependents()

        if const_expr(post):
            # each token's sum of squares: this lane's columns, its quad (the 4 lanes of token
            # g hold 8 columns each of every chunk), then the warps' K slices in the epilogue
            mc.stash_quad_sums(ssq, sSsq, warp, g, c, NJ)
            cute.arch.barrier()
            for m in cutlass.range(tid, MP, NT, unroll=1):
                ss = Float32(0.0)
                for w in cutlass.range_constexpr(NW):
                    ss = ss + sSsq[w, m]
                sRstd[m] = cute.math.rsqrt(ss / Float32(L) + Float32(self.eps))
            # the stash loop's first barrier orders these writes before the epilogue's reads

        for q in cutlass.range_constexpr(RT):
            for j in cutlass.range_constexpr(NJ):
                mc.stash_acc(sRed, warp, g, c, j, accs[q * NJ + j])
            cute.arch.barrier()
            t = bid * RT + q
            if t < self.ntiles:
                for i in cutlass.range_constexpr(-(-(ROWS * T) // NT)):
                    idx = tid + i * NT
                    if idx < ROWS * T:
                        r = idx % ROWS
                        m = idx // ROWS
                        val = Float32(0.0)
                        for w in cutlass.range_constexpr(NW):
                            val = val + sRed[w, r, m]
                        n = t * ROWS + r
                        if const_expr(post):
                            val = val * sRstd[m]
                        mOut[m, n] = (val + mSh[m, n]).to(BFloat16)
            cute.arch.barrier()


def _b_loader(mAcc, mNW, toks, k0, rstd=None, ssq=None):
    """Trace-time B loader of one K chunk (:func:`mma_common.mma_chunks`): loads the norm
    weights at ``k0``, returns ``j -> bf16(acc[token j] * rstd * w_norm)`` (8 values) with
    ``rstd`` (``norm="pre"``), or ``j -> bf16(acc[token j] * w_norm)`` adding the FP32 values'
    squares to ``ssq[j]`` (``norm="post"``: each (token, column) is loaded once per CTA)."""
    nw = cute.make_rmem_tensor((8,), BFloat16)
    cute.autovec_copy(cute.local_tile(mNW, (8,), (k0 // 8,)), nw)

    def b_of(j):
        xf = cute.make_rmem_tensor((8,), Float32)
        cute.autovec_copy(cute.local_tile(mAcc[toks[j], None], (8,), (k0 // 8,)), xf)
        xb = cute.make_rmem_tensor((8,), BFloat16)
        s = ssq[j] if ssq is not None else None
        for e in range(8):
            if ssq is not None:
                s = s + xf[e] * xf[e]
            v = xf[e] * rstd[j] if rstd is not None else xf[e]
            xb[e] = (v * nw[e].to(Float32)).to(BFloat16)
        if ssq is not None:
            ssq[j] = s
        return xb

    return b_of


def _build(T, L, H, eps, pdl=True, load="regs", norm="post", rt=0, trigger="wait"):
    op = BackMma(T, L, H, eps, pdl, load, norm, rt, trigger)
    return op, (*fake_back_args(T, L, H), itf.env_stream())


BACK_VARIANTS = ("auto", "mma", "simt", "tile", "gemv")


def back_variant(T: int, L: int, H: int) -> str:
    """``DECODESCOPE_MOE_BACK``: ``auto`` (default: :mod:`.back_tile` from its ``TILE_FROM``
    tokens where set and the shapes fit, else this kernel for 1..64 tokens where the shapes
    allow, ``up_proj_shared_add`` otherwise), ``mma`` (this kernel), ``simt``
    (``up_proj_shared_add``) or ``tile`` (:func:`.back_tile.back_tile`, the tile GEMM: ``auto``
    from 32 tokens since s9/r2, 22.8 / 36.9 us against this kernel's 33.9 / 48.2 at 32 / 64
    tokens, H200 TP8). Read at each call. H200, TP8 (notes/specialized_moe.md): 25.4 / 61.7 us at 8 / 64 tokens against
    61.0 / 383.6 for ``up_proj_shared_add``. ``gemv``: :class:`.gemv_stream.GemvStreamBack`
    where it serves the shapes (1..4 tokens), else as ``auto``."""
    v = os.environ.get("DECODESCOPE_MOE_BACK", "auto")
    if v not in BACK_VARIANTS:
        raise ValueError(f"DECODESCOPE_MOE_BACK={v!r}: expected one of {BACK_VARIANTS}")
    if v == "gemv":
        from decodescope.kernels.specialized import gemv_stream as gs

        if gs.back_supports(T, L, H):
            return "gemv"
        v = "auto"
    if v == "auto":  # from 1 token since the ring (H200 TP8, 1 token: 22.6 us SIMT, 18.8 ring)
        if bt.TILE_FROM is not None and T >= bt.TILE_FROM and bt.fits(T, L, H):
            return "tile"
        return "mma" if 1 <= T <= 64 and L % KCH == 0 and H % ROWS == 0 else "simt"
    return v


def back_norm() -> str:
    """``DECODESCOPE_MOE_BACK_NORM``: ``post`` (default: the MMAs take ``bf16(acc * w)``, the
    sums of squares accumulate from the same loads and the epilogue scales by rstd) or ``pre``
    (every CTA first takes each token's rstd in a pass over ``acc``, then feeds
    ``bf16(acc * rstd * w)`` to the MMAs). H200 TP8, kernel alone, graph medians
    (notes/gpu-logs/s8/r1): 62.6 -> 48.6 us at 64 tokens, 21.2 -> 19.0 at 8; whole steps TP8
    1x1/8x1/64x1/8x8 and tp_world 2 at 1/8/64 PASS. Read at each call; part of the compile
    key."""
    v = os.environ.get("DECODESCOPE_MOE_BACK_NORM", "post")
    if v not in NORMS:
        raise ValueError(f"DECODESCOPE_MOE_BACK_NORM={v!r}: expected one of {NORMS}")
    return v


def back_rt() -> int:
    """``DECODESCOPE_MOE_BACK_RT``: row tiles per CTA, ``0`` (default: 1 up to 16 tokens, 2 up to
    32, 4 above) or 1, 2, 4 (an A/B knob: 2 at 64 tokens lost on the H200, 70.8 against 48.6 us,
    notes/gpu-logs/s8/r1). Read at each call; part of the compile key."""
    v = os.environ.get("DECODESCOPE_MOE_BACK_RT", "0") or "0"
    if v not in ("0", "1", "2", "4"):
        raise ValueError(f"DECODESCOPE_MOE_BACK_RT={v!r}: expected 0 (by tokens), 1, 2 or 4")
    return int(v)


# the trigger's knob, shared with back_tile (one definition: bt.back_trigger)
LATE_ENV, LATE_FROM, back_trigger = bt.LATE_ENV, bt.LATE_FROM, bt.back_trigger


def back_mma(acc, latent_norm, latent_up, shared_out, out, eps: float) -> None:
    """Launch :class:`BackMma` (same arguments as ``up_proj_shared_add``)."""
    T, L, H = check_back_args(acc, latent_norm, latent_up, shared_out, out)
    pdl = pdl_enabled()
    load = mma_load("back", T)
    norm = back_norm()
    rt = back_rt()
    trig = back_trigger(T)
    key = ("moe_back_mma", T, L, H, float(eps), pdl, load, norm, rt, trig)
    fn = itf.compiled(key, lambda: _build(T, L, H, float(eps), pdl, load, norm, rt, trig))
    fn(acc, latent_norm, latent_up, shared_out, out)
