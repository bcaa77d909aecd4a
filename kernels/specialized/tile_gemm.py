"""Tiled GEMM for 1..64 tokens: weights and activations both streamed through a multi-stage
``cp.async`` shared-memory pipeline, ``mma.sync.m16n8k16`` from shared memory, split-K across
CTAs with a partial-sum reduction by the last CTA of each row tile.

``out[m, n] = sum_k x[m, k] * W[n, k]`` (BF16 in, FP32 accumulate, BF16 out), the projections
of the attention half at 8..64 tokens (issue #5). Why another kernel: :mod:`.skinny_gemm` is
GEMV-shaped (each warp fetches its activation fragments from L2 per chunk: at 64 tokens every
CTA re-reads 64 x K activations) and :mod:`.splitk_gemm` stages the activations once per CTA
but streams the weights with per-lane register loads (32 KB in flight per CTA). Here, per CTA:

- **Tile**: ``warps`` x 32 weight rows (each warp two 16-row MMA tiles, default 4 warps = 128
  rows) by all tokens (padded to 8), one K-slice of ``K / splits`` columns, walked in 64-wide
  chunks. Grid (row tiles of all segments, splits); ``splits`` is the smallest divisor of the
  chunk count that gives at least one CTA per SM.
- **Pipeline**: ``stages`` shared-memory buffers of (128 weight rows + MP tokens) x 64 BF16
  (24 KB at 64 tokens; 4 stages = 96 KB, two CTAs per SM). Each thread issues 16-byte
  ``cp.async.cg`` copies (8 consecutive threads read one row's 128 contiguous bytes); chunk
  ``i + stages - 1`` is issued while chunk ``i`` is multiplied, so ``stages - 1`` chunks per
  CTA (48 KB of weights at the default) are in flight. Rows past the segment end and tokens
  past ``m`` are not loaded (their outputs are never stored; an MMA row/column only feeds the
  same output row/column). With PDL the first chunks' weights are issued before the wait for
  the previous kernel (they never come from it); the activations after it.
- **Shared-memory swizzle**: the 16-byte unit ``u`` of row ``r`` is stored at unit
  ``(u + 4 * (r % 2)) % 8`` (128-byte rows, no padding): a quarter warp reads rows ``g`` and
  ``g + 1`` at units ``c`` (or ``4 + c``), which land in opposite bank halves.
- **Fragments**: the K permutation of :mod:`.skinny_gemm` (lane (g, c) loads 8 contiguous
  columns ``8c .. 8c + 7`` of each 32-wide half chunk: one 16-byte ``ld.shared`` per weight
  row and per 8 tokens) and the :mod:`.mma_common` MMA helpers: weight rows are the MMA's M,
  tokens its N. Per chunk a warp reads 4 KB of weights and MP x 128 B of activations from
  shared memory.
- **Split-K reduction** (``splits > 1``): each split stores its FP32 partial tile
  (``[split, token, row]``, no atomics), the CTA bumps the row tile's counter (acq_rel), the last
  one sums the partials and runs the epilogue (and zeroes the counter: graph replay safe).
  With ``splits == 1`` the accumulators are stored directly.
- **Epilogue**: ``bf16(acc)``, or with ``residual_epilogue`` ``bf16(bf16(acc) + res)``
  (o_proj writing the new residual stream; ``res`` may alias the output), or with ``out_f32``
  the FP32 sum itself (FP32 outputs; the LatentMoE front, ``front_mma.front_tile``: router
  logits stay FP32 for the top-k).
- **Norm prologue as its own launch**: the RMSNorm of the input (optional residual add first)
  runs as :class:`.rmsnorm.RMSNorm` (one CTA per token, compiled here with a strided input so
  that MLA's ``q_a`` slice works) into a cached ``[M, K]`` buffer, which this GEMM then reads
  with ``cp.async``. Fusing it would need the activations transformed between global and
  shared memory (no ``cp.async``) or a per-CTA rstd pass (M x K reads per CTA); the extra
  launch reads M x K x 2 (or 3) x 2 bytes once (0.9 MB at 64 tokens) and keeps the rounding
  of vLLM's ``fused_add_rms_norm``: ``bf16(bf16(h * rstd) * w)``.
- **Norm folded into the GEMM** (``rms_fold``, :func:`folds`: by default from 16 tokens; a norm without a
  residual add: MLA's q_b): ``out[m, n] = rstd[m] * sum_k x[m, k] * (g[k] W[n, k])``. The norm
  weight is folded into a derived weight once (:func:`fold_norm_weight`, ``bf16(W * g)``: no
  per-chunk work, one rounding where vLLM has ``bf16(bf16(x * rstd) * g)``; scaling the B
  fragments instead would cost every warp ~2 instructions per activation element and chunk).
  Each thread adds the squares of the activation units its own ``cp.async`` staged (after its
  wait, before the barrier), the 8 threads of a token row reduce by butterfly, and the CTA's
  sums go beside the split-K partials (workspace rows after them, ``[row tile, split, token]``);
  the reducing CTA turns them into ``rsqrt(ss / K + eps)`` (split order) and scales the summed
  partials before the rounding. One launch instead of two; x is read raw (strided q_a).

``ldsm`` (``TilePlan.ldsm``, read when a plan is built: ``DECODESCOPE_TILE_LDSM=1`` / ``0``
everywhere / nowhere; unset: on for o_proj, the residual-epilogue plans, from
``LDSM_EPI_MIN_M`` (32) tokens since s10/r2, off elsewhere): the fragments by ``ldmatrix.x4`` (A: one per 16-row tile and 16-wide K step; B:
two token tiles per instruction), K in natural order, unit ``u`` of row ``r`` stored at
``u ^ (r % 8)`` in both buffers (the 8 rows of a matrix hit 8 bank groups). The default path
re-assembles the A fragment for every MMA (``mma_common.mma_k16``: ~4 register moves per MMA);
SASS of the MoE front's plan at 64 tokens (ptxas 13.0, cuobjdump): 872 instructions, 231
moves, 148 registers by default; 648, 7 moves, 128 registers with ``ldsm``. The default
plans' PTX is unchanged by the knob's code (normalised PTX compared).

Split-K epilogue (read when a plan is built): ``TilePlan.epi_hoist`` (the default since s10/r2;
``DECODESCOPE_TILE_EPI_HOIST=0`` turns it off) issues the residual epilogue's loads with the
partials' (clamped, outside the store branch). Without it the SASS of o_proj at 64
tokens (ptxas 13.0, this CPU) loads each step's residual after the previous step's store: the
output may alias the residual, so nothing moves a load above a store, and every step of a
batch pays its own memory round trip after the partials' (16 steps of 4 rows per thread at 64
tokens, 8 at 32, 2 at 8). H200 s10/r2, o_proj alone at 64 / 32 tokens: 17.9 / 11.9 us ->
hoist 15.0 / 10.5, hoist + ldsm 13.0 at 64 (cuBLAS 9.0 / 8.7). ``DECODESCOPE_TILE_EPI_BATCH=N``
(``epi_batch``, default 4): steps whose loads go out together.

Warpgroup MMAs (``TilePlan.wgmma``; :func:`wgmma_default`, ``DECODESCOPE_TILE_WGMMA``; the
default from ``WGMMA_MIN_M`` = 32 tokens, the folded norm included): the same cp.async
stages, stored with the ``ldsm`` placement (which is the 128-byte swizzle), 1024-byte aligned,
read by ``wgmma.mma_async.m64nNk16`` through shared-memory descriptors (:func:`smem_desc`), one
PTX block per chunk (:func:`wgmma_chunk_ptx`: 2 M blocks x 4 K steps, committed and waited for),
a ``fence.proxy.async`` before the chunk's barrier. A 64-row block's accumulators hold, per warp,
its 16 rows in ``mma.sync``'s 16 x 8 fragment order, so every epilogue is shared
(:meth:`TileGemm.tile_row` maps the rows). About 10 instructions per thread and chunk instead
of ~650-870 per warp; H200 numbers beside ``WGMMA_MIN_M``.

Split-K through a thread-block cluster (``TilePlan.cluster``; :func:`cluster_default`,
``DECODESCOPE_TILE_CLUSTER``; the default since the H200 A/B beside ``CLUSTER_MIN_M``): the ``splits`` CTAs of a row tile form one cluster ``(1, splits,
1)`` (2..8 CTAs). After the K loop each CTA leaves its FP32 partial tile ``[token, row]`` (row
stride ``cta_rows + 4``: the accumulator stores hit 32 distinct banks) and, with ``rms_fold``,
its tokens' sums of squares in its own shared memory, in the stage buffers it no longer needs;
one cluster barrier publishes them, and CTA ``s`` of the cluster reduces the tokens ``t`` with
``t % splits == s`` over all the splits (``ld.shared::cluster``, split order: the same sums as
the workspace path) and runs the epilogue for them. A second barrier, waited for before exit,
keeps every CTA's shared memory alive while the others read it. No workspace round trip through
L2, no counter, and the epilogue spread over the cluster's CTAs instead of the last CTA alone
(at 64 tokens it reads ``splits x 32 KB`` of partials there).

Selection (:func:`selected`): ``DECODESCOPE_ATTN_GEMM`` = ``tile`` (this kernel for every
attention projection at 1..64 tokens), ``auto`` (the default since the H200 A/B: from 8
tokens on, q_b only with its norm folded, :func:`folds`: from 16 tokens by default),
``default`` (the skinny / split-K choice); ``DECODESCOPE_TILE_NORM`` (:func:`norm_mode`).
Compile key: the plan (every shape static).
"""

# no `from __future__ import annotations`: the Smem struct reads its field annotations
import os
import weakref
from dataclasses import dataclass, field

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32, Int64

from decodescope.kernels.specialized import interface as itf
from decodescope.kernels.specialized import mma_common as mc
from decodescope.kernels.specialized import rmsnorm as rms
from decodescope.kernels.specialized import splitk_gemm as sk
from decodescope.kernels.specialized.mla_decode_tc import ld_cluster_f32, ld_cluster_v4f32, mapa
from decodescope.kernels.specialized.utils import pdl_begin, pdl_enabled

BK = 64  # K columns per chunk (128-byte rows in shared memory)
RT = 2  # 16-row MMA tiles per warp
WARP_ROWS = 16 * RT
NUM_SMS = 132
MODES = ("default", "tile", "auto")
# The tile kernel from this many tokens. 1 was tried (7b67293): the attention halves alone were
# faster at TP8 1x1 (KDA 53.0 -> 51.0 us, MLA 64.0 -> 61.5; notes/gpu-logs/s7/r5), but in the
# bench at TP8 batch 1 the dense layer went 113.0 -> 152.0 us and the KDA layer 186.8 -> 202.0
# (with the MoE front/back change of the same commit; s7/r6), so 8 stays until an A/B of
# whole layers separates the two.
AUTO_MIN_M = 8
EPI_BATCH = 4  # epilogue steps whose partial loads are issued together
SMEM_2CTA = 113 * 1024  # shared memory per CTA that leaves room for two CTAs per SM
SW128_ALIGN = 1024  # alignment of the wgmma operand buffers (8 rows of 128 bytes)


# warpgroup MMAs (TilePlan.wgmma) from this many tokens by default (None: off unless
# DECODESCOPE_TILE_WGMMA=1), every plan kind (the folded norm and the back tile included).
# H200 s23/w1, GEMM alone, graph medians, mma.sync -> wgmma (notes/gpu-logs/s23/w1): at 64
# tokens the MoE front TP16 36.7 -> 30.1 us, TP8 37.7 -> 32.0; qkv_a + g_proj 30.8 -> 24.7 /
# 31.1 -> 28.1; in_proj 30.2 -> 25.8 / 45.1 -> 38.4; o_proj 10.6 -> 10.2 / 13.0 -> 12.8; q_b
# with the folded norm then slower (workspace split-K, 24 splits). With the cluster split-K
# (s24/n1) wgmma won alone at 32 tokens and for q_b and the back tile at 64 too; in the layers
# (s25/n1, same call, specialized alone, DECODESCOPE_TILE_WGMMA unset -> 1, i.e. 64 -> every
# plan from 32): TP16 batch 32 KDA 398.7 -> 398.0 us, MLA 409.6 -> 406.7, dense 77.6 -> 76.6;
# batch 64 KDA 561.2 -> 559.3, MLA 570.8 -> 564.6; TP8 batch 32 KDA 737.3 -> 736.6, MLA 712.5
# -> 711.4; batch 64 KDA 1068.5 -> 1065.9, MLA 1009.3 -> 1003.6 (dense 148.2 -> 148.5)
WGMMA_MIN_M: int | None = 32
WGMMA_ENV = "DECODESCOPE_TILE_WGMMA"
# split-K through a thread-block cluster (TilePlan.cluster) from this many tokens by default
# (None: off unless DECODESCOPE_TILE_CLUSTER=1). H200 s24/n1, GEMM alone, graph medians, knob
# 0 -> 1 (notes/gpu-logs/s24): TP16 64 tokens (wgmma) the MoE front 28.8 -> 25.4 us, qkv_a + g
# 24.9 -> 22.8, o_proj 10.3 -> 6.6, in_proj 26.2 -> 23.6, q_b folded 13.7 -> 5.3, the back tile
# 30.4 -> 22.6; every case at 8 / 32 tokens gained 0.15-5 us; in the layers (n3, same call)
# TP16 batch 64 KDA 581.2 -> 568.5, MLA 611.4 -> 580.2, every point of batch 8 / 32 / 64 gained
CLUSTER_MIN_M: int | None = 1
CLUSTER_ENV = "DECODESCOPE_TILE_CLUSTER"
CLUSTER_MAX = 8  # portable cluster size: the splits of one row tile in one cluster
PART_PAD = 4  # floats past each token row of a cluster partial tile (bank spread)


def wgmma_default(m: int) -> bool:
    """``DECODESCOPE_TILE_WGMMA``: ``1`` warpgroup MMAs in every plan that can take them, ``0``
    in none, unset: from ``WGMMA_MIN_M`` tokens. Read when a plan is built (part of its key)."""
    env = os.environ.get(WGMMA_ENV, "")
    if env not in ("", "0", "1"):
        raise ValueError(f"{WGMMA_ENV}: 0 or 1, got {env!r}")
    if env:
        return env == "1"
    return WGMMA_MIN_M is not None and m >= WGMMA_MIN_M


def cluster_default(m: int) -> bool:
    """``DECODESCOPE_TILE_CLUSTER``: ``1`` the cluster split-K wherever a plan can take it
    (:class:`TilePlan` checks: 2..``CLUSTER_MAX`` splits, the partial tile in the stages; its
    splits are then chosen among those), ``0`` nowhere, unset: from ``CLUSTER_MIN_M`` tokens
    (off while that is None)."""
    env = os.environ.get(CLUSTER_ENV, "")
    if env not in ("", "0", "1"):
        raise ValueError(f"{CLUSTER_ENV}: 0 or 1, got {env!r}")
    if env:
        return env == "1"
    return CLUSTER_MIN_M is not None and m >= CLUSTER_MIN_M


SQ_MMA_ENV = "DECODESCOPE_TILE_SQ_MMA"


def _sq_mma_env() -> bool:
    """``DECODESCOPE_TILE_SQ_MMA``: ``1`` the folded norm's squares inside the wgmma block
    (:attr:`TilePlan.sq_in_mma`), unset or ``0`` before the chunk's barrier (H200 s25/n4, the
    dense tile's fold alone at TP16, 0 -> 1: 21.2 -> 21.2 us at 32 tokens, 26.5 -> 26.8 at 64:
    no gain, so off by default)."""
    from decodescope.kernels.specialized import env_knobs

    return env_knobs.read(SQ_MMA_ENV, ("0", "1"), "0") == "1"


def mode() -> str:
    m = os.environ.get("DECODESCOPE_ATTN_GEMM", "") or "auto"
    if m not in MODES:
        raise ValueError(f"DECODESCOPE_ATTN_GEMM: one of {MODES}, got {m!r}")
    return m


NORM_MODES = ("auto", "launch", "fold", "fold_all")
# auto: q_b's norm folded into the tile GEMM from this many tokens (lead's default for the s10/r3
# bench, from the s10/r2 checks; below, the skinny kernel with its norm prologue: ~5.6 us at 8)
FOLD_MIN_M = 16
# o_proj (residual epilogue): ldmatrix fragments from this many tokens unless
# DECODESCOPE_TILE_LDSM says otherwise (s10/r2, 64 tokens: hoist 15.0 -> hoist + ldsm 13.0 us)
LDSM_EPI_MIN_M = 32


def norm_mode() -> str:
    """``DECODESCOPE_TILE_NORM``: ``auto`` (the default: a norm without a residual add, MLA's
    q_b, folded into the tile GEMM from ``FOLD_MIN_M`` tokens, ``TilePlan.rms_fold``: one
    launch), ``launch`` (the old default: never folded; a norm runs as its own launch where the
    tile kernel serves it, and ``DECODESCOPE_ATTN_GEMM=auto`` keeps short-K ones off the tile
    kernel), ``fold`` (q_b folded from ``AUTO_MIN_M`` tokens) or ``fold_all`` (also the norms
    with a residual add: KDA in_proj, MLA qkv_a + g_proj lose their norm launch)."""
    m = os.environ.get("DECODESCOPE_TILE_NORM", "") or "auto"
    if m not in NORM_MODES:
        raise ValueError(f"DECODESCOPE_TILE_NORM: one of {NORM_MODES}, got {m!r}")
    return m


def folds(norm: bool, residual: bool | None, m: int = 64) -> bool:
    """Whether an ``m``-token projection's norm is folded into the tile GEMM
    (``DECODESCOPE_TILE_NORM``): ``auto`` a norm without a residual add from ``FOLD_MIN_M``
    tokens, ``fold`` one without a residual add, ``fold_all`` every norm, ``launch`` none.
    ``residual`` None (a caller that does not say) counts as a residual add."""
    md = norm_mode()
    if not norm or md == "launch":
        return False
    if md == "fold_all":
        return True
    return residual is False and (md == "fold" or m >= FOLD_MIN_M)


def selected(m: int, k: int, norm: bool = False, residual: bool | None = None) -> bool:
    """Whether the tile kernel serves an ``m x k`` projection (``DECODESCOPE_ATTN_GEMM``).

    ``auto`` (the default) follows the H200 A/B (TP8, notes/specialized.md, round 4 outcome):
    the tile kernel from ``AUTO_MIN_M`` (8) tokens on, except a short-K projection with the
    norm prologue (MLA's q_b, K 1536): its separate norm launch costs more than the GEMM saves below 32
    tokens (7.0 vs 5.6 us at 8), and from 32 on (9.4 vs 17.7 us) it would take the MLA layer
    with the grouped experts to 12 launches, over issue 5's 11. Where :func:`folds` says so
    (by default q_b from ``FOLD_MIN_M`` tokens) such a norm is folded into the GEMM (no extra
    launch), so q_b is served too."""
    md = mode()
    if md == "default" or k % BK or not 1 <= m <= 64:
        return False
    if md == "tile":
        return True
    return m >= AUTO_MIN_M and (k >= 4096 or not norm or folds(norm, residual, m))


@dataclass(frozen=True)
class TilePlan:
    m: int
    k: int
    segments: tuple[int, ...]  # output widths, each a multiple of 16
    residual_epilogue: bool = False
    out_f32: bool = False  # FP32 outputs, the sum unrounded (no residual epilogue)
    x_stride: int = 0  # row stride of the GEMM's input (0: compact)
    pdl: bool = field(default_factory=pdl_enabled)
    splits_force: int = 0
    warps: int = 4
    stages: int = 0  # 0: 4, or 3 where a residual fold's 4 would not leave two CTAs per SM
    # ldmatrix fragments (natural K order, unit u of row r at u ^ (r % 8)); None: resolved when
    # the plan is built (so a plan key says which it is): DECODESCOPE_TILE_LDSM=1 / 0 everywhere
    # / nowhere, unset: residual-epilogue plans (o_proj) from LDSM_EPI_MIN_M tokens, others off
    ldsm: bool | None = None
    # warpgroup MMAs (``wgmma.mma_async`` m64nNk16, both operands from the swizzled shared
    # memory by descriptors) instead of the warps' ``mma.sync``; None: resolved when the plan is
    # built (:func:`wgmma_default`, ``DECODESCOPE_TILE_WGMMA``). Needs the 4-warp tile.
    wgmma: bool | None = None
    # split-K through a thread-block cluster of the row tile's splits, partials reduced over
    # distributed shared memory (module docstring); None: resolved when the plan is built
    # (:func:`cluster_default`, ``DECODESCOPE_TILE_CLUSTER``)
    cluster: bool | None = None
    # the norm prologue launch (not part of the GEMM kernel; see norm_plan)
    norm: bool = False
    add_residual: bool = False
    eps: float = 1e-5
    # the RMSNorm folded into this GEMM (no norm launch): the weights carry the norm weight
    # (fold_norm_weight), each CTA sums the squares of its staged K-slice of x, the epilogue
    # scales by each token's rstd (folds(): q_b from FOLD_MIN_M tokens by default)
    rms_fold: bool = False
    # rms_fold + add_residual: the residual's chunk read into registers one chunk ahead instead
    # of its own cp.async stages (shared memory of a plain plan: 4 stages at 64 tokens)
    res_regs: bool = False
    # rms_fold on wgmma without a residual: each chunk's squares summed inside the chunk's MMA
    # block, between the commit and the wait (the warpgroup's otherwise idle time), instead of
    # before the chunk's barrier; an A/B variant (DECODESCOPE_TILE_SQ_MMA=1; read when a plan is
    # built; no gain on the H200: _sq_mma_env). See sq_in_mma.
    sq_mma: bool = field(default_factory=_sq_mma_env)
    # the split-K epilogue (A/B knobs, read when a plan is built): steps whose loads are issued
    # together (DECODESCOPE_TILE_EPI_BATCH, default EPI_BATCH), and the residual epilogue's
    # loads issued with the partials' instead of inside each step's store branch
    # (default; DECODESCOPE_TILE_EPI_HOIST=0: each step's residual load a round trip of its own
    # after the partials', 16 per thread at 64 tokens: s10/r2 o_proj 64 tokens 17.9 -> 15.0 us)
    epi_batch: int = field(
        default_factory=lambda: int(os.environ.get("DECODESCOPE_TILE_EPI_BATCH", "") or EPI_BATCH)
    )
    epi_hoist: bool = field(
        default_factory=lambda: os.environ.get("DECODESCOPE_TILE_EPI_HOIST") != "0"
    )

    def __post_init__(self) -> None:
        if self.ldsm is None:
            env = os.environ.get("DECODESCOPE_TILE_LDSM", "")
            on = self.residual_epilogue and self.m >= LDSM_EPI_MIN_M
            object.__setattr__(self, "ldsm", env == "1" if env in ("0", "1") else on)
        if self.wgmma is None:
            object.__setattr__(self, "wgmma", self.warps == 4 and wgmma_default(self.m))
        if self.wgmma and self.warps != 4:
            raise ValueError(f"tile GEMM: wgmma needs warps=4 (one warpgroup), got {self.warps}")
        if self.stages == 0:
            st = 4
            if self.rms_fold and self.add_residual and self._smem(4) > SMEM_2CTA:
                st = 3
            object.__setattr__(self, "stages", st)
        if not 1 <= self.m <= 64:
            raise ValueError(f"tile GEMM supports 1..64 tokens, got {self.m}")
        if self.k % BK:
            raise ValueError(f"tile GEMM: K must be a multiple of {BK}, got {self.k}")
        if not 1 <= len(self.segments) <= 3 or any(n % 16 for n in self.segments):
            raise ValueError(f"tile GEMM: 1..3 segments, each a multiple of 16: {self.segments}")
        if self.add_residual and not (self.norm or self.rms_fold):
            raise ValueError("tile GEMM: add_residual needs norm or rms_fold")
        if self.res_regs and not (self.rms_fold and self.add_residual):
            raise ValueError("tile GEMM: res_regs needs rms_fold and add_residual")
        if self.rms_fold and (self.norm or self.out_f32):
            raise ValueError("tile GEMM: rms_fold excludes the norm launch and out_f32")
        if self.out_f32 and self.residual_epilogue:
            raise ValueError("tile GEMM: out_f32 has no residual epilogue")
        if not 1 <= self.epi_batch <= 16:
            raise ValueError(f"tile GEMM: epi_batch in 1..16, got {self.epi_batch}")
        if self.warps not in (1, 2, 4, 8) or not 2 <= self.stages <= 8:
            raise ValueError(f"tile GEMM: warps in 1/2/4/8, stages in 2..8: {self}")
        if self.splits_force and self.nch % self.splits_force:
            raise ValueError(f"tile GEMM: splits={self.splits_force} does not divide {self.nch}")
        if self.smem_bytes > 227 * 1024:
            raise ValueError(f"tile GEMM: {self.smem_bytes} bytes of shared memory > 227 KB")
        explicit = self.cluster is not None
        if not explicit:  # the splits' rule depends on it: set first, then checked
            object.__setattr__(self, "cluster", cluster_default(self.m))
        fits = self.part_bytes <= self.stages * self.cta_rows * BK * 2
        ok = 2 <= self.splits <= CLUSTER_MAX and fits
        if self.cluster and not ok and not explicit:
            object.__setattr__(self, "cluster", False)
        if self.cluster and not ok:
            raise ValueError(
                f"tile GEMM: cluster needs 2..{CLUSTER_MAX} splits and its partial tile "
                f"({self.part_bytes} B) in the weight stages: splits {self.splits}, {self}"
            )

    @property
    def sq_in_mma(self) -> bool:
        """The folded norm's sums of squares computed inside each chunk's wgmma block (while
        the MMAs run) rather than on the chunk's critical path: ``rms_fold`` and ``wgmma``
        without a residual (that path writes ``x + r`` before the MMAs read it), ``sq_mma``."""
        return self.sq_mma and self.rms_fold and self.wgmma and not self.add_residual

    @property
    def mp(self) -> int:
        return (self.m + 7) // 8 * 8

    @property
    def ntiles(self) -> int:
        return self.mp // 8

    @property
    def nch(self) -> int:
        return self.k // BK

    @property
    def cta_rows(self) -> int:
        return self.warps * WARP_ROWS

    @property
    def threads(self) -> int:
        return self.warps * 32

    def ctas(self, n: int) -> int:
        return -(-n // self.cta_rows)

    @property
    def row_ctas(self) -> int:
        return sum(self.ctas(n) for n in self.segments)

    @property
    def splits(self) -> int:
        if self.splits_force:
            return self.splits_force
        top = min(self.nch, CLUSTER_MAX) if self.cluster else self.nch
        divs = [d for d in range(1, top + 1) if self.nch % d == 0]
        for d in divs:
            if self.row_ctas * d >= NUM_SMS:
                return d
        return divs[-1]  # cluster: at most CLUSTER_MAX splits (a cluster), fewer CTAs

    @property
    def chunks(self) -> int:
        """64-wide K chunks per CTA."""
        return self.nch // self.splits

    @property
    def acc_rows(self) -> int:
        return self.row_ctas * self.cta_rows

    @property
    def ws_rows(self) -> int:
        """Rows of the FP32 workspace ``[splits * mp (+ ssq_rows), acc_rows]`` (token-major
        partials; with ``rms_fold`` the sums of squares after them)."""
        return self.splits * self.mp + self.ssq_rows if self.uses_ws else 8

    @property
    def uses_ws(self) -> bool:
        """Split-K through the global workspace and counters (not at one split, not with
        ``cluster``)."""
        return self.splits > 1 and not self.cluster

    @property
    def part_bytes(self) -> int:
        """Shared memory of a cluster CTA's partial tile ``[mp, cta_rows + PART_PAD]`` FP32
        and its ``mp`` sums of squares (inside the weight stages)."""
        return (self.mp * (self.cta_rows + PART_PAD) + self.mp) * 4

    @property
    def ssq_rows(self) -> int:
        """Workspace rows holding the ``rms_fold`` sums of squares ``[row_ctas, splits, mp]``
        (flat, after the partials) where ``splits > 1``."""
        if not self.rms_fold or not self.uses_ws:
            return 0
        return -(-self.splits * self.mp // self.cta_rows)

    @property
    def x_slots(self) -> int:
        """16-byte activation units per thread and chunk (``load_x``'s loop)."""
        return (self.mp * 8 + self.threads - 1) // self.threads

    def _smem(self, stages: int) -> int:
        xs = 2 if self.rms_fold and self.add_residual and not self.res_regs else 1  # + r
        extra = self.mp * 4 + 16 if self.rms_fold else 0
        pad = 2 * SW128_ALIGN if self.wgmma else 0  # worst-case alignment of w and x
        return stages * (self.cta_rows + xs * self.mp) * BK * 2 + 16 + extra + pad

    @property
    def smem_bytes(self) -> int:
        return self._smem(self.stages)

    @property
    def ldx(self) -> int:
        return self.x_stride or self.k

    def gemm_ldx(self) -> int:
        """Row stride of the GEMM kernel's input: the norm's compact output, or x itself."""
        return self.k if self.norm else self.ldx


class TileGemm:
    ROW_LANES = 8  # threads that stage one token row of a chunk (8 x 16 bytes: 64 BF16)

    def __init__(self, plan: TilePlan):
        self.p = plan

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,  # [M, ldx] bf16
        mW0: cute.Tensor,
        mO0: cute.Tensor,
        mW1: cute.Tensor,
        mO1: cute.Tensor,
        mW2: cute.Tensor,
        mO2: cute.Tensor,
        mE: cute.Tensor,  # [M, N0] epilogue residual, or placeholder
        mWs: cute.Tensor,  # [splits * mp, acc_rows] f32 partials (placeholder at 1 split)
        mCnt: cute.Tensor,  # [row_ctas] i32, zero between launches
        stream: cuda.CUstream,
    ):
        p = self.p

        al = SW128_ALIGN if p.wgmma else 128  # the 128-byte swizzle's 8-row atoms

        @cute.struct
        class Smem:
            w: cute.struct.Align[cute.struct.MemRange[BFloat16, p.stages * p.cta_rows * BK], al]
            x: cute.struct.Align[cute.struct.MemRange[BFloat16, p.stages * p.mp * BK], al]
            last: cute.struct.MemRange[Int32, 1]

        @cute.struct
        class SmemFold:  # rms_fold: each token's rstd (or its sum of squares at one split)
            w: cute.struct.Align[cute.struct.MemRange[BFloat16, p.stages * p.cta_rows * BK], al]
            x: cute.struct.Align[cute.struct.MemRange[BFloat16, p.stages * p.mp * BK], al]
            last: cute.struct.MemRange[Int32, 1]
            rs: cute.struct.Align[cute.struct.MemRange[Float32, p.mp], 16]

        self.smem_cls = SmemFold if p.rms_fold else Smem
        Smem = self.smem_cls
        self.kernel(mX, mW0, mO0, mW1, mO1, mW2, mO2, mE, mWs, mCnt).launch(
            grid=[p.row_ctas, p.splits, 1],
            block=[p.threads, 1, 1],
            smem=Smem.size_in_bytes(),
            stream=stream,
            use_pdl=p.pdl,
            **cluster_launch(p),
        )

    @cute.kernel
    def kernel(self, mX, mW0, mO0, mW1, mO1, mW2, mO2, mE, mWs, mCnt):
        p = self.p
        tidx, _, _ = cute.arch.thread_idx()
        bx, sp, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(self.smem_cls)
        sW = st.w.get_tensor(
            cute.make_layout((p.stages, p.cta_rows, BK), stride=(p.cta_rows * BK, BK, 1))
        )
        sX = st.x.get_tensor(cute.make_layout((p.stages, p.mp, BK), stride=(p.mp * BK, BK, 1)))
        sLast = st.last.get_tensor(cute.make_layout(1))
        sRs = None
        if cutlass.const_expr(p.rms_fold):
            sRs = st.rs.get_tensor(cute.make_layout(p.mp))

        weights = (mW0, mW1, mW2)
        outs = (mO0, mO1, mO2)
        t0 = 0
        for s in cutlass.range_constexpr(len(p.segments)):
            nc = p.ctas(p.segments[s])
            if bx >= t0 and bx < t0 + nc:
                self.body(mX, weights[s], outs[s], mE, mWs, mCnt, sW, sX, sLast, sRs, bx,
                          bx - t0, p.segments[s], sp, tidx)  # fmt: skip
            t0 += nc

    @cute.jit
    def load_w(self, mW, sW, n, row0, kc, stg, tidx):
        """cp.async of weight rows ``row0 ..`` (those < n), chunk ``kc``, into stage ``stg``."""
        p = self.p
        nt = p.threads
        u = tidx % 8
        for i in cutlass.range_constexpr(p.cta_rows * 8 // nt):
            r = tidx // 8 + i * (nt // 8)
            if row0 + r < n:
                src = cute.local_tile(mW[row0 + r, None], (8,), (kc * 8 + u,))
                dst = cute.local_tile(sW[stg, r, None], (8,), (self.swz(u, r),))
                cute.arch.inline_ptx(
                    "cp.async.cg.shared.global [{$r0}], [{$r1}], 16;",
                    read_only_args=[dst.iterator, src.iterator],
                )

    @cute.jit
    def load_x(self, mX, sX, kc, stg, tidx):
        """cp.async of the activations (tokens < m), chunk ``kc``, into stage ``stg``."""
        p = self.p
        nt = p.threads
        units = p.mp * 8
        for i in cutlass.range_constexpr((units + nt - 1) // nt):
            idx = tidx + i * nt
            r = idx // 8
            u = idx % 8
            if idx < units and r < p.m:
                src = cute.local_tile(mX[r, None], (8,), (kc * 8 + u,))
                dst = cute.local_tile(sX[stg, r, None], (8,), (self.swz(u, r),))
                cute.arch.inline_ptx(
                    "cp.async.cg.shared.global [{$r0}], [{$r1}], 16;",
                    read_only_args=[dst.iterator, src.iterator],
                )

    @cute.jit
    def body(self, mX, mW, mO, mE, mWs, mCnt, sW, sX, sLast, sRs, bx, cta, n, sp, tidx,
             res=None):  # fmt: skip
        """One CTA. ``res``: ``(mR, mRout, sR)`` of a residual fold (:class:`TileGemmFoldRes`)."""
        p = self.p
        warp = tidx // 32
        lane = tidx % 32
        g = lane // 4
        c = lane % 4
        row0 = cta * p.cta_rows
        kc0 = sp * p.chunks
        pre = min(p.stages - 1, p.chunks)

        # weights of the first chunks before the PDL wait (never written by the predecessor)
        for s in cutlass.range_constexpr(pre):
            self.load_w(mW, sW, n, row0, kc0 + s, s, tidx)
        if cutlass.const_expr(p.pdl):
            pdl_begin()
        for s in cutlass.range_constexpr(p.stages - 1):
            if cutlass.const_expr(s < pre):
                self.load_x(mX, sX, kc0 + s, s, tidx)
                if cutlass.const_expr(res is not None and not p.res_regs):
                    self.load_x(res[0], res[2], kc0 + s, s, tidx)
            cute.arch.cp_async_commit_group()
        rR = None
        if cutlass.const_expr(res is not None and p.res_regs):  # chunk 0's residual
            rR = [cute.make_rmem_tensor((8,), BFloat16) for _ in range(p.x_slots)]
            self.load_r_regs(res[0], rR, kc0, tidx)

        atom = mc.mma_atom()
        accs = mc.zero_accs(RT * p.ntiles)
        fa, fb = mc.fragments()
        ssq = None
        if cutlass.const_expr(p.rms_fold):
            ssq = cute.make_rmem_tensor((p.x_slots,), Float32)
            ssq.fill(0.0)
        for i in cutlass.range(p.chunks, unroll=1):
            cute.arch.cp_async_wait_group(p.stages - 2)
            if cutlass.const_expr(p.rms_fold):  # this thread's own units of chunk i, landed
                if cutlass.const_expr(res is not None):
                    self.add_residual(sX, res[2], res[1], i % p.stages, kc0 + i, ssq, bx, tidx,
                                      rR)  # fmt: skip
                    if cutlass.const_expr(p.res_regs):  # noqa: SIM102 (compile-time, then run-time)
                        if i + 1 < p.chunks:  # the next chunk's residual, during this one
                            self.load_r_regs(res[0], rR, kc0 + i + 1, tidx)
                elif cutlass.const_expr(not p.sq_in_mma):
                    self.squares(sX, i % p.stages, ssq, tidx)
            if cutlass.const_expr(p.wgmma):
                # this thread's cp.async (and add_residual) writes, visible to the async proxy
                # that wgmma reads shared memory through; the barrier then covers all threads
                cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_threads()
            # the stage refilled now was read in iteration i - 1: every thread is past it
            nxt = i + (p.stages - 1)
            if nxt < p.chunks:
                sn = nxt % p.stages
                self.load_w(mW, sW, n, row0, kc0 + nxt, sn, tidx)
                self.load_x(mX, sX, kc0 + nxt, sn, tidx)
                if cutlass.const_expr(res is not None and not p.res_regs):
                    self.load_x(res[0], res[2], kc0 + nxt, sn, tidx)
            cute.arch.cp_async_commit_group()
            if cutlass.const_expr(p.sq_in_mma):
                self.compute_wgmma(sW, sX, i % p.stages, accs, sq=(ssq, tidx))
            elif cutlass.const_expr(p.wgmma):
                self.compute_wgmma(sW, sX, i % p.stages, accs)
            elif cutlass.const_expr(p.ldsm):
                self.compute_ldsm(sW, sX, i % p.stages, warp, lane, accs, fa, fb, atom)
            else:
                self.compute(sW, sX, i % p.stages, warp, g, c, accs, fa, fb, atom)
        cute.arch.cp_async_wait_group(0)
        if cutlass.const_expr(p.cluster):
            self.reduce_cluster(mO, mE, sW, accs, ssq, cta, n, sp, tidx)
            return
        if cutlass.const_expr(p.rms_fold):
            self.store_ssq(mWs, sRs, ssq, bx, sp, tidx)

        if cutlass.const_expr(p.splits == 1):
            if cutlass.const_expr(p.rms_fold):
                cute.arch.sync_threads()
            self.store_direct(mO, mE, sRs, accs, row0, n, warp, g, c)
        else:
            self.store_partial(mWs, accs, bx, sp, warp, g, c)
            cute.arch.fence_acq_rel_gpu()
            cute.arch.sync_threads()
            if tidx == 0:
                old = cute.arch.atomic_add(mCnt.iterator + bx, Int32(1), sem="acq_rel", scope="gpu")
                sLast[0] = old
            cute.arch.sync_threads()
            if sLast[0] == p.splits - 1:
                cute.arch.fence_acq_rel_gpu()
                if cutlass.const_expr(p.rms_fold):
                    self.rstd_of_splits(mWs, sRs, bx, tidx)
                self.epilogue_partial(mO, mE, mWs, mCnt, bx, cta, n, tidx, sRs)

    @cute.jit
    def squares(self, sX, stg, ssq, tidx):
        """``rms_fold``: add the squares of this thread's own activation units of stage
        ``stg`` (those its ``load_x`` copied, complete after its ``cp.async`` wait without a
        barrier: slot ``q`` is row ``(tidx + q * threads) // 8``, unit ``tidx % 8`` at its
        swizzled place) into ``ssq[q]``. Rows ``m .. mp`` are never loaded: their sums are
        garbage that :meth:`store_ssq` does not store."""
        p = self.p
        u = tidx % 8
        for q in cutlass.range_constexpr(p.x_slots):
            idx = tidx + q * p.threads
            r = cutlass.min(idx // 8, p.mp - 1)  # rows past mp only where threads > units
            xv = cute.make_rmem_tensor((8,), BFloat16)
            cute.autovec_copy(cute.local_tile(sX[stg, r, None], (8,), (self.swz(u, r),)), xv)
            s = ssq[q]
            for e in cutlass.range_constexpr(8):
                xf = xv[e].to(Float32)
                s = s + xf * xf
            ssq[q] = s

    @cute.jit
    def load_r_regs(self, mR, rR, kc, tidx):
        """``res_regs``: this thread's residual units of chunk ``kc`` (the units its ``load_x``
        copies of x) into registers ``rR``; rows clamped to ``m - 1`` (in bounds; unused)."""
        p = self.p
        u = tidx % 8
        for q in cutlass.range_constexpr(p.x_slots):
            r = cutlass.min((tidx + q * p.threads) // 8, p.m - 1)
            cute.autovec_copy(cute.local_tile(mR[r, None], (8,), (kc * 8 + u,)), rR[q])

    @cute.jit
    def add_residual(self, sX, sR, mRout, stg, kc, ssq, bx, tidx, rR=None):
        """``rms_fold`` with a residual: this thread's own units of stage ``stg`` (as
        :meth:`squares`) become ``h = bf16(x + r)`` in place in ``sX`` (before the barrier the
        MMAs wait on), their squares go into ``ssq``, and the CTAs of row tile 0 (one per split,
        together all of K) write ``h`` to ``mRout`` (the new residual stream, chunk ``kc``)."""
        p = self.p
        units = p.mp * 8
        u = tidx % 8
        for q in cutlass.range_constexpr(p.x_slots):
            idx = tidx + q * p.threads
            if idx < units:  # past units, the clamped row would be another thread's unit
                r = idx // 8
                pu = self.swz(u, r)
                xv = cute.make_rmem_tensor((8,), BFloat16)
                cute.autovec_copy(cute.local_tile(sX[stg, r, None], (8,), (pu,)), xv)
                if cutlass.const_expr(rR is not None):
                    rv = rR[q]
                else:
                    rv = cute.make_rmem_tensor((8,), BFloat16)
                    cute.autovec_copy(cute.local_tile(sR[stg, r, None], (8,), (pu,)), rv)
                hv = cute.make_rmem_tensor((8,), BFloat16)
                s = ssq[q]
                for e in cutlass.range_constexpr(8):
                    h = (xv[e].to(Float32) + rv[e].to(Float32)).to(BFloat16)
                    hv[e] = h
                    hf = h.to(Float32)
                    s = s + hf * hf
                ssq[q] = s
                cute.autovec_copy(hv, cute.local_tile(sX[stg, r, None], (8,), (pu,)))
                if bx == 0 and r < p.m:
                    cute.autovec_copy(hv, cute.local_tile(mRout[r, None], (8,), (kc * 8 + u,)))

    @cute.jit
    def store_ssq(self, mWs, sRs, ssq, bx, sp, tidx):
        """``rms_fold``: each token's sum of squares over this CTA's K slice (the 8 threads of a
        row are 8 consecutive lanes: butterfly over them), into ``sRs`` at one split, else to
        the workspace after the partials, ``[row tile bx, split sp, token]``."""
        p = self.p
        base = p.splits * p.mp * p.acc_rows
        for q in cutlass.range_constexpr(p.x_slots):
            s = self.row_ssq(ssq, q)
            idx = tidx + q * p.threads
            r = idx // 8
            if tidx % 8 == 0 and r < p.m:
                if cutlass.const_expr(p.splits == 1):
                    sRs[r] = s
                else:
                    ptr = mWs.iterator + (base + (bx * p.splits + sp) * p.mp + r)
                    cute.arch.inline_ptx("st.global.f32 [{$r0}], {$r1};", read_only_args=[ptr, s])

    @cute.jit
    def rstd_of_splits(self, mWs, sRs, bx, tidx):
        """``rms_fold``, the last CTA of row tile ``bx``: each token's ``rstd = rsqrt(ss / K +
        eps)`` from the splits' sums of squares (split order) into ``sRs``."""
        p = self.p
        base = p.splits * p.mp * p.acc_rows
        for m in cutlass.range(tidx, p.m, p.threads, unroll=1):
            ss = Float32(0.0)
            for s in cutlass.range_constexpr(p.splits):
                ptr = mWs.iterator + (base + (bx * p.splits + s) * p.mp + m)
                ss = ss + cute.arch.inline_ptx(
                    "ld.global.cg.f32 {$w0}, [{$r0}];",
                    write_only_types=[Float32],
                    read_only_args=[ptr],
                )
            sRs[m] = cute.math.rsqrt(ss / Float32(p.k) + Float32(p.eps))
        cute.arch.sync_threads()

    def swz(self, u, r):
        """Shared-memory unit of 16-byte unit ``u`` of row ``r`` (trace-time helper)."""
        if self.p.ldsm or self.p.wgmma:  # wgmma: the 128-byte swizzle of its descriptors
            return u ^ (r % 8)
        return (u + 4 * (r % 2)) % 8

    def tile_row(self, warp, q):
        """First CTA row of accumulator tile ``q`` of ``warp`` (trace-time helper): the warp's
        own 32 rows for ``mma.sync``; with ``wgmma`` M block ``q`` (64 rows) of the warpgroup,
        whose warp ``w`` holds rows ``16 w ..``, in the same per-lane order as ``mma.sync``'s
        16 x 8 tiles (registers ``4 j .. 4 j + 3``: rows g / g + 8, columns 8 j + 2 c + {0, 1})."""
        if self.p.wgmma:
            return q * 64 + warp * 16
        return warp * WARP_ROWS + q * 16

    @cute.jit
    def compute_wgmma(self, sW, sX, stg, accs, xs=None, sq=None):
        """``wgmma``: the MMAs of one 64-wide chunk as ``RT x 4`` warpgroup MMAs (M block of 64
        weight rows, N = the padded tokens, K 16), operands by shared-memory descriptors (128-byte
        swizzle: unit ``u`` of row ``r`` at ``u ^ (r % 8)``, as stored), the accumulators in
        registers; committed and waited for inside the chunk, so the next chunk's loads never
        overwrite a stage a running MMA reads. ``xs``: the activations' slot when it is not
        ``stg`` (:class:`.back_tile.BackTile`'s BF16 double buffer). ``sq = (ssq, tidx)``
        (:attr:`TilePlan.sq_in_mma`): this thread's own activation units of the stage (as
        :meth:`squares` reads them) squared into ``ssq`` between the commit and the wait."""
        p = self.p
        a_addr = sW.iterator.toint() + stg * (p.cta_rows * BK * 2)
        x_base = sX.iterator.toint() + (stg if xs is None else xs) * (p.mp * BK * 2)
        flat = []
        for q in cutlass.range_constexpr(RT):
            for j in cutlass.range_constexpr(p.ntiles):
                for e in cutlass.range_constexpr(4):
                    flat.append(accs[q * p.ntiles + j][e])
        nsq = 0
        extra = []
        if cutlass.const_expr(sq is not None):
            ssq, tidx = sq
            nsq = p.x_slots
            u = tidx % 8
            for q in cutlass.range_constexpr(nsq):
                extra.append(ssq[q])
            for q in cutlass.range_constexpr(nsq):  # this thread's unit of row r (squares())
                r = cutlass.min((tidx + q * p.threads) // 8, p.mp - 1)
                extra.append(x_base + (r * BK + self.swz(u, r) * 8) * 2)
        outs = cute.arch.inline_ptx(
            wgmma_chunk_ptx(p.mp, RT, BK, squares=nsq),
            write_only_types=[Float32] * (len(flat) + nsq),
            read_only_args=[smem_desc(a_addr), smem_desc(x_base), *flat, *extra],
        )
        for q in cutlass.range_constexpr(RT):
            for j in cutlass.range_constexpr(p.ntiles):
                for e in cutlass.range_constexpr(4):
                    accs[q * p.ntiles + j][e] = outs[(q * p.ntiles + j) * 4 + e]
        if cutlass.const_expr(sq is not None):
            for q in cutlass.range_constexpr(nsq):
                sq[0][q] = outs[len(flat) + q]

    @cute.jit
    def compute_ldsm(self, sW, sX, stg, warp, lane, accs, fa, fb, atom):
        """``ldsm``: the MMAs of one chunk with ``ldmatrix`` fragments, K in natural order: per
        16-wide K step, A of each 16-row tile by one ``x4`` (lanes 0-15 rows 0-15 at k + 0,
        lanes 16-31 at k + 8), B of two token tiles by one ``x4`` (lanes 0-7 / 8-15 / 16-23 /
        24-31: (tile, k + 0), (tile, k + 8), (tile + 1, k + 0), (tile + 1, k + 8)), an ``x2``
        for an odd last tile; both buffers keep unit ``u`` of row ``r`` at ``u ^ (r % 8)``."""
        p = self.p
        fa32 = cute.recast_tensor(fa, Int32)
        fb32 = cute.recast_tensor(fb, Int32)
        li = lane % 8
        a_base = sW.iterator + (stg * (p.cta_rows * BK) + (warp * WARP_ROWS + lane % 16) * BK)
        bh = (lane // 8) % 2
        b_base = sX.iterator + (stg * (p.mp * BK) + ((lane // 16) * 8 + li) * BK)
        for ks in cutlass.range_constexpr(BK // 16):
            ua = 2 * ks + lane // 16
            aregs = []
            for q in cutlass.range_constexpr(RT):
                aregs.append(ldsm_x4(a_base + (q * 16 * BK + (ua ^ li) * 8)))
            ub = 2 * ks + bh
            bregs = []
            for jj in cutlass.range_constexpr(p.ntiles // 2):
                bb = ldsm_x4(b_base + (jj * 16 * BK + (ub ^ li) * 8))
                bregs.append((bb[0], bb[1]))
                bregs.append((bb[2], bb[3]))
            if cutlass.const_expr(p.ntiles % 2):  # lanes 0-15: (last tile, k + 0 | + 8)
                jl = p.ntiles - 1
                bregs.append(ldsm_x2(sX.iterator + (stg * (p.mp * BK) + (jl * 8 + li) * BK
                                                    + (ub ^ li) * 8)))  # fmt: skip
            for j in cutlass.range_constexpr(p.ntiles):
                fb32[0] = bregs[j][0]
                fb32[1] = bregs[j][1]
                for q in cutlass.range_constexpr(RT):
                    for e in cutlass.range_constexpr(4):
                        fa32[e] = aregs[q][e]
                    acc = accs[q * p.ntiles + j]
                    cute.gemm(atom, acc, fa, fb, acc)

    @cute.jit
    def compute(self, sW, sX, stg, warp, g, c, accs, fa, fb, atom):
        """The MMAs of one 64-wide chunk: two 32-wide halves, each two k16 steps per tile."""
        p = self.p
        par = 4 * (g % 2)  # rows g, g + 8, 8j + g share g's parity (the swizzle)
        for h in cutlass.range_constexpr(2):
            pu = (4 * h + c + par) % 8
            tiles = []
            for q in cutlass.range_constexpr(RT):
                r = warp * WARP_ROWS + q * 16 + g
                lo = cute.make_rmem_tensor((8,), BFloat16)
                hi = cute.make_rmem_tensor((8,), BFloat16)
                cute.autovec_copy(cute.local_tile(sW[stg, r, None], (8,), (pu,)), lo)
                cute.autovec_copy(cute.local_tile(sW[stg, r + 8, None], (8,), (pu,)), hi)
                tiles.append((lo, hi, q))
            for j in cutlass.range_constexpr(p.ntiles):
                xb = cute.make_rmem_tensor((8,), BFloat16)
                cute.autovec_copy(cute.local_tile(sX[stg, j * 8 + g, None], (8,), (pu,)), xb)
                mc.mma_k16(
                    atom, accs, fa, fb, xb, [(lo, hi, q * p.ntiles + j) for lo, hi, q in tiles]
                )

    @cute.jit
    def reduce_cluster(self, mO, mE, sW, accs, ssq, cta, n, sp, tidx):
        """``cluster``: this CTA's partial tile (and sums of squares) into its own shared memory
        (the weight stages, free after the loop), one cluster barrier, then the tokens ``t``
        with ``t % splits == sp`` summed over the cluster's CTAs in split order
        (``ld.shared::cluster``, 4 rows of one token per thread and step, as
        :meth:`epilogue_partial`) and stored through the epilogue; a second barrier, waited for
        last, keeps this CTA's shared memory alive while the others read it."""
        sP, sQ = self.cl_tiles(sW)
        self.cl_publish(sP, sQ, accs, ssq, tidx)
        self.cl_gather(mO, mE, sP, sQ, cta, n, sp, tidx)

    def cl_tiles(self, sW):
        """The partial tile ``[mp, cta_rows + PART_PAD]`` FP32 and the ``mp`` sums of squares
        after it, in the weight stages (trace-time helper)."""
        p = self.p
        rs_ = p.cta_rows + PART_PAD
        fbase = cute.recast_ptr(sW.iterator, dtype=Float32)
        sP = cute.make_tensor(fbase, cute.make_layout((p.mp, rs_), stride=(rs_, 1)))
        sQ = cute.make_tensor(fbase + p.mp * rs_, cute.make_layout(p.mp))
        return sP, sQ

    @cute.jit
    def cl_publish(self, sP, sQ, accs, ssq, tidx):
        """This CTA's accumulators (local row order, :meth:`tile_row`) and sums of squares into
        ``sP`` / ``sQ``, then the cluster barrier that publishes them."""
        p = self.p
        warp = tidx // 32
        lane = tidx % 32
        g = lane // 4
        c = lane % 4
        cute.arch.sync_threads()  # every warp past its last reads of the stages
        for q in cutlass.range_constexpr(RT):
            for hh in cutlass.range_constexpr(2):
                row = self.tile_row(warp, q) + g + 8 * hh
                for j in cutlass.range_constexpr(p.ntiles):
                    for e in cutlass.range_constexpr(2):
                        sP[j * 8 + 2 * c + e, row] = accs[q * p.ntiles + j][2 * hh + e]
        if cutlass.const_expr(self.cl_norm()):  # this split's sums of squares per token
            self.cl_publish_ssq(ssq, sQ, tidx)
        cute.arch.cluster_arrive()  # release: this split's partials are in place
        cute.arch.cluster_wait()

    @cute.jit
    def cl_gather(self, mO, mE, sP, sQ, cta, n, sp, tidx):
        """CTA ``sp`` of the cluster: its tokens' 4-row quads summed over the splits (split
        order), through :meth:`cl_value` into ``mO``."""
        p = self.p
        S = p.splits
        rs_ = p.cta_rows + PART_PAD
        quads = p.cta_rows // 4
        per = -(-p.m // S)  # tokens per CTA of the cluster, at most
        total = per * quads
        items = []
        for t in cutlass.range_constexpr(-(-total // p.threads)):
            it = tidx + t * p.threads
            m = sp + S * (it // quads)
            ok = m < p.m  # past the last item m >= splits * per >= p.m
            mc_ = cutlass.min(m, p.mp - 1)  # clamped: every read stays in the tile
            r4 = (it % quads) * 4
            vals = [ld_cluster_v4f32(mapa(sP.iterator + (mc_ * rs_ + r4), r)) for r in range(S)]
            rs = self.cl_rstd(sQ, mc_) if self.cl_norm() else None
            # clamped: in bounds
            ev = self.cl_load_epi(
                mE, cutlass.min(m, p.m - 1), cutlass.min(cta * p.cta_rows + r4, n - 4)
            )
            items.append((ok, m, r4, vals, rs, ev))
        cute.arch.cluster_arrive()  # this CTA reads no other's shared memory after this
        for ok, m, r4, vals, rs, ev in items:
            nn = cta * p.cta_rows + r4
            if ok and nn < n:
                ov = cute.make_rmem_tensor((4,), self.cl_out_type())
                for e in cutlass.range_constexpr(4):
                    val = vals[0][e]
                    for src in cutlass.range_constexpr(1, S):
                        val = val + vals[src][e]
                    ov[e] = self.cl_value(val, rs, ev, e)
                cute.autovec_copy(ov, cute.local_tile(mO[m, None], (4,), (nn // 4,)))
        cute.arch.cluster_wait()  # nobody exits while another still reads its partials

    def cl_rstd(self, sQ, m):
        """Token ``m``'s ``rsqrt(ss / K + eps)`` from the cluster's sums of squares, in split
        order (trace-time helper)."""
        ss = Float32(0.0)
        for r in range(self.p.splits):
            ss = ss + ld_cluster_f32(mapa(sQ.iterator + m, r))
        return cute.math.rsqrt(ss / Float32(self.p.k) + Float32(self.cl_eps()))

    # the cluster epilogue's parts that differ by kernel (trace-time; .back_tile overrides them)
    def cl_norm(self) -> bool:
        """Whether a norm's rstd (from the splits' sums of squares) scales the sums."""
        return self.p.rms_fold

    def cl_eps(self) -> float:
        return self.p.eps

    def cl_out_type(self):
        return Float32 if self.p.out_f32 else BFloat16

    def cl_load_epi(self, mE, m, nn):
        """The epilogue's own input for 4 rows ``nn ..`` of token ``m`` (clamped in bounds),
        loaded before the partials are summed: the residual, or None."""
        if not self.p.residual_epilogue:
            return None
        ev = cute.make_rmem_tensor((4,), BFloat16)
        cute.autovec_copy(cute.local_tile(mE[m, None], (4,), (nn // 4,)), ev)
        return ev

    def cl_value(self, val, rs, ev, e):
        """Output element ``e`` of 4 from the summed partial ``val`` (``rs``: the token's
        rstd; ``ev``: :meth:`cl_load_epi`'s values)."""
        p = self.p
        if p.rms_fold:
            val = val * rs
        if p.residual_epilogue:
            val = val.to(BFloat16).to(Float32) + ev[e].to(Float32)
        return val if p.out_f32 else val.to(BFloat16)

    @cute.jit
    def cl_publish_ssq(self, ssq, sQ, tidx):
        """``rms_fold``: each token's sum of squares over this split (:meth:`store_ssq`'s
        butterfly over the 8 threads of a row) into this CTA's ``sQ``."""
        p = self.p
        for q in cutlass.range_constexpr(p.x_slots):
            s = self.row_ssq(ssq, q)
            r = (tidx + q * p.threads) // 8
            if tidx % 8 == 0 and r < p.m:
                sQ[r] = s

    def row_ssq(self, ssq, q):
        """Slot ``q``'s token row sum of squares over this split: a butterfly over the
        ``ROW_LANES`` threads that staged the row (consecutive lanes; trace-time helper)."""
        s = ssq[q]
        for o in range(self.ROW_LANES.bit_length() - 1):
            s = s + cute.arch.shuffle_sync_bfly(s, offset=1 << o)
        return s

    @cute.jit
    def store_direct(self, mO, mE, sRs, accs, row0, n, warp, g, c):
        """lane (g, c), tile (q, j): rows g / g + 8 of tile q, tokens 8j + 2c + {0, 1}
        (``rms_fold``: ``sRs`` holds each token's sum of squares over all of K)."""
        p = self.p
        for q in cutlass.range_constexpr(RT):
            for hh in cutlass.range_constexpr(2):
                nn = row0 + self.tile_row(warp, q) + g + 8 * hh
                if nn < n:
                    for j in cutlass.range_constexpr(p.ntiles):
                        for e in cutlass.range_constexpr(2):
                            m = j * 8 + 2 * c + e
                            if m < p.m:
                                val = accs[q * p.ntiles + j][2 * hh + e]
                                if cutlass.const_expr(p.rms_fold):
                                    val = val * cute.math.rsqrt(
                                        sRs[m] / Float32(p.k) + Float32(p.eps))  # fmt: skip
                                if cutlass.const_expr(p.out_f32):
                                    mO[m, nn] = val
                                else:
                                    if cutlass.const_expr(p.residual_epilogue):
                                        val = (val.to(BFloat16).to(Float32)
                                               + mE[m, nn].to(Float32))  # fmt: skip
                                    mO[m, nn] = val.to(BFloat16)

    @cute.jit
    def store_partial(self, mWs, accs, bx, sp, warp, g, c):
        """This split's FP32 partials to ``ws[sp, token, row]`` (rows contiguous: the lanes of
        one ``c`` write 8 consecutive rows, and the epilogue reads 4 rows per 16 bytes)."""
        p = self.p
        for q in cutlass.range_constexpr(RT):
            for hh in cutlass.range_constexpr(2):
                arow = bx * p.cta_rows + self.tile_row(warp, q) + g + 8 * hh
                for j in cutlass.range_constexpr(p.ntiles):
                    for e in cutlass.range_constexpr(2):
                        m = j * 8 + 2 * c + e
                        ptr = mWs.iterator + ((sp * p.mp + m) * p.acc_rows + arow)
                        cute.arch.inline_ptx(
                            "st.global.f32 [{$r0}], {$r1};",
                            read_only_args=[ptr, accs[q * p.ntiles + j][2 * hh + e]],
                        )

    @cute.jit
    def epilogue_partial(self, mO, mE, mWs, mCnt, bx, cta, n, tidx, sRs=None):
        """The last CTA of row tile ``bx``: sum the splits' partials, 4 rows of one token per
        thread and step (16-byte L2 loads, consecutive threads on consecutive rows: coalesced
        loads and 8-byte output stores), ``epi_batch`` steps' loads issued before any sum (with
        ``epi_hoist`` the residual's too); epilogue (``rms_fold``: times the token's rstd from
        ``sRs``), store; zero the counter."""
        p = self.p
        nt = p.threads
        quads = p.cta_rows // 4
        total = p.m * quads
        steps = (total + nt - 1) // nt
        bsz = min(p.epi_batch, steps)
        for b in cutlass.range((steps + bsz - 1) // bsz, unroll=1):
            parts = []
            for t in cutlass.range_constexpr(bsz):
                f = tidx + (b * bsz + t) * nt
                ok = f < total
                fc = cutlass.min(f, total - 1)  # clamped: every load stays in bounds
                m = fc // quads
                r4 = (fc % quads) * 4
                vals = []
                for s in cutlass.range_constexpr(p.splits):
                    ptr = mWs.iterator + ((s * p.mp + m) * p.acc_rows + bx * p.cta_rows + r4)
                    vals.append(
                        cute.arch.inline_ptx(
                            "ld.global.cg.v4.f32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
                            write_only_types=[Float32, Float32, Float32, Float32],
                            read_only_args=[ptr],
                        )
                    )
                ev = None
                if cutlass.const_expr(p.residual_epilogue and p.epi_hoist):
                    # with the partials, outside the store's branch (clamped: in bounds)
                    nnc = cutlass.min(cta * p.cta_rows + r4, n - 4)
                    ev = cute.make_rmem_tensor((4,), BFloat16)
                    cute.autovec_copy(cute.local_tile(mE[m, None], (4,), (nnc // 4,)), ev)
                parts.append((ok, m, r4, vals, ev))
            for ok, m, r4, vals, ev in parts:
                nn = cta * p.cta_rows + r4
                if ok and nn < n:
                    ov = cute.make_rmem_tensor((4,), Float32 if p.out_f32 else BFloat16)
                    evl = ev
                    if cutlass.const_expr(p.residual_epilogue and not p.epi_hoist):
                        evl = cute.make_rmem_tensor((4,), BFloat16)
                        cute.autovec_copy(cute.local_tile(mE[m, None], (4,), (nn // 4,)), evl)
                    rs = None
                    if cutlass.const_expr(p.rms_fold):
                        rs = sRs[m]
                    for e in cutlass.range_constexpr(4):
                        val = vals[0][e]
                        for s in cutlass.range_constexpr(1, p.splits):
                            val = val + vals[s][e]
                        if cutlass.const_expr(p.rms_fold):
                            val = val * rs
                        if cutlass.const_expr(p.residual_epilogue):
                            val = val.to(BFloat16).to(Float32) + evl[e].to(Float32)
                        if cutlass.const_expr(p.out_f32):
                            ov[e] = val
                        else:
                            ov[e] = val.to(BFloat16)
                    cute.autovec_copy(ov, cute.local_tile(mO[m, None], (4,), (nn // 4,)))
        if tidx == 0:
            mCnt[bx] = Int32(0)


class TileGemmFoldRes(TileGemm):
    """:class:`TileGemm` with the residual add folded in too (``rms_fold`` + ``add_residual``):
    ``h = bf16(x + r)`` staged from both inputs, ``mRout = h``, ``out = bf16(rstd(h) * h @
    W'^T)``. Its own launch signature (the residual in and out; no epilogue residual), so the
    other plans' code is untouched."""

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,  # [M, K] bf16
        mR: cute.Tensor,  # [M, K] residual in
        mRout: cute.Tensor,  # [M, K] x + r out
        mW0: cute.Tensor,
        mO0: cute.Tensor,
        mW1: cute.Tensor,
        mO1: cute.Tensor,
        mW2: cute.Tensor,
        mO2: cute.Tensor,
        mWs: cute.Tensor,
        mCnt: cute.Tensor,
        stream: cuda.CUstream,
    ):
        p = self.p

        rsz = 8 if p.res_regs else p.stages * p.mp * BK  # res_regs: r in registers

        al = SW128_ALIGN if p.wgmma else 128

        @cute.struct
        class SmemFoldRes:
            w: cute.struct.Align[cute.struct.MemRange[BFloat16, p.stages * p.cta_rows * BK], al]
            x: cute.struct.Align[cute.struct.MemRange[BFloat16, p.stages * p.mp * BK], al]
            r: cute.struct.Align[cute.struct.MemRange[BFloat16, rsz], 128]
            last: cute.struct.MemRange[Int32, 1]
            rs: cute.struct.Align[cute.struct.MemRange[Float32, p.mp], 16]

        self.smem_cls = SmemFoldRes
        self.kernel_res(mX, mR, mRout, mW0, mO0, mW1, mO1, mW2, mO2, mWs, mCnt).launch(
            grid=[p.row_ctas, p.splits, 1],
            block=[p.threads, 1, 1],
            smem=SmemFoldRes.size_in_bytes(),
            stream=stream,
            use_pdl=p.pdl,
        )

    @cute.kernel
    def kernel_res(self, mX, mR, mRout, mW0, mO0, mW1, mO1, mW2, mO2, mWs, mCnt):
        p = self.p
        tidx, _, _ = cute.arch.thread_idx()
        bx, sp, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(self.smem_cls)
        sW = st.w.get_tensor(
            cute.make_layout((p.stages, p.cta_rows, BK), stride=(p.cta_rows * BK, BK, 1))
        )
        xl = cute.make_layout((p.stages, p.mp, BK), stride=(p.mp * BK, BK, 1))
        sX = st.x.get_tensor(xl)
        sR = None if p.res_regs else st.r.get_tensor(xl)
        sLast = st.last.get_tensor(cute.make_layout(1))
        sRs = st.rs.get_tensor(cute.make_layout(p.mp))
        weights = (mW0, mW1, mW2)
        outs = (mO0, mO1, mO2)
        t0 = 0
        for s in cutlass.range_constexpr(len(p.segments)):
            nc = p.ctas(p.segments[s])
            if bx >= t0 and bx < t0 + nc:
                self.body(mX, weights[s], outs[s], None, mWs, mCnt, sW, sX, sLast, sRs, bx,
                          bx - t0, p.segments[s], sp, tidx, res=(mR, mRout, sR))  # fmt: skip
            t0 += nc


# wgmma shared-memory descriptor (PTX ISA, "matrix descriptor"): start address >> 4 in bits
# 0-13, leading byte offset >> 4 in 16-29 (unused by K-major swizzled operands: 1), stride byte
# offset >> 4 in 32-45 (8 rows of 128 bytes: 1024), swizzle in 62-63 (1: 128 bytes)
DESC_HI = (1 << 16) | ((1024 >> 4) << 32) | (1 << 62)


def cluster_launch(p: TilePlan) -> dict:
    """The launch's cluster argument: the splits of a row tile in one cluster (``cluster``)."""
    return {"cluster": [1, p.splits, 1]} if p.cluster else {}


def smem_desc(addr):
    """The descriptor of a K-major, 128-byte-swizzled operand at shared address ``addr``
    (Int32, 1024-byte aligned). Trace-time helper."""
    return Int64((addr >> 4) & 0x3FFF) | Int64(DESC_HI)


def wgmma_chunk_ptx(n: int, mblocks: int, bk: int, squares: int = 0) -> str:
    """PTX of one K chunk (``bk`` columns) of warpgroup MMAs: ``mblocks`` M blocks of 64 rows
    (A: ``{$r0}`` + 8 KB each) against N = ``n`` tokens (B: ``{$r1}``), K steps of 16 (32 bytes
    further in both descriptors), accumulating into ``mblocks * n / 2`` FP32 registers per
    thread (read-only inputs ``{$r2}..``, copied to the outputs ``{$w..}`` first). Fenced,
    committed and waited for in the block. ``squares``: that many sums of squares too (inputs
    after the accumulators, then as many 32-bit shared addresses of 16-byte BF16 units; outputs
    after the accumulators'), each unit's 8 squares added in element order between the commit
    and the wait, while the MMAs run."""
    if n % 8 or not 8 <= n <= 256:
        raise ValueError(f"wgmma: N must be a multiple of 8 in 8..256, got {n}")
    per = n // 2
    nacc = mblocks * per
    # scale-d: a predicate set in the block (1: accumulate into d)
    lines = ["{", ".reg .b64 da, db;", ".reg .b32 one;", ".reg .pred p;", "mov.b32 one, 1;",
             "setp.ne.b32 p, one, 0;"]  # fmt: skip
    lines += [f"mov.f32 {{$w{i}}}, {{$r{2 + i}}};" for i in range(mblocks * per)]
    lines.append("wgmma.fence.sync.aligned;")
    for ks in range(bk // 16):
        lines.append(f"add.s64 db, {{$r1}}, {ks * 32 >> 4};")
        for q in range(mblocks):
            lines.append(f"add.s64 da, {{$r0}}, {(q * 64 * bk * 2 + ks * 32) >> 4};")
            regs = ", ".join(f"{{$w{q * per + i}}}" for i in range(per))
            lines.append(
                f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{regs}}}, da, db, p, "
                "1, 1, 0, 0;"
            )
    lines.append("wgmma.commit_group.sync.aligned;")
    if squares:
        lines[1:1] = [".reg .b32 sx<4>, sb;", ".reg .f32 sf;"]
    for q in range(squares):
        s_out, s_in, addr = (
            f"{{$w{nacc + q}}}",
            f"{{$r{2 + nacc + q}}}",
            f"{{$r{2 + nacc + squares + q}}}",
        )
        lines += [
            f"mov.f32 {s_out}, {s_in};",
            f"ld.shared.v4.b32 {{sx0, sx1, sx2, sx3}}, [{addr}];",
        ]
        for w in range(4):  # element 2w: the low half, 2w + 1: the high half (little endian)
            for op in (f"shl.b32 sb, sx{w}, 16;", f"and.b32 sb, sx{w}, 0xffff0000;"):
                lines += [op, "mov.b32 sf, sb;", f"fma.rn.f32 {s_out}, sf, sf, {s_out};"]
    lines += ["wgmma.wait_group.sync.aligned 0;", "}"]
    return "\n".join(lines)


def ldsm_x4(ptr):
    """``ldmatrix .x4``: four 8x8 BF16 matrices, row addresses from lanes 0-7, 8-15, 16-23,
    24-31; lane (g, c) gets elements (g, 2c .. 2c + 1) of each, one 32-bit register each."""
    return cute.arch.inline_ptx(
        "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
        write_only_types=[Int32, Int32, Int32, Int32],
        read_only_args=[ptr],
    )


def ldsm_x2(ptr):
    """``ldmatrix .x2``: two matrices, row addresses from lanes 0-15 (the others ignored)."""
    return cute.arch.inline_ptx(
        "ldmatrix.sync.aligned.m8n8.x2.shared.b16 {{$w0}, {$w1}}, [{$r0}];",
        write_only_types=[Int32, Int32],
        read_only_args=[ptr],
    )


# -- torch-facing --------------------------------------------------------------------------

_PLACEHOLDER = (16, 16)


def _fake_args_res(p: TilePlan):
    """:class:`TileGemmFoldRes`'s arguments: x, r, r_out, the segments, workspace, counters."""
    bf = torch.bfloat16
    a = _fake_args(p)
    xs = (itf.fake_strided(bf, (p.m, p.k), (p.ldx, 1)), itf.fake(bf, (p.m, p.k)),
          itf.fake(bf, (p.m, p.k)))  # fmt: skip
    return (*xs, *a[1:7], *a[8:])


def _fake_args(p: TilePlan):
    bf = torch.bfloat16
    M, K = p.m, p.k
    ph = itf.fake(bf, _PLACEHOLDER)
    x = itf.fake_strided(bf, (M, K), (p.gemm_ldx(), 1))
    segs = []
    ot = torch.float32 if p.out_f32 else bf
    for s in range(3):
        if s < len(p.segments):
            segs += [itf.fake(bf, (p.segments[s], K)), itf.fake(ot, (M, p.segments[s]))]
        else:
            segs += [ph, ph]
    e = itf.fake(bf, (M, p.segments[0])) if p.residual_epilogue else ph
    ws = itf.fake(torch.float32, (p.ws_rows, p.acc_rows if p.uses_ws else 8))
    cnt = itf.fake(torch.int32, (p.row_ctas,), align=4)
    return (x, *segs, e, ws, cnt, itf.env_stream())


def norm_plan(p: TilePlan) -> rms.NormPlan:
    return rms.NormPlan(p.m, p.k, p.eps, pdl=p.pdl, residual=p.add_residual)


def _compile_norm(p: TilePlan):
    """:class:`.rmsnorm.RMSNorm` with the plan's input row stride (``q_a`` is a slice)."""
    np_ = norm_plan(p)
    return itf.compiled(("tile_gemm_norm", np_, p.ldx),
                        lambda: (rms.RMSNorm(np_), rms._fake_args(np_, p.ldx)))  # fmt: skip


def compile_plan(p: TilePlan):
    """Compile (cached) the GEMM kernel of ``p`` (and its norm launch where ``p.norm``)."""
    if p.rms_fold and p.add_residual:
        return itf.compiled(("tile_gemm", p), lambda: (TileGemmFoldRes(p), _fake_args_res(p)))
    fn = itf.compiled(("tile_gemm", p), lambda: (TileGemm(p), _fake_args(p)))
    if p.norm:
        _compile_norm(p)
    return fn


def compile_any(plan) -> object:
    """Compile (cached) a tile, split-K or skinny plan."""
    if isinstance(plan, TilePlan):
        return compile_plan(plan)
    return sk.compile_any(plan)


_WS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_BUF: dict[tuple, torch.Tensor] = {}


def _workspace(p: TilePlan, device) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 partials and counters (zeroed once; the last CTA of a row tile re-zeroes its
    counter: every launch of the plan on one stream reuses them)."""
    key = (p, str(device))
    ws = _WS.get(key)
    if ws is None:
        ws = _WS[key] = (
            torch.zeros(
                p.ws_rows, p.acc_rows if p.uses_ws else 8, dtype=torch.float32, device=device
            ),
            torch.zeros(p.row_ctas, dtype=torch.int32, device=device),
        )
    return ws


def _norm_buffer(p: TilePlan, device) -> torch.Tensor:
    key = (p.m, p.k, str(device))
    b = _BUF.get(key)
    if b is None:
        b = _BUF[key] = torch.empty(p.m, p.k, dtype=torch.bfloat16, device=device)
    return b


def prepare(p: TilePlan, device) -> None:
    """Compile and allocate everything a plan's launches use (call before graph capture)."""
    compile_plan(p)
    _workspace(p, device)
    if p.norm:
        _norm_buffer(p, device)


def _placeholder(dev) -> torch.Tensor:
    return itf.placeholder(dev, _PLACEHOLDER)


def norm_launch(p: TilePlan, x, norm_weight, residual=None, residual_out=None) -> torch.Tensor:
    """The plan's norm launch alone: ``bf16(bf16(h * rstd) * w)`` of ``h = x (+ residual)``
    into the cached ``[M, K]`` buffer (returned); ``residual_out = h`` with a residual."""
    ph = _placeholder(x.device)
    a = _norm_buffer(p, x.device)
    r = residual if residual is not None else ph
    ro = residual_out if residual is not None else ph
    _compile_norm(p)(x, r, ro, norm_weight, a, *rms.no_side(x.device))
    return a


def attention_cases(cfg) -> dict[str, dict]:
    """The attention projections of one rank as :class:`TilePlan` keyword arguments (less
    ``m``): KDA in_proj, MLA qkv_a + g_proj, MLA q_b (strided q_a input), o_proj."""
    return {
        "in_proj": dict(k=cfg.hidden, segments=(cfg.kda_in_proj_out,), norm=True,
                        add_residual=True, eps=cfg.eps),
        "qkv_a_g": dict(k=cfg.hidden, segments=(cfg.mla_qkv_a_out, cfg.mla_v_dim), norm=True,
                        add_residual=True, eps=cfg.eps),
        "q_b": dict(k=cfg.mla.q_lora_rank, segments=(cfg.mla_q_b_out,), norm=True,
                    x_stride=cfg.mla_qkv_a_out, eps=cfg.eps),
        "o_proj": dict(k=cfg.kda_dim, segments=(cfg.hidden,), residual_epilogue=True),
    }  # fmt: skip


def plan_of(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    *,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    epilogue_residual: torch.Tensor | None = None,
    eps: float = 1e-5,
    splits: int = 0,
    warps: int = 4,
    stages: int = 0,
    out_f32: bool = False,
    pdl: bool | None = None,
    rms_fold: bool = False,
    ldsm: bool | None = None,
    epi_batch: int | None = None,
    epi_hoist: bool | None = None,
    res_regs: bool = False,
    wgmma: bool | None = None,
    cluster: bool | None = None,
    sq_mma: bool | None = None,
) -> TilePlan:
    M, K = x.shape
    if x.stride(1) != 1:
        raise ValueError(f"tile_gemm: x must have unit column stride, got {tuple(x.stride())}")
    extra: dict = {} if pdl is None else {"pdl": pdl}
    for k, v in (("ldsm", ldsm), ("epi_batch", epi_batch), ("epi_hoist", epi_hoist),
                 ("wgmma", wgmma), ("cluster", cluster), ("sq_mma", sq_mma)):  # fmt: skip
        if v is not None:
            extra[k] = v
    return TilePlan(
        m=int(M),
        k=int(K),
        segments=tuple(int(w.shape[0]) for w in weights),
        residual_epilogue=epilogue_residual is not None,
        out_f32=out_f32,
        x_stride=0 if x.stride(0) == K else int(x.stride(0)),
        splits_force=splits,
        warps=warps,
        stages=stages,
        norm=norm_weight is not None,
        add_residual=residual is not None,
        eps=float(eps),
        rms_fold=rms_fold,
        res_regs=res_regs,
        **extra,
    )


def tile_gemm(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    outs: list[torch.Tensor],
    *,
    residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    epilogue_residual: torch.Tensor | None = None,
    eps: float = 1e-5,
    splits: int = 0,
    warps: int = 4,
    stages: int = 0,
    pdl: bool | None = None,
    rms_fold: bool = False,
    ldsm: bool | None = None,
    epi_batch: int | None = None,
    epi_hoist: bool | None = None,
    res_regs: bool = False,
    wgmma: bool | None = None,
    cluster: bool | None = None,
    sq_mma: bool | None = None,
) -> None:
    """Same contract as :func:`.skinny_gemm.skinny_gemm` (rounding of its reference): with
    ``norm_weight`` one RMSNorm launch (``residual`` added first, ``residual_out`` written)
    precedes the GEMM. With ``rms_fold`` (no ``norm_weight``) the weights carry the norm
    weight (:func:`fold_norm_weight`) and the GEMM itself scales by each token's rstd: one
    launch, ``bf16(rstd * sum_k x W')``; with ``residual`` too, ``h = bf16(x + residual)``
    staged in the GEMM and written to ``residual_out``. ``splits`` / ``warps`` / ``stages``
    force the tiling (sweeps; ``stages`` 0: the plan's choice). FP32
    ``outs`` (all of them, compact ``[M, N]``) get the unrounded FP32 sums (``out_f32``).
    ``pdl`` / ``ldsm`` / ``epi_batch`` / ``epi_hoist`` / ``wgmma`` / ``cluster`` / ``sq_mma``: the
    plan's flags (default :func:`.utils.pdl_enabled` / the ``DECODESCOPE_TILE_*`` variables)."""
    out_f32 = outs[0].dtype == torch.float32
    if out_f32:
        for i, (o, w) in enumerate(zip(outs, weights, strict=True)):
            itf.check(o, f"tile_gemm out {i}", (x.shape[0], w.shape[0]), torch.float32)
    if rms_fold and (norm_weight is not None or (residual is None) != (residual_out is None)):
        raise ValueError("tile_gemm: rms_fold takes folded weights (no norm_weight); a residual "
                         "needs residual_out")  # fmt: skip
    p = plan_of(x, weights, residual=residual, norm_weight=norm_weight,
                epilogue_residual=epilogue_residual, eps=eps, splits=splits, warps=warps,
                stages=stages, out_f32=out_f32, pdl=pdl, rms_fold=rms_fold,
                ldsm=ldsm, epi_batch=epi_batch, epi_hoist=epi_hoist,
                res_regs=res_regs, wgmma=wgmma, cluster=cluster, sq_mma=sq_mma)  # fmt: skip
    fn = compile_plan(p)
    dev = x.device
    ph = _placeholder(dev)
    a = x
    if p.norm:
        a = norm_launch(p, x, norm_weight, residual, residual_out)
    segs: list[torch.Tensor] = []
    for s in range(3):
        segs += [weights[s], outs[s]] if s < len(weights) else [ph, ph]
    ws, cnt = _workspace(p, dev)
    if p.rms_fold and p.add_residual:
        itf.check(residual, "tile_gemm residual", tuple(x.shape), torch.bfloat16)
        itf.check(residual_out, "tile_gemm residual_out", tuple(x.shape), torch.bfloat16)
        fn(x, residual, residual_out, *segs, ws, cnt)
        return
    fn(a, *segs, epilogue_residual if epilogue_residual is not None else ph, ws, cnt)


# -- dispatch ------------------------------------------------------------------------------


def gemm_plan(m: int, k: int, segments: tuple[int, ...], **flags):
    """The plan that serves an ``m x k`` projection: :class:`TilePlan` where :func:`selected`
    says so, else :func:`.splitk_gemm.gemm_plan`'s choice (same keyword flags)."""
    norm, res = flags.get("norm", False), bool(flags.get("add_residual", False))
    if selected(m, k, norm, res):
        fold = folds(norm, res, m)
        return TilePlan(
            m=m,
            k=k,
            segments=segments,
            residual_epilogue=flags.get("residual_epilogue", False),
            x_stride=flags.get("x_stride", 0),
            norm=norm and not fold,
            add_residual=res,
            eps=flags.get("eps", 1e-5),
            rms_fold=fold,
        )
    return sk.gemm_plan(m, k, segments, **flags)


CUBLAS_ENV = "DECODESCOPE_TILE_CUBLAS"
CUBLAS_CHOICES = ("0", "16", "32", "64")
CUBLAS_IMPL = "torch:cublas + cute:decodescope"  # op_impl of a projection it serves


def cublas_min_m() -> int:
    """``DECODESCOPE_TILE_CUBLAS``: from this many tokens the single-weight tile projections
    (o_proj with its residual epilogue, KDA's in_proj after its norm launch) run their GEMM on
    cuBLAS (``torch.addmm`` / ``torch.mm``) instead; 0: never. Unset: 32, the default since
    session 18 (H200, bench shares at 64 tokens: TP8 KDA layer -11.5 us, TP16 KDA -7.7 / MLA
    -5.2; projected steps 0.2-1.2% shorter at the four 32- and 64-token points measured; notes/
    specialized.md "Session 18"). cuBLAS may pick a split-K GEMM with a reduce kernel of its own
    (TP16 from 32 tokens: one launch more than :meth:`.step.Plan.launches` counts)."""
    from decodescope.kernels.specialized import env_knobs

    return int(env_knobs.read(CUBLAS_ENV, CUBLAS_CHOICES, "32"))


def cublas_serves(m: int, k: int, n_weights: int, norm: bool, residual: bool) -> bool:
    """Whether :func:`project` hands an ``m x k`` projection of ``n_weights`` weights to cuBLAS
    (:func:`cublas_min_m`): one weight (two would need two launches), served by the tile kernel
    at ``m`` (:func:`selected`), its norm (if any) not folded (a folded norm has no launch of its
    own to keep)."""
    mm = cublas_min_m()
    return (
        mm > 0
        and m >= mm
        and n_weights == 1
        and selected(m, k, norm, residual)
        and not folds(norm, residual, m)
    )


def _cublas_project(x, w, out, *, residual=None, residual_out=None, norm_weight=None,
                    epilogue_residual=None, eps=1e-5) -> None:  # fmt: skip
    """The tile path's norm launch (if any), then ``out = a @ w^T (+ epilogue_residual)`` by
    cuBLAS: ``bf16(acc + res)`` in one rounding (the tile kernel: ``bf16(bf16(acc) + res)``);
    with ``DECODESCOPE_PROJ_TMA`` (:func:`.tma_gemm.serves`) by :mod:`.tma_gemm` instead (the
    tile kernel's rounding).
    ``out`` may alias ``epilogue_residual`` (an in-place ``addmm_``)."""
    a = x
    if norm_weight is not None:
        p = plan_of(x, [w], residual=residual, norm_weight=norm_weight, eps=eps)
        a = norm_launch(p, x, norm_weight, residual, residual_out)
    from decodescope.kernels.specialized import tma_gemm as tm

    if tm.serves(epilogue_residual is not None) and tm.takes(a, w, out):
        tm.tma_gemm(a, w, out, epilogue_residual, **tm.KNOB_TILING)
        return
    _cublas_gemm(a, w, out, epilogue_residual)


def _cublas_gemm(a, w, out, epilogue_residual=None) -> None:
    if epilogue_residual is None:
        torch.mm(a, w.t(), out=out)
    elif out.data_ptr() == epilogue_residual.data_ptr():
        out.addmm_(a, w.t())
    else:
        torch.addmm(epilogue_residual, a, w.t(), out=out)


def mm_add_(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    """``out = bf16(a @ w^T + out)``: one cuBLAS GEMM adding into its BF16 output in the
    epilogue (FP32 accumulation and sum, one rounding)."""
    _cublas_gemm(a, w, out, out)


def mm_f32(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    """``out [M, N] fp32 = a @ w^T`` from BF16 operands, FP32 accumulation, no BF16 rounding:
    one cuBLAS GEMM (``out_dtype``); on a CPU (tests), torch's FP32 matmul."""
    if a.is_cuda:
        torch.mm(a, w.t(), out_dtype=torch.float32, out=out)
    else:
        torch.mm(a.float(), w.float().t(), out=out)


TILE_MAX_M = 64  # rows the tile, skinny and split-K kernels take (TilePlan)


def wide_norm(x, norm_weight, residual=None, residual_out=None, eps=1e-5,
              side=None) -> torch.Tensor:  # fmt: skip
    """The RMSNorm launch of a projection over more than ``TILE_MAX_M`` rows
    (:func:`project_wide`): :mod:`.rmsnorm` on ``x``'s row stride (``q_a`` is a column slice),
    into a cached ``[M, K]`` buffer (returned); ``residual_out = x + residual`` with a residual;
    ``side = (fp32 in, bf16 out)``: the same launch rounds ``in`` into ``out`` (the MoE back's
    shared sum, ``moe_block.wide_back``)."""
    m, k = int(x.shape[0]), int(x.shape[1])
    key = (m, k, str(x.device))
    a = _BUF.get(key)
    if a is None:
        a = _BUF[key] = torch.empty(m, k, dtype=torch.bfloat16, device=x.device)
    if side is None:
        rms.rmsnorm(x, norm_weight, a, eps, residual, residual_out)
    else:
        rms.rmsnorm(x, norm_weight, a, eps, residual, residual_out, side_in=side[0],
                    side_out=side[1])  # fmt: skip
    return a


def project_wide(x, weights, outs, *, residual=None, residual_out=None, norm_weight=None,
                 epilogue_residual=None, eps=1e-5) -> None:  # fmt: skip
    """A projection over more than ``TILE_MAX_M`` rows (a chunked verify step's projections
    once over all of its tokens, ``step.tokens_once``): the norm (if any) as one
    :func:`wide_norm` launch, then one cuBLAS GEMM per weight (``epilogue_residual``: one
    weight, ``bf16(acc + res)`` in one rounding)."""
    if epilogue_residual is not None and len(weights) != 1:
        raise ValueError("project_wide: a residual epilogue takes one weight")
    a = x
    if norm_weight is not None:
        a = wide_norm(x, norm_weight, residual, residual_out, eps)
    for w, o in zip(weights, outs, strict=True):
        _cublas_gemm(a, w, o, epilogue_residual)


def project(x: torch.Tensor, weights: list[torch.Tensor], outs: list[torch.Tensor], **kw) -> None:
    """One projection by the kernel :func:`gemm_plan` picks (``skinny_gemm``'s keywords). A
    folded norm (:func:`folds`) runs on :func:`folded_weight`'s derived weights (made on the
    first call: call :func:`folded_weight` before graph capture); :func:`cublas_serves` hands a
    single-weight one to cuBLAS."""
    if x.shape[0] > TILE_MAX_M:  # no tile kernel takes these rows
        project_wide(x, weights, outs, **kw)
        return
    norm = kw.get("norm_weight") is not None
    res = kw.get("residual") is not None
    if cublas_serves(x.shape[0], x.shape[1], len(weights), norm, res):
        _cublas_project(x, weights[0], outs[0], **kw)
    elif not selected(x.shape[0], x.shape[1], norm, res):
        sk.project(x, weights, outs, **kw)
    elif folds(norm, res, x.shape[0]):
        g = kw.pop("norm_weight")
        tile_gemm(x, [folded_weight(w, g) for w in weights], outs, rms_fold=True, **kw)
    else:
        tile_gemm(x, weights, outs, **kw)


def fold_norm_weight(w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``bf16(W[n, k] * g[k])``: the RMSNorm weight folded into a projection's weight (one
    rounding where vLLM rounds ``bf16(bf16(x * rstd) * g)``; both within BF16 tolerances)."""
    if w.dim() != 2 or g.shape != (w.shape[1],):
        raise ValueError(f"fold_norm_weight: weight {tuple(w.shape)}, norm {tuple(g.shape)}")
    return (w.float() * g.float()).to(w.dtype).contiguous()


_FOLDED: dict[int, tuple[weakref.ref, torch.Tensor, torch.Tensor]] = {}


def folded_weight(w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """:func:`fold_norm_weight` of ``(w, g)``, made once per weight tensor and kept while it
    lives (weights do not change in place during a run; a different ``g`` remakes it)."""
    hit = _FOLDED.get(id(w))
    if hit is None or hit[0]() is not w or hit[1] is not g:
        hit = (weakref.ref(w), g, fold_norm_weight(w, g))
        _FOLDED[id(w)] = hit
        weakref.finalize(w, _FOLDED.pop, id(w), None)
    return hit[2]
