"""Device helpers shared by the specialized LatentMoE kernels (router, experts, up-projection).

The one building block is a warp-level skinny GEMV: a warp computes ``R`` weight rows against
``TT`` tokens staged in shared memory. Its lanes split into groups of ``LPR`` lanes (lanes per
row); each group owns one row at a time and walks K in 16-byte chunks (8 bf16), so a warp reads
``32 * 16`` contiguous bytes of a row per step when ``LPR`` is 32. All of a lane's weight chunks
are loaded before the first FMA (``NCH * R`` independent 16-byte loads in flight per lane), the
token vectors come from shared memory, and the partial sums are reduced inside each lane group
with butterfly shuffles. Tokens past ``ntok`` read zeros staged by the caller and are never
stored.

SIMT on purpose: at decode batch sizes an expert sees 1-2 tokens and the dense projections up to
8 tokens per staged tile; tensor-core MMA for larger token counts is the next step (see
notes/specialized_moe.md).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from decodescope.kernels.specialized.utils import sigmoid  # noqa: F401  (DECODESCOPE_FAST_SIGMOID)

VEC = 8  # bf16 elements per 16-byte access
WARP = 32


def lanes_per_row(k: int) -> int:
    """Lanes that share one weight row of width ``k``: the largest power of two <= 32 dividing
    the number of 16-byte chunks of the row."""
    if k % VEC:
        raise ValueError(f"row width {k} is not a multiple of {VEC} (16-byte chunks)")
    chunks = k // VEC
    lpr = WARP
    while chunks % lpr:
        lpr //= 2
    return lpr


@cute.jit
def situ(g: Float32, u: Float32, beta: cutlass.Constexpr[float], lbeta: cutlass.Constexpr[float]):
    """SiTU-and-mul: ``beta*tanh(g/beta)*sigmoid(g) * lbeta*tanh(u/lbeta)``."""
    a = Float32(beta) * cute.math.tanh(g * Float32(1.0 / beta), fastmath=True) * sigmoid(g)
    return a * (Float32(lbeta) * cute.math.tanh(u * Float32(1.0 / lbeta), fastmath=True))


@cute.jit
def load_rows(
    gWv: cute.Tensor,
    row0,
    row_step,
    li,
    R: cutlass.Constexpr[int],
    LPR: cutlass.Constexpr[int],
    NCH: cutlass.Constexpr[int],
):
    """This lane's ``R * NCH`` 16-byte weight chunks (rows ``row0 + r*row_step``), all issued
    before any is used. Returns a list of BF16 vectors, row-major (``r * NCH + j``)."""
    ws = []
    for r in cutlass.range_constexpr(R):
        for j in cutlass.range_constexpr(NCH):
            ws.append(gWv[(0, None), (row0 + r * row_step, li + j * LPR)].load())
    return ws


@cute.jit
def dot_rows(
    ws,
    sXv: cute.Tensor,
    acc: cute.Tensor,
    li,
    R: cutlass.Constexpr[int],
    TT: cutlass.Constexpr[int],
    LPR: cutlass.Constexpr[int],
    NCH: cutlass.Constexpr[int],
):
    """``acc[r, t] = sum_k W[r, k] * X[t, k]`` from loaded chunks ``ws`` and the staged tokens
    ``sXv`` [TT, K] (16-byte chunks); reduced over the lane group (every lane gets the sums)."""
    dot_rows_grp(ws, sXv, list(range(TT)), acc, li, R, TT, LPR, NCH, LPR)


@cute.jit
def dot_rows_idx(
    ws,
    sXv: cute.Tensor,
    rows,
    acc: cute.Tensor,
    li,
    R: cutlass.Constexpr[int],
    TT: cutlass.Constexpr[int],
    LPR: cutlass.Constexpr[int],
    NCH: cutlass.Constexpr[int],
):
    """``dot_rows`` against staged rows ``rows[t]`` of ``sXv`` (a list of TT row indices)."""
    dot_rows_grp(ws, sXv, rows, acc, li, R, TT, LPR, NCH, LPR)


@cute.jit
def warp_gemv(
    gWv: cute.Tensor,
    row0,
    row_step,
    sXv: cute.Tensor,
    acc: cute.Tensor,
    li,
    R: cutlass.Constexpr[int],
    TT: cutlass.Constexpr[int],
    LPR: cutlass.Constexpr[int],
    NCH: cutlass.Constexpr[int],
):
    """``load_rows`` then ``dot_rows``: ``acc[r, t] = sum_k W[row0 + r*row_step, k] * X[t, k]``.

    ``gWv`` / ``sXv``: the weight matrix [rows, K] and the staged tokens [TT, K], both divided
    into 16-byte chunks (``zipped_divide(x, (1, 8))``); ``li`` the lane's index in its group;
    ``NCH`` = K / 8 / LPR chunks per lane.
    """
    ws = load_rows(gWv, row0, row_step, li, R, LPR, NCH)
    dot_rows(ws, sXv, acc, li, R, TT, LPR, NCH)


@cute.jit
def dot_rows_grp(
    ws,
    sXv: cute.Tensor,
    rows,
    acc: cute.Tensor,
    li,
    R: cutlass.Constexpr[int],
    TT: cutlass.Constexpr[int],
    LPR: cutlass.Constexpr[int],
    NCH: cutlass.Constexpr[int],
    RED: cutlass.Constexpr[int],
):
    """``dot_rows_idx`` for a lane group of ``LPR`` threads that may span several warps (chunk
    ``li + j * LPR``): the shuffle reduction covers ``RED = min(LPR, 32)`` lanes, and the caller
    adds the warps' partial sums."""
    for r in cutlass.range_constexpr(R):
        for t in cutlass.range_constexpr(TT):
            acc[r, t] = Float32(0.0)
    for j in cutlass.range_constexpr(NCH):
        for t in cutlass.range_constexpr(TT):
            x = sXv[(0, None), (rows[t], li + j * LPR)].load().to(Float32)
            for r in cutlass.range_constexpr(R):
                w = ws[r * NCH + j].to(Float32)
                acc[r, t] = acc[r, t] + (w * x).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
    for r in cutlass.range_constexpr(R):
        for t in cutlass.range_constexpr(TT):
            acc[r, t] = cute.arch.warp_reduction(
                acc[r, t], lambda a, b: a + b, threads_in_group=RED
            )
