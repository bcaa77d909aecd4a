"""Device helpers shared by the specialized kernels: vector loads, reductions, activations.

All are ``@cute.jit`` functions inlined into the calling kernel. Reductions are over Float32.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import struct

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32, Int32  # noqa: E402
from cutlass._mlir.dialects import llvm  # noqa: E402
from cutlass.cutlass_dsl import dsl_user_op  # noqa: E402

WARP = 32


@cute.jit
def load_vec8(row: cute.Tensor, k0: Int32, dst: cute.Tensor) -> None:
    """Copy ``row[k0 : k0 + 8]`` (a 1-D global row, 16-byte aligned at k0) into ``dst`` (8 regs).

    With static layouts and a 16-byte aligned base this is one 128-bit load for 16-bit types.
    """
    cute.autovec_copy(cute.local_tile(row, (8,), (k0 // 8,)), dst)


@cute.jit
def store_vec8(src: cute.Tensor, row: cute.Tensor, k0: Int32) -> None:
    """Copy 8 registers into ``row[k0 : k0 + 8]`` (one 128-bit store for 16-bit types)."""
    cute.autovec_copy(src, cute.local_tile(row, (8,), (k0 // 8,)))


def pdl_enabled() -> bool:
    """Programmatic dependent launch for the specialized kernels (``DECODESCOPE_NO_PDL=1``
    turns it off, for A/B timing). Part of every plan (compile key)."""
    return os.environ.get("DECODESCOPE_NO_PDL", "") in ("", "0")


@cute.jit
def pdl_begin() -> None:
    """Wait until the previous grid on the stream has completed and flushed (nothing this
    kernel reads before this point may come from it), then let the next PDL kernel launch:
    its CTAs park in their own wait. Wait-first keeps it correct whatever comes before."""
    cute.arch.griddepcontrol_wait()
    cute.arch.griddepcontrol_launch_dependents()


@cute.jit
def warp_sum(x: Float32) -> Float32:
    """Sum over the 32 lanes of a warp (butterfly: every lane gets the total)."""
    return cute.arch.warp_reduction_sum(x)


@cute.jit
def warp_max(x: Float32) -> Float32:
    return cute.arch.warp_reduction_max(x)


@cute.jit
def block_sum(x: Float32, sred: cute.Tensor, num_warps: cutlass.Constexpr[int]) -> Float32:
    """Sum over all threads of the CTA; ``sred`` is a Float32 smem scratch of >= num_warps.

    Every thread gets the total. Two barriers; ``sred`` may be reused after the call returns.
    """
    tidx, _, _ = cute.arch.thread_idx()
    total = warp_sum(x)
    if cutlass.const_expr(num_warps > 1):
        lane = tidx % WARP
        warp = tidx // WARP
        if lane == 0:
            sred[warp] = total
        cute.arch.sync_threads()
        total = Float32(0.0)
        for i in cutlass.range_constexpr(num_warps):
            total = total + sred[i]
        cute.arch.sync_threads()
    return total


@cute.jit
def block_sums(
    vals: cute.Tensor,
    sred: cute.Tensor,
    num_warps: cutlass.Constexpr[int],
    n: cutlass.Constexpr[int],
    off: cutlass.Constexpr[int] = 0,
) -> None:
    """In place, ``vals[v]`` (``v < n``, Float32 registers) becomes its sum over all threads of
    the CTA, each in :func:`block_sum`'s order (butterfly in the warp, then warp 0, 1, ...).
    One barrier for all ``n``; ``sred[off : off + n * num_warps]`` is the scratch, reusable
    only after another barrier (callers give back-to-back calls disjoint ``off`` ranges)."""
    tidx, _, _ = cute.arch.thread_idx()
    lane = tidx % WARP
    warp = tidx // WARP
    for v in cutlass.range_constexpr(n):
        t = warp_sum(vals[v])
        if lane == 0:
            sred[off + v * num_warps + warp] = t
    cute.arch.sync_threads()
    for v in cutlass.range_constexpr(n):
        t = Float32(0.0)
        for i in cutlass.range_constexpr(num_warps):
            t = t + sred[off + v * num_warps + i]
        vals[v] = t


FAST_SIGMOID_ENV = "DECODESCOPE_FAST_SIGMOID"
SIGMOID_MODES = {"auto": "auto", "0": "div", "1": "approx", "rn": "rn"}
# ``auto`` takes ``rn`` from this many tokens in the step being traced (below: the division)
SIGMOID_RN_FROM_TOKENS = 2
_SIGMOID_TOKENS: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "decodescope_sigmoid_tokens", default=None
)


@contextlib.contextmanager
def sigmoid_tokens(n_tokens: int):
    """Kernels traced (compiled) inside run a step of ``n_tokens`` tokens: what ``auto``
    (:func:`sigmoid_mode`) reads. :class:`.step.SpecializedModel` wraps its steps (warm-up and
    the captured ones) in it; a kernel compiled outside any (a kernel test, ``ptx_snapshot``)
    sees no token count and takes the division."""
    tok = _SIGMOID_TOKENS.set(int(n_tokens))
    try:
        yield
    finally:
        _SIGMOID_TOKENS.reset(tok)


RN_LIMIT = 2.0**126  # recip_ge1's Newton step serves 1 <= e < RN_LIMIT (the division's fast path)
_RN_LIMIT_PTX = f"0f{struct.unpack('<I', struct.pack('<f', RN_LIMIT))[0]:08X}"  # 0f7E800000


def sigmoid_mode() -> str:
    """``DECODESCOPE_FAST_SIGMOID``: how :func:`sigmoid` takes ``1 / (1 + exp(-x))`` in the
    kernel being traced (``div``, ``approx`` or ``rn``).

    - ``auto`` (unset: the default since session 35): ``rn`` where the step being traced has
      ``SIGMOID_RN_FROM_TOKENS`` (2) tokens or more (:func:`sigmoid_tokens`), else ``div``.
      Measured on one H200 (s35, parts 45-46, ``notes/specialized.md``): with ``rn`` the
      projected step was 38-188 us shorter at 8 and 32 tokens (TP8 / TP16, two A/B pairs each;
      KDA / MLA layer shares -2.4 to +0.5 us) but the layers lost 0.7-2.0 us at TP8 with one
      token, so one token keeps the division (its PTX unchanged).
    - ``0``: ``div`` everywhere, the IEEE division (``rcp.rn.f32``), whose SASS puts a
      slow path behind a branch around each reciprocal: ptxas cannot interleave two of them, so
      a lane's sigmoids run one after another (the one-token route ranks 28 scores per lane:
      28 chains of MUFU.EX2, the range check, MUFU.RCP and a Newton step, each ~80-100 cycles).
    - ``1``: ``approx``, ``rcp.approx.ftz.f32`` alone (one MUFU instruction, relative error
      about 2^-23): not always the division's result.
    - ``rn``: ``rn``, :func:`recip_ge1`: the division's own fast-path instructions without the
      branch, so equal to the division bit for bit wherever ``1 + exp(-x) < 2^126`` (``x >
      -87.3``); below, where the division returns a denormal, this returns 0.

    Why: on the H200 (s31, Nsight Compute) the KDA decode's loads stood one at a time between
    the divisions' branches, and every sigmoid in the kernels (the KDA gates, the MLA output
    gate, SiTU in the experts and the dense MLP, the router's scores: :mod:`.moe_common` takes
    this one too since session 34) pays the branch. Read when a kernel is traced (compiled), so
    set it before the process compiles. A bad value raises a one-line ``ValueError``.
    H200 s33 (``1``, whole step at 1x8 / 64x1: correct, not faster) ran with the router's and
    SiTU's sigmoids still on the division (``moe_common`` had its own until session 34)."""
    v = os.environ.get(FAST_SIGMOID_ENV, "") or "auto"
    if v not in SIGMOID_MODES:
        raise ValueError(f"{FAST_SIGMOID_ENV}={v!r}: expected one of {sorted(SIGMOID_MODES)}")
    mode = SIGMOID_MODES[v]
    if mode == "auto":
        n = _SIGMOID_TOKENS.get()
        return "rn" if n is not None and n >= SIGMOID_RN_FROM_TOKENS else "div"
    return mode


def fast_sigmoid_enabled() -> bool:
    """``DECODESCOPE_FAST_SIGMOID=1`` (:func:`sigmoid_mode` ``approx``)."""
    return sigmoid_mode() == "approx"


@dsl_user_op
def recip_ge1(e, *, loc=None, ip=None) -> Float32:
    """``1 / e`` for ``e >= 1`` without a branch: ``r0 = rcp.approx.ftz(e)``, ``r = r0 + r0 *
    (1 - e * r0)`` by two FMAs (the instructions the fast path of ``rcp.rn.f32``, what ``1.0 /
    e`` compiles to, runs: so the same result), taken where ``e < RN_LIMIT`` (2^126, that fast
    path's range), else ``r0`` (0 for ``e`` past 2^126 or infinite, where the division returns
    a denormal or 0; NaN for NaN, as the division)."""
    asm = (
        "{ .reg .f32 r0, t, q; .reg .pred p;"
        " rcp.approx.ftz.f32 r0, $1;"
        " neg.f32 t, $1;"
        " fma.rn.f32 t, t, r0, 0f3F800000;"
        " fma.rn.f32 q, r0, t, r0;"
        f" setp.lt.f32 p, $1, {_RN_LIMIT_PTX};"
        " selp.f32 $0, q, r0, p; }"
    )
    v = llvm.inline_asm(
        Float32.mlir_type,
        [Float32(e).ir_value(loc=loc, ip=ip)],
        asm,
        "=f,f",
        has_side_effects=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )
    return Float32(v)


@cute.jit
def sigmoid(x: Float32) -> Float32:
    e = Float32(1.0) + cute.math.exp(-x, fastmath=True)
    if cutlass.const_expr(sigmoid_mode() == "approx"):
        return cute.arch.rcp_approx(e)
    if cutlass.const_expr(sigmoid_mode() == "rn"):
        return recip_ge1(e)
    return Float32(1.0) / e


@cute.jit
def silu(x: Float32) -> Float32:
    return x * sigmoid(x)


@cute.jit
def to_bf16_f32(x: Float32) -> Float32:
    """Round a Float32 to the nearest BFloat16 and back (what storing to bf16 would do)."""
    return x.to(cutlass.BFloat16).to(Float32)
