"""Trace-time helpers for the warp-level ``mma.sync`` m16n8k16 (BF16 in, FP32 accumulate) GEMMs
of the specialized kernels (:mod:`skinny_gemm`, :mod:`splitk_gemm`, :mod:`front_mma`,
:mod:`back_mma`, :mod:`oproj_allreduce`).

These are plain Python functions, not ``@cute.jit``: called from a kernel body while it is traced
they emit exactly the IR the same lines written inline would (loops are Python loops, unrolled at
trace time), so moving code into them leaves the generated PTX unchanged
(``scripts/ptx_snapshot.py`` checks that).

Fragment layout of lane ``(g, c) = (lane // 4, lane % 4)``: A (weights) holds rows ``g`` and
``g + 8``, K columns ``8 * s + 2c + {0, 1}`` of 8-element runs ``lo`` (row g) and ``hi``
(row g + 8) loaded at ``k0 = chunk + c * 8``; B (activations) holds 4 K values of token ``g``;
the accumulator holds (row g, tokens 2c + {0, 1}) and (row g + 8, the same tokens).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32


def mma_atom():
    """The m16n8k16 BF16 x BF16 -> FP32 warp MMA atom."""
    return cute.make_mma_atom(cute.nvgpu.warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)))


def zero_accs(n: int) -> list:
    """``n`` zeroed FP32 accumulators (4 registers each)."""
    accs = []
    for _ in range(n):
        a = cute.make_rmem_tensor((4, 1, 1), Float32)
        a.fill(0.0)
        accs.append(a)
    return accs


def fragments():
    """The A (8 x BF16) and B (4 x BF16) operand registers of one MMA."""
    return cute.make_rmem_tensor((8, 1, 1), BFloat16), cute.make_rmem_tensor((4, 1, 1), BFloat16)


def set_a(fa, lo, hi, s: int) -> None:
    """A fragment of K half ``s`` (0 or 1) from the row-g run ``lo`` and row-(g+8) run ``hi``."""
    fa[0] = lo[4 * s + 0]
    fa[1] = lo[4 * s + 1]
    fa[2] = hi[4 * s + 0]
    fa[3] = hi[4 * s + 1]
    fa[4] = lo[4 * s + 2]
    fa[5] = lo[4 * s + 3]
    fa[6] = hi[4 * s + 2]
    fa[7] = hi[4 * s + 3]


def mma_k16(atom, accs, fa, fb, xb, tiles) -> None:
    """Two MMAs (K halves) of one token tile's 8 activations ``xb`` against each weight tile:
    ``tiles`` is a list of ``(lo, hi, acc_index)``."""
    for s in range(2):
        for e in range(4):
            fb[e] = xb[4 * s + e]
        for lo, hi, ai in tiles:
            set_a(fa, lo, hi, s)
            acc = accs[ai]
            cute.gemm(atom, acc, fa, fb, acc)


@cute.jit
def stash_quad_sums(vals, sDst, warp, g, c, nj: cutlass.Constexpr) -> None:
    """Token tile ``j``'s per-lane FP32 value ``vals[j]`` summed over the lane's quad (the 4
    lanes ``c`` of group ``g``: a butterfly over lane bits 0-1), stored by lane ``c == 0`` at
    ``sDst[warp, 8 j + g]`` (the swapped-operand GEMMs' per-token sums of squares: lane (g, c)
    loads token g's columns 8c .. 8c + 7 of every chunk). No barrier."""
    for j in cutlass.range_constexpr(nj):
        s = vals[j]
        s = s + cute.arch.shuffle_sync_bfly(s, offset=1)
        s = s + cute.arch.shuffle_sync_bfly(s, offset=2)
        if c == 0:
            sDst[warp, j * 8 + g] = s


def stash_acc(sRed, warp, g, c, j: int, acc) -> None:
    """Write accumulator ``acc`` of token tile ``j`` to ``sRed[warp, row, token]``."""
    n0 = j * 8 + 2 * c
    sRed[warp, g, n0] = acc[0]
    sRed[warp, g, n0 + 1] = acc[1]
    sRed[warp, g + 8, n0] = acc[2]
    sRed[warp, g + 8, n0 + 1] = acc[3]


def load_row8(mT, r, k0):
    """New registers holding ``mT[r, k0 : k0 + 8]`` (one 16-byte load)."""
    xb = cute.make_rmem_tensor((8,), BFloat16)
    cute.autovec_copy(cute.local_tile(mT[r, None], (8,), (k0 // 8,)), xb)
    return xb


def load_w_tiles(mW, rows, k0, wlo, whi) -> None:
    """Append, for each row-tile base row ``r`` in ``rows``, the 8 weights ``mW[r, k0 : k0 + 8]``
    to ``wlo`` and ``mW[r + 8, k0 : k0 + 8]`` to ``whi`` (16-byte loads)."""
    for r in rows:
        lo = cute.make_rmem_tensor((8,), BFloat16)
        hi = cute.make_rmem_tensor((8,), BFloat16)
        cute.autovec_copy(cute.local_tile(mW[r, None], (8,), (k0 // 8,)), lo)
        cute.autovec_copy(cute.local_tile(mW[r + 8, None], (8,), (k0 // 8,)), hi)
        wlo.append(lo)
        whi.append(hi)


def mma_chunks(atom, accs, fa, fb, mW, rows, nj: int, u: int, k0_of, b_tiles) -> None:
    """One unrolled group of ``u`` K chunks of the swapped-operand GEMM: the weights of all
    ``u`` chunks (row tiles ``rows``) are loaded first, then each chunk's MMAs run.

    ``k0_of(v)`` is lane's K offset in chunk ``v``; ``b_tiles(k0)`` is called once per chunk
    (before its MMAs: a per-chunk prologue such as loading norm weights goes there) and returns
    ``j -> xb``, the 8 activations of token tile ``j``. Accumulator of (row tile q, token tile j)
    is ``accs[q * nj + j]``."""
    rt = len(rows)
    wlo = []
    whi = []
    for v in range(u):
        load_w_tiles(mW, rows, k0_of(v), wlo, whi)
    for v in range(u):
        b_of = b_tiles(k0_of(v))
        for j in range(nj):
            xb = b_of(j)
            tiles = [(wlo[v * rt + q], whi[v * rt + q], q * nj + j) for q in range(rt)]
            mma_k16(atom, accs, fa, fb, xb, tiles)


# -- a private per-lane shared-memory ring (cp.async), for weight streams ----------------------
#
# Register loads keep a warp's bytes in flight only between its load and its MMA: each K step
# ends in a round trip (H200, ncu: the grouped expert kernels spend ~92% of their stall cycles
# on that scoreboard and stream at 2.4-3.0 TB/s where vLLM's pipelined fused_moe reaches 4.3-4.5).
# Here every lane copies the very 16-byte pieces it will read back (cp.async.cg, L2 only), into
# its own slots of a ring ``[warps, stages, pieces, 32 lanes, 16 B]``: no barrier, no cross-lane
# exchange (cp.async.wait_group makes a thread's own copies visible to it), ``stages`` chunks in
# flight per warp at all times, and no registers held by data in flight.


def cp_async16(dst, src) -> None:
    """One 16-byte ``cp.async.cg`` (global -> shared, cached in L2 only) of tile ``src`` into
    tile ``dst`` (both 16 bytes, 16-byte aligned)."""
    cute.arch.inline_ptx(
        "cp.async.cg.shared.global [{$r0}], [{$r1}], 16;",
        read_only_args=[dst.iterator, src.iterator],
    )


def ring_layout(warps: int, stages: int, pieces: int, elems: int):
    """Layout ``(warp, stage, piece, lane, element)`` of a ring of 16-byte pieces (``elems``
    elements each, lane-major inside a piece: a warp's 16-byte reads of one piece are one
    contiguous 512-byte run, free of bank conflicts)."""
    p = 32 * elems
    return cute.make_layout(
        (warps, stages, pieces, 32, elems),
        stride=(stages * pieces * p, pieces * p, p, elems, 1),
    )


def ring_piece(sRing, warp, stage, piece, lane, elems: int):
    """The 16-byte slot ``(warp, stage, piece, lane)`` of a ring as a 1-D tile."""
    return cute.local_tile(sRing[warp, stage, piece, lane, None], (elems,), (0,))


def ring_pipeline(nchunks: int, stages: int, issue, consume) -> None:
    """Software pipeline over ``nchunks`` chunks through a ``stages``-slot ring, unrolled at
    trace time: ``issue(v, slot)`` starts chunk v's copies, ``consume(v, slot)`` reads them back
    and computes (the slot is refilled after ``consume``, whose MMAs used every value read). One
    cp.async group per chunk (empty ones keep the count uniform): before chunk v, all but the
    newest ``stages - 1`` groups have landed, so chunk v has."""
    for v in range(stages):
        if v < nchunks:
            issue(v, v)
        cute.arch.cp_async_commit_group()
    for v in range(nchunks):
        cute.arch.cp_async_wait_group(stages - 1)
        consume(v, v % stages)
        if v + stages < nchunks:
            issue(v + stages, v % stages)
        cute.arch.cp_async_commit_group()


# Driving a ring from a kernel:
#
#     mc.ring_fill(C, NS, issue)        # may precede griddepcontrol.wait (weights)
#     mc.ring_main(C, NS, issue, consume)
#
# ``ring_main`` (a ``@cute.jit`` function, so that its runtime loop is staged) runs
# ``ring_rounds(C, NS)[0]`` runtime rounds of NS ``ring_step``s, then the trace-time
# ``ring_tail``.
# Slots are trace-time constants throughout (a dynamic slot index made the w13 ring MIO-bound
# on the H200); the runtime loop keeps the code (and the registers holding addresses) small.


def ring_rounds(nchunks: int, stages: int) -> tuple[int, int]:
    """``(rounds, tail)``: ``rounds`` runtime rounds of ``stages`` steps that each refill their
    slot, then the trace-time steps ``tail .. nchunks - 1`` (the last ``stages`` of them issue
    nothing)."""
    steady = max(nchunks - stages, 0)
    rounds = steady // stages
    return rounds, rounds * stages


def ring_fill(nchunks: int, stages: int, issue) -> None:
    """Issue chunks ``0 .. stages - 1`` into slots ``0 .. stages - 1``, one group each."""
    for v in range(stages):
        if v < nchunks:
            issue(v, v)
        cute.arch.cp_async_commit_group()


def ring_step(v, slot: int, stages: int, issue, consume) -> None:
    """Chunk ``v`` (its copies landed after the wait) through ``consume(v, slot)``, then
    ``issue(v + stages, slot)`` unless ``issue`` is None; one group committed either way."""
    cute.arch.cp_async_wait_group(stages - 1)
    consume(v, slot)
    if issue is not None:
        issue(v + stages, slot)
    cute.arch.cp_async_commit_group()


def ring_issue_rows(sRing, warp, lane, slot: int, mW, rows, k0, piece0: int = 0) -> None:
    """cp.async of the lane's A-fragment runs ``mW[r, k0:k0+8]`` and ``mW[r+8, k0:k0+8]`` of
    every row-tile base ``r`` in ``rows`` into pieces ``piece0 + 2q`` / ``piece0 + 2q + 1``."""
    for q, r in enumerate(rows):
        for hh in range(2):
            src = cute.local_tile(mW[r + 8 * hh, None], (8,), (k0 // 8,))
            cp_async16(ring_piece(sRing, warp, slot, piece0 + 2 * q + hh, lane, 8), src)


def ring_mma(atom, accs, fa, fb, sRing, warp, lane, slot: int, nrows: int, nj: int, b_of):
    """MMAs of one chunk from the ring: weight runs of ``nrows`` row tiles (pieces 0..2*nrows-1)
    against ``b_of(j)``, the 8 activations of token tile ``j``; ``accs[q * nj + j]``."""
    w = []
    for p in range(2 * nrows):
        t = cute.make_rmem_tensor((8,), BFloat16)
        cute.autovec_copy(ring_piece(sRing, warp, slot, p, lane, 8), t)
        w.append(t)
    for j in range(nj):
        xb = b_of(j)
        tiles = [(w[2 * q], w[2 * q + 1], q * nj + j) for q in range(nrows)]
        mma_k16(atom, accs, fa, fb, xb, tiles)


def ring_tail(tail: int, nchunks: int, stages: int, issue, consume, issued=None) -> None:
    """The trace-time steps ``tail .. nchunks - 1`` after the runtime rounds (see above).
    ``issued()`` (optional) runs once, right after the step that issues the last chunk (or
    first, where the rounds or :func:`ring_fill` issued it)."""
    last = nchunks - stages - 1  # the step that issues chunk nchunks - 1
    if issued is not None and last < tail:
        issued()
    for v in range(tail, nchunks):
        ring_step(v, v % stages, stages, issue if v + stages < nchunks else None, consume)
        if issued is not None and v == last:
            issued()


@cute.jit
def ring_main(nchunks: cutlass.Constexpr, stages: cutlass.Constexpr, issue, consume,
              issued=None):  # fmt: skip
    """Every chunk after :func:`ring_fill`: the runtime rounds, then :func:`ring_tail`
    (``issued``: see there)."""
    rounds, tail = ring_rounds(nchunks, stages)
    for it in cutlass.range(rounds, unroll=1):
        for s in cutlass.range_constexpr(stages):
            ring_step(it * stages + s, s, stages, issue, consume)
    ring_tail(tail, nchunks, stages, issue, consume, issued)


LOADS = ("regs", "ring")


def load_mode(var: str, default: str = "regs", choices=LOADS) -> str:
    """An env knob choosing register loads or the cp.async ring (part of compile keys)."""
    import os

    v = os.environ.get(var, default)
    if v not in choices:
        raise ValueError(f"{var}={v!r}: expected one of {choices}")
    return v
