"""Skinny GEMM for decode: ``out[m, n] = sum_k x'[m, k] * W[n, k]`` with few tokens m (1..64).

One kernel family serves every dense projection of the specialized layers (``norm_qkv_proj``,
``oproj_residual_norm``, MLA's ``q_b``). What it does, per CTA:

- **Tile**: 16 weight rows (``W[n0 : n0 + 16, :]``) by all tokens by all of K. The CTA's ``ks``
  warps split K into contiguous slices; each warp keeps a 16 x M FP32 accumulator in registers;
  the slices are summed through shared memory at the end (no split across CTAs, so no atomics
  and no second launch). Several weight tensors ("segments", e.g. MLA's ``qkv_a`` and
  ``g_proj``) run in one launch: the grid is the concatenation of their row tiles.
- **Tensor cores with swapped operands**: ``mma.sync.m16n8k16`` (bf16 in, fp32 accumulate) with
  the weight rows as the MMA's M (16 rows) and the tokens as its N (8 per MMA, ``ceil(M/8)``
  MMAs per k-step). K is *permuted* inside each 32-wide k-chunk so that every lane fetches its
  A fragment as two 16-byte loads of contiguous weights (rows ``g`` and ``g + 8``, columns
  ``8c .. 8c + 7``) and its B fragment as one 16-byte load of contiguous activations per 8
  tokens: the sum over k does not care about the order, as long as A and B use the same one.
  Lane (g = lane / 4, c = lane % 4) places chunk column ``8c + 4s + {0, 1}`` at MMA k
  ``2c + {0, 1}`` and ``8c + 4s + {2, 3}`` at ``2c + 8 + {0, 1}`` for MMA step s in {0, 1}.
- **Bytes in flight**: ``unroll`` chunks of weights (2 x 16 B per lane per chunk) are loaded
  before their MMAs; 8 warps x 32 lanes x 4 chunks x 32 B = 32 KB per CTA, two or three CTAs
  per SM.
- **Fused prologue** (``norm=True``): residual add (``add_residual``: ``h = bf16(x + r)``, CTA 0
  writes ``h`` as the new residual) and RMSNorm: every CTA computes the per-token ``rstd`` of
  the whole row itself (a redundant read of ``M x K`` activations from L2, cheap next to the
  weights at M <= 16, about as large as the weights' share at M = 64), then normalizes the B
  fragments on the fly: ``bf16(bf16(h * rstd) * w_norm)``, the rounding vLLM's
  ``fused_add_rms_norm`` applies.
- **Fused epilogue** (``residual_epilogue``): ``out = bf16(bf16(acc) + res)``: o_proj writing
  the new residual stream. ``situ``: SiTU-and-mul of a gate/up weight ``[2*D, K]`` (gate rows
  ``0..D-1``, up rows ``D..2D-1``, as vLLM's merged ``gate_up``): each CTA takes ``rt / 2`` gate
  tiles and the matching ``rt / 2`` up tiles, and writes ``out[m, d] = bf16(situ(bf16(g),
  bf16(u)))`` into an ``[M, D]`` output (the dense MLP's w13 + act in one launch). The next RMSNorm needs the whole row (all CTAs' outputs): it is not
  fused here; the next kernel recomputes ``rstd`` in its prologue, as this one does.
- **Weight loads** (``GemmPlan.load``): ``regs`` (the default) loads each group of ``unroll``
  chunks into registers right before its MMAs, so a warp's bytes are in flight only between
  load and MMA. ``ring`` streams every lane's own A-fragment runs (lo / hi per row tile per
  chunk, 2 x ``rt`` 16-byte pieces) through its private slots of a shared-memory ring
  (``cp.async.cg``, :func:`.mma_common.ring_layout` ``[warps, stages, 2 rt, 32 lanes, 8]``
  BF16): ``stages`` chunks in flight per warp at all times, no barriers (a thread's own
  copies are visible to it after ``cp.async.wait_group``). The first ``stages`` chunks are
  issued before the PDL wait (the weights never come from the previous kernel), so they
  stream during the norm prologue. The activations keep the register path, loaded a round
  (``stages`` chunks) ahead of that round's MMAs. A warp's chunks run as a runtime loop over
  rounds of ``stages`` chunks, each round unrolled (constant ring slots), or all unrolled when
  a warp has at most ``ring_unroll`` chunks (``RING_UNROLL_MAX``: every attention shape).
  ``DECODESCOPE_SKINNY_LOAD=regs|ring|auto`` picks the mode of plans with M <= 16 that do not
  set it (``auto``: the ring for long K slices only).

- **Whole-slice L2 prefetch** (``GemmPlan.l2_all``; ``DECODESCOPE_L2_PREFETCH=1``, off by
  default): in regs mode with PDL, each CTA issues one ``cp.async.bulk.prefetch.L2`` per weight
  row it owns (its whole slice) before ``griddepcontrol.wait``, for plans whose weights total at
  most ``L2_PREFETCH_MAX_MB`` (24 MB; ``DECODESCOPE_L2_PREFETCH_MAX_MB``): o_proj (22 MB at TP8)
  and q_b (7 MB) then stream into the 50 MB L2 while the light decode kernel before them runs.
  Every attention grid of this kernel is resident at once (448 CTAs at most, 3-4 per SM), so all
  CTAs prefetch early.
- **Streaming GEMV** (``GemmPlan.gemv``; ``DECODESCOPE_SKINNY_GEMV=N``, default 1, 0 = off):
  plans with ``M <= N`` (N <= 4) that :func:`.gemv_stream.supports` are compiled and launched
  as :class:`.gemv_stream.GemvStream` instead (activations staged and normalized once per CTA
  in shared memory, weights streamed with deep register loads; same contract and reference),
  unless the plan asks for a weight-load mode (``load=`` or ``DECODESCOPE_SKINNY_LOAD``: the
  skinny kernel's own knob, so its sweeps and A/B keep it).

Compile key: (m, k, segment widths, flags, x row stride, load mode, stages, gemv, l2_all).
Shapes are static.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import cuda.bindings.driver as cuda  # noqa: E402
import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import torch  # noqa: E402
from cutlass import BFloat16, Float32  # noqa: E402

from decodescope.kernels.specialized import env_knobs as knob
from decodescope.kernels.specialized import interface as itf
from decodescope.kernels.specialized import mma_common as mc
from decodescope.kernels.specialized.moe_common import situ
from decodescope.kernels.specialized.utils import load_vec8, pdl_begin, pdl_enabled, warp_sum  # noqa: E402

ROWS = 16  # weight rows per CTA (the MMA's M)
KCHUNK = 32  # k per chunk: two m16n8k16 steps
LOAD_ENV = "DECODESCOPE_SKINNY_LOAD"
LOADS = ("regs", "ring")  # weight loads: registers, or the per-lane cp.async ring
RING_STAGES = 4  # chunks in flight per warp in "ring" mode
# "ring": a warp's chunks all unrolled up to this many, else runtime rounds. ptxas sm_90a, KDA
# in_proj TP8 (28 chunks per warp, 4 stages): all unrolled 48 / 60 registers at M = 1 / 8,
# rounds 57 / 68 (notes/specialized.md, "cp.async ring")
RING_UNROLL_MAX = 32


RING_AUTO_MIN_CHUNKS = 16  # "auto": the ring where a warp streams at least this many chunks
GEMV_ENV = "DECODESCOPE_SKINNY_GEMV"  # largest M served by gemv_stream (unset: GEMV_DEFAULT_M)
# gemv_stream serves 1-token plans by default (H200 s10/r2, TP8, kernel alone, us: in_proj 33.5
# -> 24.1, qkv_a+g 24.7 -> 14.5, o_proj 10.5 -> 6.6, q_b 5.1 -> 3.1; at 4 tokens it lost on
# in_proj 42.1 -> 44.5 and o_proj 9.5 -> 11.4: notes/specialized.md, session 10 skinny1)
GEMV_DEFAULT_M = 1
L2_ENV = "DECODESCOPE_L2_PREFETCH"  # 1: whole-slice L2 prefetch before the PDL wait
L2_MAX_ENV = "DECODESCOPE_L2_PREFETCH_MAX_MB"
L2_PREFETCH_MAX_MB = 24.0  # prefetch only projections whose weights fit this (the L2 is 50 MB)


def gemv_max_m() -> int:
    """``DECODESCOPE_SKINNY_GEMV``: plans with M up to this (0..4) go to :mod:`.gemv_stream`
    (unset: ``GEMV_DEFAULT_M`` = 1; 0: none)."""
    from decodescope.kernels.specialized.gemv_stream import MAX_M

    v = os.environ.get(GEMV_ENV, "") or str(GEMV_DEFAULT_M)
    if not v.isdigit() or int(v) > MAX_M:
        raise ValueError(f"{GEMV_ENV}={v!r}: expected 0..{MAX_M} (largest token count served)")
    return int(v)


def l2_prefetch_max_bytes() -> int:
    """Weight bytes up to which a plan prefetches its whole slice into L2 before the PDL wait:
    0 unless ``DECODESCOPE_L2_PREFETCH=1``; ``L2_PREFETCH_MAX_MB`` or
    ``DECODESCOPE_L2_PREFETCH_MAX_MB``."""
    v = os.environ.get(L2_ENV, "") or "0"
    if v not in ("0", "1"):
        raise ValueError(f"{L2_ENV}={v!r}: expected 0 or 1")
    if v == "0":
        return 0
    mb = os.environ.get(L2_MAX_ENV, "") or str(L2_PREFETCH_MAX_MB)
    try:
        return int(float(mb) * 2**20)
    except ValueError:
        raise ValueError(f"{L2_MAX_ENV}={mb!r}: expected a number of MB") from None


def load_mode() -> str:
    """``DECODESCOPE_SKINNY_LOAD``: ``regs`` (default), ``ring``, or ``auto`` (the ring for
    long K slices only: at least ``RING_AUTO_MIN_CHUNKS`` chunks per warp, the K 7168 input
    projections; short streams lost with the ring in GroupedW2 at 1 token), the weight loads of
    the plans with M <= 16 that do not choose (read where a plan is made: part of its key)."""
    return knob.read(LOAD_ENV, (*LOADS, "auto"), "regs")


@dataclass(frozen=True)
class GemmPlan:
    """Compile-time facts of one skinny GEMM launch."""

    m: int  # tokens
    k: int  # reduction length
    segments: tuple[int, ...]  # output widths (rows of each weight), each a multiple of 16
    norm: bool = False  # RMSNorm prologue on x (per-token rstd, times the norm weight)
    add_residual: bool = False  # x' = x + r before the norm; CTA 0 writes it out
    residual_epilogue: bool = False  # out = out + res (same shape as out)
    x_stride: int = 0  # row stride of x in elements (0: compact, = k)
    eps: float = 1e-5
    pdl: bool = field(default_factory=pdl_enabled)  # programmatic dependent launch
    rt_force: int = 0  # row tiles per CTA (0: by M; set by tuning sweeps)
    ks_force: int = 0  # warps per CTA (0: 8 where K allows)
    situ: bool = False  # SiTU-and-mul epilogue over gate/up halves of one segment
    situ_beta: float = 4.0
    situ_lbeta: float = 25.0
    load: str = ""  # "regs" / "ring" ("": $DECODESCOPE_SKINNY_LOAD at M <= 16, else "regs")
    stages: int = RING_STAGES  # "ring": chunks in flight per warp
    ring_unroll: int = RING_UNROLL_MAX  # "ring": all chunks unrolled up to this many per warp
    # served by gemv_stream (None: DECODESCOPE_SKINNY_GEMV decides, unless a weight-load mode
    # was asked for, by ``load`` or DECODESCOPE_SKINNY_LOAD: that asks for this kernel)
    gemv: bool | None = None
    l2_all: bool | None = None  # whole-slice L2 prefetch (None: DECODESCOPE_L2_PREFETCH decides)

    def __post_init__(self) -> None:
        load_asked = bool(self.load) or bool(os.environ.get(LOAD_ENV, ""))
        if not 1 <= self.m <= 64:
            raise ValueError(f"skinny GEMM supports 1..64 tokens, got {self.m}")
        if self.k % KCHUNK:
            raise ValueError(f"K must be a multiple of {KCHUNK}, got {self.k}")
        for n in self.segments:
            if n % ROWS:
                raise ValueError(f"every output width must be a multiple of {ROWS}, got {n}")
        if not 1 <= len(self.segments) <= 3:
            raise ValueError("1..3 segments per launch")
        if self.add_residual and not self.norm:
            raise ValueError("add_residual needs norm (the fused residual-add + RMSNorm)")
        if self.situ:
            if len(self.segments) != 1 or self.segments[0] % (2 * ROWS):
                raise ValueError(
                    f"situ needs one gate/up segment of a multiple of {2 * ROWS} rows, "
                    f"got {self.segments}"
                )
            if self.residual_epilogue:
                raise ValueError("situ and residual_epilogue do not combine")
            if self.rt % 2:
                raise ValueError(f"situ needs an even number of row tiles per CTA, got {self.rt}")
        if not self.load:
            v = load_mode() if self.m <= 16 else "regs"
            if v == "auto":
                v = "ring" if self.chunks_per_warp >= RING_AUTO_MIN_CHUNKS else "regs"
            object.__setattr__(self, "load", v)
        if self.load not in LOADS:
            raise ValueError(f"GemmPlan.load={self.load!r}: expected one of {LOADS}")
        if not 1 <= self.stages <= 8:
            raise ValueError(f"GemmPlan.stages={self.stages}: expected 1..8")
        if self.gemv is None:
            from decodescope.kernels.specialized.gemv_stream import supports

            v = not load_asked and self.m <= gemv_max_m() and supports(self.m, self.k, self.situ)
            object.__setattr__(self, "gemv", v)
        if self.l2_all is None:
            wb = sum(self.segments) * self.k * 2
            object.__setattr__(self, "l2_all", self.pdl and wb <= l2_prefetch_max_bytes())

    @property
    def weight_bytes(self) -> int:
        return sum(self.segments) * self.k * 2

    @property
    def ks(self) -> int:
        """Warps per CTA, each on a contiguous slice of K."""
        chunks = self.k // KCHUNK
        if self.ks_force:
            if chunks % self.ks_force:
                raise ValueError(f"ks_force={self.ks_force} does not divide {chunks} k-chunks")
            return self.ks_force
        for w in (8, 4, 2, 1):
            if chunks % w == 0:
                return w
        return 1

    @property
    def rt(self) -> int:
        """16-row tiles per CTA: each B fragment (activations) feeds ``rt`` MMAs, so the
        activation traffic from L2 (and the prologue's) shrinks by ``rt`` at large M."""
        if self.rt_force:
            return self.rt_force
        if self.m <= 16:
            return 2 if self.situ else 1  # situ: a gate tile and its up tile
        return 2 if self.m <= 32 else 4

    @property
    def unroll(self) -> int:
        per_warp = self.k // KCHUNK // self.ks
        for u in (4, 3, 2, 1):
            if per_warp % u == 0 and u * self.rt <= 4:
                return u
        return 1

    def ctas(self, n: int) -> int:
        """CTAs of a segment of ``n`` rows (the last one may hold fewer than ``rt`` tiles)."""
        if self.situ:  # rt/2 gate tiles + their rt/2 up tiles per CTA
            return -(-(n // 2 // ROWS) // (self.rt // 2))
        return -(-(n // ROWS) // self.rt)

    def out_width(self, n: int) -> int:
        """Columns of a segment's output (``n / 2`` with the SiTU epilogue)."""
        return n // 2 if self.situ else n

    def weight_tile(self, cta, q: int, ntiles: int):
        """The weight row tile that CTA ``cta`` computes as its ``q``-th tile, clamped to a
        valid tile (an invalid one is loaded, never stored). With ``situ``: tiles
        ``0..rt/2-1`` are gate tiles, ``rt/2..rt-1`` the matching up tiles ``D/16`` further."""
        if self.situ:
            h, half = self.rt // 2, ntiles // 2
            return cutlass.min(cta * h + q % h, half - 1) + (q // h) * half
        return cutlass.min(cta * self.rt + q, ntiles - 1)

    @property
    def chunks_per_warp(self) -> int:
        return self.k // KCHUNK // self.ks

    @property
    def ring_stages(self) -> int:
        """Ring slots per warp ("ring"): ``stages``, at most the warp's chunk count."""
        return min(self.stages, self.chunks_per_warp)

    @property
    def ring_rounds(self) -> int:
        """Runtime rounds of ``ring_stages`` chunks that each refill their slots; the chunks
        after them (at most ``2 * ring_stages - 1``) are unrolled at trace time. 0 (all
        unrolled) for up to ``ring_unroll`` chunks per warp."""
        c, ns = self.chunks_per_warp, self.ring_stages
        if c <= self.ring_unroll:
            return 0
        return max(c - ns, 0) // ns

    @property
    def ring_tail(self) -> list[tuple[int, int, list[bool]]]:
        """The trace-time rounds after the runtime ones: ``(first chunk, chunks, refill per
        chunk)``; a refill issues chunk ``+ ring_stages`` into the slot just read."""
        c, ns = self.chunks_per_warp, self.ring_stages
        out = []
        for v0 in range(self.ring_rounds * ns, c, ns):
            n = min(ns, c - v0)
            out.append((v0, n, [v0 + s + ns < c for s in range(n)]))
        return out

    @property
    def ring_bytes(self) -> int:
        """Shared memory of the ring ("ring"; 0 otherwise): 16 B per lane, piece, slot, warp."""
        if self.load != "ring":
            return 0
        return self.ks * self.ring_stages * 2 * self.rt * 32 * 16

    @property
    def ntiles(self) -> int:
        """8-token MMA tiles."""
        return (self.m + 7) // 8

    @property
    def grid(self) -> int:
        return sum(self.ctas(n) for n in self.segments)

    @property
    def ldx(self) -> int:
        return self.x_stride or self.k


class SkinnyGemm:
    """``out_s = x' @ W_s^T`` for each segment s, x' optionally residual-added and RMS-normed."""

    def __init__(self, plan: GemmPlan):
        self.p = plan
        self.threads = plan.ks * 32

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,  # [M, ldx] bf16 (first K columns used)
        mR: cute.Tensor,  # [M, K] residual in (add_residual) else any bf16 placeholder
        mRout: cute.Tensor,  # [M, K] new residual out (add_residual) else placeholder
        mNW: cute.Tensor,  # [K] norm weight (norm) else placeholder
        mW0: cute.Tensor,
        mO0: cute.Tensor,
        mW1: cute.Tensor,
        mO1: cute.Tensor,
        mW2: cute.Tensor,
        mO2: cute.Tensor,
        mE: cute.Tensor,  # [M, N0] residual for the epilogue (residual_epilogue) else placeholder
        stream: cuda.CUstream,
    ):
        p = self.p
        mp = p.ntiles * 8

        @cute.struct
        class Smem:
            rstd: cute.struct.MemRange[Float32, mp]
            red: cute.struct.Align[cute.struct.MemRange[Float32, p.ks * ROWS * mp], 16]
            gate: cute.struct.MemRange[Float32, (p.rt // 2) * ROWS * mp if p.situ else 4]

        self.smem_cls = Smem
        self.kernel(mX, mR, mRout, mNW, mW0, mO0, mW1, mO1, mW2, mO2, mE).launch(
            grid=[p.grid, 1, 1],
            block=[self.threads, 1, 1],
            smem=Smem.size_in_bytes() + (p.ring_bytes + 16 if p.load == "ring" else 0),
            stream=stream,
            use_pdl=p.pdl,
        )

    @cute.kernel
    def kernel(
        self,
        mX: cute.Tensor,
        mR: cute.Tensor,
        mRout: cute.Tensor,
        mNW: cute.Tensor,
        mW0: cute.Tensor,
        mO0: cute.Tensor,
        mW1: cute.Tensor,
        mO1: cute.Tensor,
        mW2: cute.Tensor,
        mO2: cute.Tensor,
        mE: cute.Tensor,
    ):
        p = self.p
        mp = p.ntiles * 8
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = tidx // 32
        lane = tidx % 32

        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(self.smem_cls)
        sRstd = st.rstd.get_tensor(cute.make_layout(mp))
        sRed = st.red.get_tensor(cute.make_layout((p.ks, ROWS, mp), stride=(ROWS * mp, mp, 1)))
        sGate = None
        if cutlass.const_expr(p.situ):
            h = p.rt // 2
            sGate = st.gate.get_tensor(cute.make_layout((h, ROWS, mp), stride=(ROWS * mp, mp, 1)))
        sRing = None
        if cutlass.const_expr(p.load == "ring"):
            sRing = smem.allocate_tensor(
                BFloat16, mc.ring_layout(p.ks, p.ring_stages, 2 * p.rt, 8), 16
            )
            # the weights never come from the previous kernel: the first chunks' copies go
            # out before the PDL wait (and stream during the norm prologue)
            t0 = 0
            for s in cutlass.range_constexpr(len(p.segments)):
                nc = p.ctas(p.segments[s])
                if bidx >= t0 and bidx < t0 + nc:
                    self.ring_fill(sRing, (mW0, mW1, mW2)[s], bidx - t0, p.segments[s] // ROWS,
                                   warp, lane)  # fmt: skip
                t0 += nc

        if cutlass.const_expr(p.pdl and p.load == "regs"):
            # the weights never come from the previous kernel: start pulling this CTA's first
            # chunks into L2 while that kernel finishes, then wait for it
            t0 = 0
            for s in cutlass.range_constexpr(len(p.segments)):
                nc = p.ctas(p.segments[s])
                if bidx >= t0 and bidx < t0 + nc:
                    self.prefetch_weights((mW0, mW1, mW2)[s], bidx - t0, p.segments[s] // ROWS,
                                          warp, lane)  # fmt: skip
                t0 += nc
        if cutlass.const_expr(p.pdl):
            pdl_begin()

        if cutlass.const_expr(p.norm):
            self.prologue(mX, mR, mRout, sRstd, sRed, bidx, warp, lane)
            cute.arch.sync_threads()

        weights = (mW0, mW1, mW2)
        outs = (mO0, mO1, mO2)
        t0 = 0
        for s in cutlass.range_constexpr(len(p.segments)):
            nc = p.ctas(p.segments[s])
            if bidx >= t0 and bidx < t0 + nc:
                self.tile(
                    mX, mR, mNW, sRstd, sRed, sGate, weights[s], outs[s], mE, bidx - t0,
                    p.segments[s] // ROWS, warp, lane, sRing,
                )  # fmt: skip
            t0 += nc

    @cute.jit
    def prefetch_weights(self, mW, cta, ntiles, warp, lane):
        """L2 prefetch of the first ``unroll`` chunks of this warp's K-slice, every row tile."""
        p = self.p
        g = lane // 4
        c = lane % 4
        chunk0 = warp * (p.k // KCHUNK // p.ks)
        if cutlass.const_expr(p.l2_all):
            # the CTA's whole slice: thread j < 16 rt prefetches row j of its tiles (the rows
            # a clamped last CTA repeats are prefetched twice: harmless)
            j = warp * 32 + lane
            if j < ROWS * p.rt:
                row_j = self.p.weight_tile(cta, j // ROWS, ntiles) * ROWS + j % ROWS
                src = cute.local_tile(mW[row_j, None], (p.k,), (0,))
                cute.arch.inline_ptx(
                    "cp.async.bulk.prefetch.L2.global [{$r0}], {$r1};",
                    read_only_args=[src.iterator, cutlass.Int32(p.k * 2)],
                )
        for q in cutlass.range_constexpr(p.rt):
            row = self.p.weight_tile(cta, q, ntiles) * ROWS + g
            for v in cutlass.range_constexpr(p.unroll):
                k0 = (chunk0 + v) * KCHUNK + c * 8
                for hh in cutlass.range_constexpr(2):
                    tile = cute.local_tile(mW[row + 8 * hh, None], (8,), (k0 // 8,))
                    cute.arch.prefetch(tile.iterator.llvm_ptr, cache_level="L2")

    @cute.jit
    def prologue(self, mX, mR, mRout, sRstd, sRed, bidx, warp, lane):
        """Per-token rstd of h = x (+ r); CTA 0 writes h to the new residual.

        Every thread takes a share of every token's row (all of its 16-byte loads in flight at
        once: one L2 round trip at M = 1, where one warp per token took 7), the warps' partial
        sums meet in shared memory (``sRed[w, 0, m]``, free until the main loop)."""
        p = self.p
        nt = self.threads
        tidx = warp * 32 + lane
        nvec = p.k // 8
        per = (nvec + nt - 1) // nt
        for m in cutlass.range(p.m):
            ss = Float32(0.0)
            for i in cutlass.range_constexpr(per):
                kv = tidx + i * nt
                if kv < nvec:
                    xv = cute.make_rmem_tensor((8,), BFloat16)
                    load_vec8(mX[m, None], kv * 8, xv)
                    if cutlass.const_expr(p.add_residual):
                        rv = cute.make_rmem_tensor((8,), BFloat16)
                        load_vec8(mR[m, None], kv * 8, rv)
                        for e in cutlass.range_constexpr(8):
                            xv[e] = (xv[e].to(Float32) + rv[e].to(Float32)).to(BFloat16)
                        if bidx == 0:
                            cute.autovec_copy(xv, cute.local_tile(mRout[m, None], (8,), (kv,)))
                    for e in cutlass.range_constexpr(8):
                        f = xv[e].to(Float32)
                        ss = ss + f * f
            ss = warp_sum(ss)
            if lane == 0:
                sRed[warp, 0, m] = ss
        cute.arch.sync_threads()
        for i in cutlass.range_constexpr((p.m + nt - 1) // nt):
            m = tidx + i * nt
            if m < p.m:
                tot = Float32(0.0)
                for w in cutlass.range_constexpr(p.ks):
                    tot = tot + sRed[w, 0, m]
                sRstd[m] = cute.math.rsqrt(tot / Float32(p.k) + Float32(p.eps))

    def _rows(self, cta, ntiles, g):
        """Base rows (``g`` of each) of the CTA's ``rt`` weight row tiles (trace time)."""
        return [self.p.weight_tile(cta, q, ntiles) * ROWS + g for q in range(self.p.rt)]

    def ring_issue(self, sRing, mW, rows, v, slot: int, warp, lane):
        """cp.async of chunk ``v`` of this warp's K slice (the lane's lo / hi runs of every row
        tile) into ring slot ``slot``; the caller commits the group (trace time)."""
        k0 = (warp * self.p.chunks_per_warp + v) * KCHUNK + (lane % 4) * 8
        for q, r in enumerate(rows):
            for hh in range(2):
                src = cute.local_tile(mW[r + 8 * hh, None], (8,), (k0 // 8,))
                mc.cp_async16(mc.ring_piece(sRing, warp, slot, 2 * q + hh, lane, 8), src)

    @cute.jit
    def ring_fill(self, sRing, mW, cta, ntiles, warp, lane):
        """Chunks ``0 .. ring_stages - 1`` into slots ``0 ..``, one cp.async group each."""
        rows = self._rows(cta, ntiles, lane // 4)
        for v in cutlass.range_constexpr(self.p.ring_stages):
            self.ring_issue(sRing, mW, rows, v, v, warp, lane)
            cute.arch.cp_async_commit_group()

    def ring_round(self, mX, mR, mNW, sRstd, sRing, mW, rows, accs, atom, fa, fb, v0, n: int,
                   refill: list, warp, lane):  # fmt: skip
        """Chunks ``v0 + s``, ``s < n``, in slots ``s`` (``v0`` is a multiple of the stages):
        the activations of all ``n`` chunks are loaded first (one L2 round trip per round),
        then per chunk: wait for its copies, read the weight runs back, MMAs, refill the slot
        with chunk ``v0 + s + stages`` where ``refill[s]`` (trace time)."""
        p = self.p
        ns = p.ring_stages
        g = lane // 4
        c = lane % 4
        chunk0 = warp * p.chunks_per_warp
        bs = []
        for s in range(n):
            b_of = self.b_tiles(mX, mR, sRstd, mNW, g, (chunk0 + v0 + s) * KCHUNK + c * 8, p.norm)
            bs.append([b_of(j) for j in range(p.ntiles)])
        for s in range(n):
            cute.arch.cp_async_wait_group(ns - 1)
            w = []
            for pc in range(2 * p.rt):
                t = cute.make_rmem_tensor((8,), BFloat16)
                cute.autovec_copy(mc.ring_piece(sRing, warp, s, pc, lane, 8), t)
                w.append(t)
            for j in range(p.ntiles):
                tiles = [(w[2 * q], w[2 * q + 1], q * p.ntiles + j) for q in range(p.rt)]
                mc.mma_k16(atom, accs, fa, fb, bs[s][j], tiles)
            if refill[s]:
                self.ring_issue(sRing, mW, rows, v0 + s + ns, s, warp, lane)
            cute.arch.cp_async_commit_group()

    @cute.jit
    def ring_mainloop(self, mX, mR, mNW, sRstd, sRing, mW, rows, accs, atom, fa, fb, warp,
                      lane):  # fmt: skip
        """This warp's K slice through the ring (filled by :meth:`ring_fill`): a runtime loop
        of ``ring_rounds`` unrolled rounds, then the remaining chunks unrolled."""
        p = self.p
        ns = p.ring_stages
        for it in cutlass.range(p.ring_rounds, unroll=1):
            self.ring_round(mX, mR, mNW, sRstd, sRing, mW, rows, accs, atom, fa, fb, it * ns,
                            ns, [True] * ns, warp, lane)  # fmt: skip
        for v0, n, refill in p.ring_tail:
            self.ring_round(mX, mR, mNW, sRstd, sRing, mW, rows, accs, atom, fa, fb, v0, n,
                            refill, warp, lane)  # fmt: skip

    @cute.jit
    def tile(self, mX, mR, mNW, sRstd, sRed, sGate, mW, mO, mE, cta, ntiles, warp, lane, sRing):
        """Row tiles ``cta * rt .. cta * rt + rt - 1`` of one weight (clamped to the last tile
        for loads; only valid tiles are stored)."""
        p = self.p
        rt = p.rt
        g = lane // 4
        c = lane % 4
        atom = mc.mma_atom()
        rows = []
        for q in cutlass.range_constexpr(rt):
            rows.append(p.weight_tile(cta, q, ntiles) * ROWS + g)

        accs = mc.zero_accs(rt * p.ntiles)
        fa, fb = mc.fragments()

        chunks_per_warp = p.k // KCHUNK // p.ks
        u = p.unroll
        chunk0 = warp * chunks_per_warp
        if cutlass.const_expr(p.load == "ring"):
            self.ring_mainloop(mX, mR, mNW, sRstd, sRing, mW, rows, accs, atom, fa, fb, warp,
                               lane)  # fmt: skip
        else:
            # small M: the whole K loop unrolled, so the compiler can issue the next chunks'
            # weight loads ahead of the current MMAs (a runtime loop ends each iteration in a
            # round trip)
            for it in cutlass.range(chunks_per_warp // u, unroll_full=p.m <= 16):
                mc.mma_chunks(
                    atom, accs, fa, fb, mW, rows, p.ntiles, u,
                    lambda v, it=it: (chunk0 + it * u + v) * KCHUNK + c * 8,
                    lambda k0: self.b_tiles(mX, mR, sRstd, mNW, g, k0, p.norm),
                )  # fmt: skip

        # accumulator of lane (g, c), tile j: (row g, tok 8j + 2c + {0,1}), (row g + 8, same).
        # The K-slices of the warps are summed through shared memory, one row tile at a time.
        tidx, _, _ = cute.arch.thread_idx()
        total = ROWS * p.m
        for q in cutlass.range_constexpr(rt):
            for j in cutlass.range_constexpr(p.ntiles):
                mc.stash_acc(sRed, warp, g, c, j, accs[q * p.ntiles + j])
            cute.arch.sync_threads()
            if cutlass.const_expr(p.situ):
                self.situ_store(sRed, sGate, mO, cta, q, ntiles // 2, tidx)
            else:
                t = cta * rt + q
                if t < ntiles:
                    for i in cutlass.range_constexpr((total + self.threads - 1) // self.threads):
                        idx = tidx + i * self.threads
                        if idx < total:
                            r = idx % ROWS
                            m = idx // ROWS
                            val = Float32(0.0)
                            for w in cutlass.range_constexpr(p.ks):
                                val = val + sRed[w, r, m]
                            n = t * ROWS + r
                            if cutlass.const_expr(p.residual_epilogue):
                                val = val.to(BFloat16).to(Float32) + mE[m, n].to(Float32)
                            mO[m, n] = val.to(BFloat16)
            cute.arch.sync_threads()

    @cute.jit
    def situ_store(self, sRed, sGate, mO, cta, q, half, tidx):
        """SiTU epilogue, tile ``q`` summed in ``sRed``: a gate tile (``q < rt/2``) is kept in
        ``sGate`` as bf16-rounded FP32 (what vLLM's GEMM writes); its up tile (``q - rt/2``)
        meets it there (the same thread holds the same (row, token) both times) and the
        product is stored: ``out[m, d] = bf16(situ(g, u))``."""
        p = self.p
        h = p.rt // 2
        total = ROWS * p.m
        t = cta * h + q % h  # the gate tile index (0 .. half - 1)
        if t < half:
            for i in cutlass.range_constexpr((total + self.threads - 1) // self.threads):
                idx = tidx + i * self.threads
                if idx < total:
                    r = idx % ROWS
                    m = idx // ROWS
                    val = Float32(0.0)
                    for w in cutlass.range_constexpr(p.ks):
                        val = val + sRed[w, r, m]
                    val = val.to(BFloat16).to(Float32)
                    if cutlass.const_expr(q < h):
                        sGate[q, r, m] = val
                    else:
                        y = situ(sGate[q - h, r, m], val, p.situ_beta, p.situ_lbeta)
                        mO[m, t * ROWS + r] = y.to(BFloat16)

    def b_tiles(self, mX, mR, sRstd, mNW, g, k0, norm: bool):
        """Trace-time B loader of one K chunk (:func:`mma_common.mma_chunks`): the norm
        weights at ``k0`` (when ``norm``), then ``j -> load_b(token j * 8 + g)``."""
        nw = cute.make_rmem_tensor((8,), BFloat16)
        if norm:
            load_vec8(mNW, k0, nw)
        return lambda j: self.load_b(mX, mR, sRstd, nw, j * 8 + g, k0, j)

    @cute.jit
    def load_b(self, mX, mR, sRstd, nw, m, k0, j):
        """The 8 (normalized) activations of token m at columns k0..k0+7, as bf16 registers."""
        p = self.p
        xv = cute.make_rmem_tensor((8,), BFloat16)
        if cutlass.const_expr(j * 8 + 8 <= p.m):
            self.load_b_row(mX, mR, sRstd, nw, m, k0, xv)
        elif cutlass.const_expr(p.load == "ring"):
            # branch-free (a clamped row, zeroed after): ptxas may then issue these loads early;
            # behind a branch per chunk they were not (H200 sweep: ring in_proj slower at M 1)
            self.load_b_row(mX, mR, sRstd, nw, cutlass.min(m, p.m - 1), k0, xv)
            keep = Float32(1.0)
            if m >= p.m:
                keep = Float32(0.0)
            for e in cutlass.range_constexpr(8):
                xv[e] = (xv[e].to(Float32) * keep).to(BFloat16)
        else:
            xv.fill(0.0)
            if m < p.m:
                self.load_b_row(mX, mR, sRstd, nw, m, k0, xv)
        return xv

    @cute.jit
    def load_b_row(self, mX, mR, sRstd, nw, m, k0, xv):
        p = self.p
        load_vec8(mX[m, None], k0, xv)
        if cutlass.const_expr(p.add_residual):
            rv = cute.make_rmem_tensor((8,), BFloat16)
            load_vec8(mR[m, None], k0, rv)
            for e in cutlass.range_constexpr(8):
                xv[e] = (xv[e].to(Float32) + rv[e].to(Float32)).to(BFloat16)
        if cutlass.const_expr(p.norm):
            rs = sRstd[m]
            for e in cutlass.range_constexpr(8):
                t = (xv[e].to(Float32) * rs).to(BFloat16)
                xv[e] = (t.to(Float32) * nw[e].to(Float32)).to(BFloat16)


# -- torch-facing --------------------------------------------------------------------------

_PLACEHOLDER = (16, 16)


def fake_args(plan, out_width=None):
    """The fake arguments of a skinny GEMM / streaming GEMV kernel (the same signature:
    ``x, residual, residual_out, norm_weight, (weight, out) x 3, epilogue_residual, stream``)
    for ``plan`` (a :class:`GemmPlan` or :class:`.gemv_stream.GemvPlan`); ``out_width(n)``: the
    output width of an ``n``-row segment (default ``n``)."""
    bf = torch.bfloat16
    M, K = plan.m, plan.k
    ph = itf.fake(bf, _PLACEHOLDER)
    x = itf.fake_strided(bf, (M, K), (plan.ldx, 1))
    r = itf.fake(bf, (M, K)) if plan.add_residual else ph
    rout = itf.fake(bf, (M, K)) if plan.add_residual else ph
    nw = itf.fake(bf, (K,)) if plan.norm else itf.fake(bf, (16,))
    segs = []
    for s in range(3):
        if s < len(plan.segments):
            n = plan.segments[s]
            segs += [itf.fake(bf, (n, K)), itf.fake(bf, (M, out_width(n) if out_width else n))]
        else:
            segs += [ph, ph]
    e = itf.fake(bf, (M, plan.segments[0])) if plan.residual_epilogue else ph
    return (x, r, rout, nw, *segs, e, itf.env_stream())


def _fake_args(plan: GemmPlan):
    return fake_args(plan, plan.out_width)


def call(fn, x, weights, outs, residual, residual_out, norm_weight, epilogue_residual) -> None:
    """Run a compiled skinny GEMM / streaming GEMV ``fn`` on torch tensors, placeholders for
    what is absent (the argument order of :func:`fake_args`)."""
    ph = itf.placeholder(x.device, _PLACEHOLDER)
    segs: list[torch.Tensor] = []
    for s in range(3):
        segs += [weights[s], outs[s]] if s < len(weights) else [ph, ph]
    fn(
        x,
        residual if residual is not None else ph,
        residual_out if residual is not None else ph,
        norm_weight if norm_weight is not None else ph[0],
        *segs,
        epilogue_residual if epilogue_residual is not None else ph,
    )


def shape_fields(x, weights, residual, norm_weight, epilogue_residual, eps) -> dict:
    """The plan fields (:class:`GemmPlan`'s and :class:`.gemv_stream.GemvPlan`'s) that the
    tensors of one call decide."""
    M, K = x.shape
    return dict(
        m=int(M),
        k=int(K),
        segments=tuple(int(w.shape[0]) for w in weights),
        norm=norm_weight is not None,
        add_residual=residual is not None,
        residual_epilogue=epilogue_residual is not None,
        x_stride=0 if x.stride(0) == K else int(x.stride(0)),
        eps=float(eps),
    )


def compile_plan(plan: GemmPlan):
    """Compile (cached) the kernel of ``plan`` (:mod:`.gemv_stream`'s where ``plan.gemv``);
    works without a GPU."""
    if plan.gemv:
        from decodescope.kernels.specialized import gemv_stream as gs

        return gs.compile_plan(gs.from_gemm_plan(plan))
    return itf.compiled(("skinny_gemm", plan), lambda: (SkinnyGemm(plan), _fake_args(plan)))


def skinny_gemm(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    outs: list[torch.Tensor],
    *,
    residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    epilogue_residual: torch.Tensor | None = None,
    eps: float = 1e-5,
    rt: int = 0,
    ks: int = 0,
    situ: tuple[float, float] | None = None,
    load: str = "",
    stages: int = RING_STAGES,
    ring_unroll: int = RING_UNROLL_MAX,
    gemv: bool | None = None,
    l2_all: bool | None = None,
) -> None:
    """Run one launch: ``outs[s] = norm(x (+ residual)) @ weights[s]^T (+ epilogue_residual)``.

    ``x`` may be a row slice of a wider buffer (last stride 1, row stride = ``x.stride(0)``).
    With ``residual``, ``residual_out`` receives ``bf16(x + residual)`` (the new residual
    stream); it must not alias ``x`` or ``residual`` (CTA 0 writes it while the others still
    read them). ``rt`` / ``ks`` force the tiling (tuning sweeps; 0 = the plan's choice).
    ``situ=(beta, linear_beta)``: one gate/up weight ``[2D, K]``, ``outs[0]`` is ``[M, D]``
    and receives SiTU-and-mul of the two halves. ``load`` / ``stages`` / ``ring_unroll``: the
    weight loads (:class:`GemmPlan`; ``""``: ``DECODESCOPE_SKINNY_LOAD`` at M <= 16).
    ``gemv`` / ``l2_all``: force the streaming GEMV / the whole-slice L2 prefetch (None: their
    environment knobs).
    """
    plan = GemmPlan(
        **shape_fields(x, weights, residual, norm_weight, epilogue_residual, eps),
        rt_force=rt,
        ks_force=ks,
        situ=situ is not None,
        situ_beta=float(situ[0]) if situ is not None else 4.0,
        situ_lbeta=float(situ[1]) if situ is not None else 25.0,
        load=load,
        stages=stages,
        ring_unroll=ring_unroll,
        gemv=gemv,
        l2_all=l2_all,
    )
    if plan.gemv:
        from decodescope.kernels.specialized import gemv_stream as gs

        gs.launch(gs.from_gemm_plan(plan), x, weights, outs, residual, residual_out,
                  norm_weight, epilogue_residual)  # fmt: skip
        return
    call(compile_plan(plan), x, weights, outs, residual, residual_out, norm_weight,
         epilogue_residual)  # fmt: skip


def skinny_gemm_ref(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    *,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    epilogue_residual: torch.Tensor | None = None,
    eps: float = 1e-5,
    situ: tuple[float, float] | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Torch reference with the kernel's rounding points. Returns ``(outs, residual_out)``."""
    h = x
    rout = None
    if residual is not None:
        h = (x.float() + residual.float()).to(torch.bfloat16)
        rout = h
    if norm_weight is not None:
        hf = h.float()
        rstd = torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
        h = ((hf * rstd).to(torch.bfloat16).float() * norm_weight.float()).to(torch.bfloat16)
    outs = []
    for w in weights:
        o = (h.float() @ w.float().T).to(torch.bfloat16)
        if epilogue_residual is not None:
            o = (o.float() + epilogue_residual.float()).to(torch.bfloat16)
        if situ is not None:
            from decodescope.kernels.reference import situ_ref

            d = o.shape[-1] // 2
            o = situ_ref(o[:, :d].float(), o[:, d:].float(), *situ).to(torch.bfloat16)
        outs.append(o)
    return outs, rout
