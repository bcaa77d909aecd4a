"""The expert part at 1 token on the grouped kernels, with the two waits filled: ``DECODESCOPE_MOE_T1``.

Issue #5, batch-1 target. At 1 token (TP8) the persistent :class:`moe_experts.MoeExpertsPipe`
adds ~55 us to the step for ~143 MB (16 experts x 8.26 MB + the shared down projection 11 MB,
floor ~34 us): one CTA per SM walks a chain of small tiles. The grouped path (route, w13 tile,
w2 tile: three launches, ~0.95x the floor from 8 tokens) has three costs at 1 token that this
module removes or hides, keeping the same three launches and the same outputs:

1. **Too few w13 CTAs.** :class:`grouped_w13_tile.GroupedW13Tile` with its default 64 gate rows
   per item has 6 items per expert: 96 CTAs at 1 token (TP8), fewer than the 132 SMs, each
   streaming 917 KB. Here the same kernel runs with 16 gate rows per item (one warp, 24 items per
   expert: 384 CTAs at TP8, 192 at TP16, each ~229 KB, all resident at once: 6 stages of 12 KB,
   3 CTAs per SM), so every SM streams (``DECODESCOPE_MOE_T1_ROWS`` / ``_STAGES`` / ``_BK``).
2. **The route kernel's latency** (H200: ``thresh`` 6.3 us alone at 1 token) with nothing
   streaming: the w13 CTAs become resident as soon as the route kernel's CTAs pass their own
   PDL wait (it triggers at its top), and before their ``griddepcontrol.wait`` they now compute
   the shared expert's down projection (which needs only the front kernel's output, complete
   by then): ``hs = bf16(SiTU(shared gate, up))`` from ``y_front`` and ``shared_out = hs @
   shared_w2^T``, each CTA ``ceil(H / grid)`` contiguous rows (19 at TP8) copied by
   ``cp.async.cg`` into its (still unused) pipeline stages. So the shared down's 11 MB (TP8)
   stream while the top-k runs, and the w2 kernel has no shared-expert CTAs
   (``DECODESCOPE_MOE_T1_SHARED=w2`` puts them back there, for the A/B).
3. **The w13 -> w2 hand-off.** The w2 CTAs become resident once every w13 CTA has passed its
   wait (the route's lists are final then); before their own wait they read the lists (relaxed
   GPU-scope loads: L2, never a stale L1 line) and issue the ``cp.async`` of their item's whole
   weight block (48 KB at TP8), so the w2 stream starts while the last w13 CTAs finish, and only
   the ``h`` rows wait for w13 (``DECODESCOPE_MOE_T1_W2PRE=0``: the weights after the wait).

4. **The route's own work** (optional, ``DECODESCOPE_MOE_T1_ROUTE=t1``): :class:`RouteT1`, one
   warp that ranks the token with the grouped route's threshold top-k and writes the lists
   directly (at 1 token the picks are distinct: slot = rank by expert index), without the
   grouped route's expert-wide count, scan and barriers.

5. **A persistent w2** (``DECODESCOPE_MOE_T1_W2=persist``, session 11; the default since
   session 12 where the shared down runs in w13 and the experts are TP8-wide or wider,
   ``tile`` for :class:`W2T1`):
   :class:`w2_t1_persist.W2T1Persist` in place of :class:`W2T1`, same arguments and outputs:
   3 CTAs per SM, each a contiguous run of row blocks streamed through one ring across the
   block boundaries (with the shared down in w13 only).

6. **The K chunks split across warps** (``DECODESCOPE_MOE_T1_KW``, session 13): W13T1's items
   with ``kw`` warps each (default 2 where the tiling takes it, else 1), every warp loading and
   warp ``wk`` multiplying the chunks ``i % kw == wk``, the partial sums added through shared
   memory before the SiTU epilogue. Same grid and shared memory, so twice the warps per SM: at
   1 token one warp per item was issue-bound (H200 ncu s13/r1: 4.7 cycles per instruction, 3.0
   TB/s); s13/r2: TP8 w13 alone 30.5 -> 27.5 us, TP16 20.3 -> 17.4. Where the grid fits at 2
   CTAs per SM (TP16: 192 CTAs) and neither knob is set, 4 warps per item on 8 stages
   (:func:`w13_plan`, session 27).

7. **No route kernel** (opt-in, ``DECODESCOPE_MOE_T1_ROUTE=w13``, session 27):
   :class:`W13T1Route` ranks the token itself after its wait (every CTA the same picks), block 0
   writes the lists for w2 and triggers it only after them. H200 s28/n3 (correct: GPU tests and
   the whole step): one kernel fewer per MoE layer at equal time at TP16 (layer shares within
   0.2 us), TP8 +12 us (its lists push the 6-stage form past 3 CTAs per SM).

8. **Two CTAs per item** (opt-in, ``DECODESCOPE_MOE_T1_KSPLIT=2``, session 27): :class:`W13T1KS`,
   each CTA on half of the item's K, the second to arrive adding the partials (a workspace and a
   counter per item) before the SiTU epilogue. Built for a load imbalance (TP16's 192 items sit
   2 on 60 SMs and 1 on 72) that Nsight Compute did not find (s28/n1: ``sm__cycles_active`` max /
   avg 1.06); H200 s28/n2, n5: TP16 +0.4 us per MoE layer (also on 4 warps, 64-wide chunks),
   TP8 +4.6.

The kernels are subclasses of :class:`grouped_w13_tile.GroupedW13Tile` and
:class:`grouped_w2_tile.GroupedW2Tile` (their loaders, fragments and epilogues unchanged; their
files untouched): :class:`W13T1` adds the pre-wait shared down, :class:`W2T1` the pre-wait weight
loads (one item per CTA and one pass per item, which holds up to 8 tokens). The route kernel is
:class:`moe_grouped.GroupedRoute` itself (its shared-SiTU CTA still writes ``hs``; only the
``T1_SHARED=w2`` form reads it).

Selection (read at each call), at ``T1_UPTO`` (1) token: ``DECODESCOPE_MOE_T1`` = ``t1`` (this
module; the default since the H200 run s10/r2 where ``DECODESCOPE_MOE_EXPERTS`` is ``auto`` and
the kernels fit the shapes (:func:`fits`), else the pipe), ``pipe`` (the persistent
:class:`moe_experts.MoeExpertsPipe`, the default before) or ``grouped`` (the grouped kernels'
own defaults). An explicit ``DECODESCOPE_MOE_EXPERTS=pipe|old`` wins; with ``grouped`` the
grouped kernels run unless ``DECODESCOPE_MOE_T1=t1`` is set too. The route defaults to
:class:`RouteT1` (``DECODESCOPE_MOE_T1_ROUTE``).
"""

# no `from __future__ import annotations`: the Smem struct reads its field annotations
import os

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32, Int64, const_expr

from decodescope.kernels.specialized import grouped_w2_tile as gw2
from decodescope.kernels.specialized import grouped_w13_tile as gwt
from decodescope.kernels.specialized import interface as itf
from decodescope.kernels.specialized import mma_common as mc
from decodescope.kernels.specialized import moe_grouped as mg
from decodescope.kernels.specialized import route_topk as rtk
from decodescope.kernels.specialized.moe_common import situ

MODES = ("pipe", "grouped", "t1")  # DECODESCOPE_MOE_T1
# unset DECODESCOPE_MOE_T1 at 1 token (lead's decision from the H200 s10/r2, TP8, experts part
# in the chain: pipe 48.8 us, t1 45.0, t1 with RouteT1 44.0; block 94.8 -> 86.8)
DEFAULT_MODE = "t1"
T1_UPTO = 1  # the modes apply at this many tokens or fewer (the kernels hold up to MAX_T)
MAX_T = 8  # one pass of 8 tokens per expert item (w13 and w2)
ROWS_DEFAULT = 16  # gate rows per w13 item: 24 items per expert at TP8, 12 at TP16
STAGES_DEFAULT = 6  # 6 x 12 KB: 3 CTAs per SM, 5 chunks (40 KB of weights) in flight per CTA
BK_DEFAULT = 128  # 256-byte row runs (the w13 tile's A/B at 8 / 64 tokens: 128 beat 64)
SHARED_WHERE = ("w13", "w2")  # DECODESCOPE_MOE_T1_SHARED
ROUTES = ("grouped", "t1", "w13")  # DECODESCOPE_MOE_T1_ROUTE

ENV = {
    "rows": "DECODESCOPE_MOE_T1_ROWS",
    "stages": "DECODESCOPE_MOE_T1_STAGES",
    "bk": "DECODESCOPE_MOE_T1_BK",
}
KW_ENV = "DECODESCOPE_MOE_T1_KW"  # warps splitting an item's K chunks (W13T1.kw)
# unset DECODESCOPE_MOE_T1_KW: 2 where the tiling takes it (lead's decision from the H200 s13/r2,
# 1 token, graph medians: TP8 w13 alone 30.5 -> 27.5 us, experts 42.1 -> 40.4, block 84.7 ->
# 80.8; TP16 w13 20.3 -> 17.4, experts 31.5 -> 25.9, block 69.5 -> 63.6), else 1
KW_DEFAULT = 2
KW_CHOICES = (1, 2, 4)
KS_ENV = "DECODESCOPE_MOE_T1_KSPLIT"  # CTAs per W13T1 item, each on a part of K (W13T1.KS)
KS_CHOICES = (1, 2)
# Where neither DECODESCOPE_MOE_T1_STAGES nor _KW is set and the w13 grid fits at WIDE_PER_SM
# CTAs per SM (every CTA resident at once, as the pre-wait shared down needs): WIDE_STAGES
# stages and WIDE_KW warps per item (H200 s27/n3, TP16 batch 1, bench, specialized, same call:
# experts share per MoE layer 27.8 / 27.7 -> 25.7 (KDA), 27.7 / 28.0 -> 26.5 (MLA), projected
# step 7.87 / 7.91 -> 7.81 ms against the default on both sides; s27/n4 repeated as the default:
# 7.80 / 7.82 against 7.89 / 7.87 with the old form set explicitly). TP16's 192 CTAs fit on
# 132 SMs; TP8's 384 do not, and keep STAGES_DEFAULT / KW_DEFAULT (TP8's 4-warp form on 64-wide
# chunks, 8 stages: 10.62 against 10.60 / 10.59 ms, s27/n4).
WIDE_STAGES, WIDE_KW, WIDE_PER_SM = 8, 4, 2
SMEM_SM = 228 * 1024  # shared memory of a Hopper SM (each resident CTA also reserves 1 KB)
ZT_ENV = "DECODESCOPE_MOE_T1_ZT"  # 1: W13T1's z stages sized for the pass's tokens (opt-in)


def mode(T: int) -> str:
    """``DECODESCOPE_MOE_T1`` for a step of ``T`` tokens: ``pipe`` above ``T1_UPTO`` tokens, else
    the variable's value; unset: ``DEFAULT_MODE`` (``t1``) where ``DECODESCOPE_MOE_EXPERTS`` is
    ``auto`` (an explicit ``grouped`` keeps the grouped kernels' own: ``grouped``). A bad value
    raises a one-line ``ValueError``. Whether ``t1`` fits the shapes: :func:`fits`."""
    v = os.environ.get("DECODESCOPE_MOE_T1", "")
    if v and v not in MODES:
        raise ValueError(f"DECODESCOPE_MOE_T1={v!r}: expected one of {MODES}")
    if not 1 <= T <= T1_UPTO:
        return "pipe"
    if v:
        return v
    ex = os.environ.get("DECODESCOPE_MOE_EXPERTS", "") or "auto"
    return DEFAULT_MODE if ex == "auto" else "grouped"


def fits(T: int, dims: tuple) -> bool:
    """Whether the ``t1`` kernels (with the knobs in the environment) take these shapes,
    ``dims = (E, K, L, Ie, H, S)`` (their constructors' checks; nothing is compiled)."""
    E, K, L, Ie, H, S = dims
    sh13 = shared_where() == "w13"
    rw = route_where()
    try:
        ks = w13_ks()
        cfg, kw = w13_plan(T, dims, mg.num_sms(), sh13, route=rw == "w13", ks=ks)
        if rw == "w13":
            if T != 1 or not sh13 or ks > 1:
                return False
            W13T1Route(T, E, K, L, Ie, H, S, 1.0, 1.0, cfg=cfg, kw=kw, zt=w13_zt())
        else:
            W13T1(T, E, K, L, Ie, H, S, 1.0, 1.0, cfg=cfg, shared=sh13, kw=kw, zt=w13_zt(),
                  ks=ks)  # fmt: skip
        if w2_persist(Ie):
            if not sh13:
                return False
            from decodescope.kernels.specialized import w2_t1_persist as wp

            wp.W2T1Persist(T, E, K, L, Ie, H, S)
        else:
            W2T1(T, E, K, L, Ie, H, S, kn=w2_knobs(), shared=not sh13, pre=w2_pre())
        if rw == "t1":
            if T != 1 or not sh13:
                return False
            RouteT1(E, K, L, 1.0)
    except ValueError:
        return False
    return True


def use_t1(T: int, dims: tuple) -> bool:
    """Whether a step of ``T`` tokens runs these kernels: :func:`mode` is ``t1``, set explicitly
    (then a knob combination the kernels refuse raises its one-line error at the launch) or by
    default where they :func:`fits` the shapes (else the pipe)."""
    if mode(T) != "t1":
        return False
    return os.environ.get("DECODESCOPE_MOE_T1", "") == "t1" or fits(T, dims)


def w2_knobs() -> gw2.TileKnobs:
    """:func:`grouped_w2_tile.knobs` (``DECODESCOPE_MOE_W2T_*``: warps, stages, ...) with the
    fields :class:`W2T1` decides itself pinned: its item order (one item per CTA, item = CTA),
    no early path of the parent (W2T1 issues its weights before the wait itself), the shared
    expert's register-load CTAs (used with ``DECODESCOPE_MOE_T1_SHARED=w2`` only)."""
    import dataclasses

    kn = gw2.knobs()
    pin = {"order": "stride", "early": 0, "shared": "regs"}
    names = {f.name for f in dataclasses.fields(kn)}
    return dataclasses.replace(kn, **{k: v for k, v in pin.items() if k in names})


def w13_config() -> gwt.TileConfig:
    """The w13 tiling of the ``t1`` mode: ``DECODESCOPE_MOE_T1_ROWS`` (16), ``_STAGES`` (6),
    ``_BK`` (128); one warp per 16 rows, no persistence."""
    vals = {"rows": ROWS_DEFAULT, "stages": STAGES_DEFAULT, "bk": BK_DEFAULT}
    for field, var in ENV.items():
        v = os.environ.get(var, "")
        if v == "":
            continue
        if not v.isdigit():
            raise ValueError(f"{var}={v!r}: expected a positive integer")
        vals[field] = int(v)
    try:
        return gwt.TileConfig(rows=vals["rows"], bk=vals["bk"], stages=vals["stages"], rt=1)
    except ValueError as e:
        raise ValueError(f"DECODESCOPE_MOE_T1_*: {e}") from None


def w13_kw() -> int:
    """``DECODESCOPE_MOE_T1_KW``: the warps of a :class:`W13T1` item that split its K chunks
    between them (1, 2 or 4; unset: ``KW_DEFAULT``, 2, which :func:`w13_kw_for` lowers to 1
    where the tiling cannot take it). A bad value raises a one-line ``ValueError``."""
    v = os.environ.get(KW_ENV, "")
    if v == "":
        return KW_DEFAULT
    if not v.isdigit() or int(v) not in KW_CHOICES:
        raise ValueError(f"{KW_ENV}={v!r}: expected one of {KW_CHOICES}")
    return int(v)


def w13_ks() -> int:
    """``DECODESCOPE_MOE_T1_KSPLIT``: CTAs per :class:`W13T1` item, each on a part of its K
    (``1``, unset: one CTA per item; ``2``: :class:`W13T1KS`, opt-in). A bad value raises a
    one-line ``ValueError``."""
    v = os.environ.get(KS_ENV, "")
    if v == "":
        return 1
    if not v.isdigit() or int(v) not in KS_CHOICES:
        raise ValueError(f"{KS_ENV}={v!r}: expected one of {KS_CHOICES}")
    return int(v)


def w13_zt() -> bool:
    """``DECODESCOPE_MOE_T1_ZT``: ``1`` sizes :class:`W13T1`'s z stages for the step's tokens
    (and what the pre-wait shared down and the K split's partial sums need) instead of 8 token
    slots, so more stages fit the same shared memory (``0`` / unset: 8 slots)."""
    v = os.environ.get(ZT_ENV, "") or "0"
    if v not in ("0", "1"):
        raise ValueError(f"{ZT_ENV}={v!r}: expected 0 or 1")
    return v == "1"


def w13_kw_for(T: int, dims: tuple, cfg: gwt.TileConfig, shared: bool, ks: int = 1) -> int:
    """The K split :class:`W13T1` runs with at these shapes ``dims = (E, K, L, Ie, H, S)`` and
    tiling: :func:`w13_kw`; unset, 1 where the default split does not fit (too few stages or K
    chunks: the tiny preset, ``DECODESCOPE_MOE_T1_STAGES=5``). A value set explicitly is kept
    (the kernel's constructor refuses a bad one with its one-line error)."""
    kw = w13_kw()
    if kw == 1 or os.environ.get(KW_ENV, ""):
        return kw
    try:
        W13T1(T, *dims, 1.0, 1.0, cfg=cfg, shared=shared, kw=kw, zt=w13_zt(), ks=ks)
    except ValueError:
        return 1
    return kw


def w13_plan(T: int, dims: tuple, nsm: int, shared: bool, route: bool = False,
             ks: int = 1) -> tuple[gwt.TileConfig, int]:  # fmt: skip
    """The tiling and K split :class:`W13T1` (``route``: :class:`W13T1Route`) runs with at
    these shapes ``dims = (E, K, L, Ie, H, S)`` on ``nsm`` SMs: with
    ``DECODESCOPE_MOE_T1_STAGES`` and ``_KW`` both unset, the wide form (``WIDE_STAGES`` stages,
    ``WIDE_KW`` warps per item) where it builds and its grid and shared memory fit at
    ``WIDE_PER_SM`` CTAs per SM; else :func:`w13_config` and :func:`w13_kw_for`. A bad knob
    raises its one-line ``ValueError``."""
    import dataclasses

    cfg = w13_config()
    if not (os.environ.get(ENV["stages"], "") or os.environ.get(KW_ENV, "")):
        try:
            wide = dataclasses.replace(cfg, stages=WIDE_STAGES)
            if route:
                op = W13T1Route(T, *dims, 1.0, 1.0, nsm=nsm, cfg=wide, kw=WIDE_KW, zt=w13_zt())
            else:
                op = W13T1(T, *dims, 1.0, 1.0, nsm=nsm, cfg=wide, shared=shared, kw=WIDE_KW,
                           zt=w13_zt(), ks=ks)  # fmt: skip
        except ValueError:
            op = None
        if (op is not None and op.grid <= WIDE_PER_SM * nsm
                and WIDE_PER_SM * (op.smem_total + 1024) <= SMEM_SM):  # fmt: skip
            return wide, WIDE_KW
    return cfg, w13_kw_for(T, dims, cfg, shared, ks)


def shared_where() -> str:
    """``DECODESCOPE_MOE_T1_SHARED``: ``w13`` (default: the shared down before w13's wait) or
    ``w2`` (the w2 kernel's first CTAs, as :class:`grouped_w2_tile.GroupedW2Tile`)."""
    v = os.environ.get("DECODESCOPE_MOE_T1_SHARED", "") or "w13"
    if v not in SHARED_WHERE:
        raise ValueError(f"DECODESCOPE_MOE_T1_SHARED={v!r}: expected one of {SHARED_WHERE}")
    return v


def w2_persist(ie: int | None = None) -> bool:
    """``DECODESCOPE_MOE_T1_W2``: ``persist`` (:class:`w2_t1_persist.W2T1Persist`: a fixed grid
    of CTAs each streaming a contiguous run of row blocks through one ring; the default where the
    shared down runs in w13 and the experts' width per rank ``ie`` is at least
    ``w2_t1_persist.PERSIST_MIN_IE``) or ``tile`` (:class:`W2T1`; the default otherwise)."""
    from decodescope.kernels.specialized import w2_t1_persist as wp

    return wp.variant(ie) == "persist"


def w2_pre() -> bool:
    """``DECODESCOPE_MOE_T1_W2PRE``: ``1`` (default: w2's weights issued before its wait) or
    ``0`` (after it)."""
    v = os.environ.get("DECODESCOPE_MOE_T1_W2PRE", "") or "1"
    if v not in ("0", "1"):
        raise ValueError(f"DECODESCOPE_MOE_T1_W2PRE={v!r}: expected 0 or 1")
    return v == "1"


def route_where() -> str:
    """``DECODESCOPE_MOE_T1_ROUTE``: ``t1`` (:class:`RouteT1`: one warp, 1 token, no
    expert-wide count / scan; it writes no ``hs``, so only with the shared down in w13),
    ``grouped`` (:class:`moe_grouped.GroupedRoute`) or ``w13`` (:class:`W13T1Route`: no route
    kernel, the w13 kernel ranks the token after its wait; opt-in, session 27). Unset: ``t1``
    where the shared down runs in w13 (the default; H200 s10/r2, TP8: experts 45.0 -> 44.0 us,
    route alone 6.2 -> 4.8), else ``grouped``."""
    v = os.environ.get("DECODESCOPE_MOE_T1_ROUTE", "")
    if v == "":
        return "t1" if shared_where() == "w13" else "grouped"
    if v not in ROUTES:
        raise ValueError(f"DECODESCOPE_MOE_T1_ROUTE={v!r}: expected one of {ROUTES}")
    return v


BACK_L2PRE_ENV = "DECODESCOPE_MOE_BACK_L2PRE"
L2_PERSIST_ENV = "DECODESCOPE_L2_PERSIST_MB"
BACK_ROWS = 16  # rows of a BackMma tile (back_mma.ROWS): one prefetch run per tile
PRE_CHUNK = 32 * 1024  # bytes per cp.async.bulk.prefetch.L2 instruction
PRE_MAX_MB = 40  # of the H200's 50 MB of L2


def back_l2pre_mb() -> int:
    """``DECODESCOPE_MOE_BACK_L2PRE``: megabytes of the MoE back's ``latent_up`` that
    :class:`W13T1Pre` prefetches into L2 with the ``evict_last`` priority, first thing in each
    CTA (before its shared down and its PDL wait, which is when the front has completed and the
    route ranks, HBM otherwise idle); the back then reads those bytes from L2. Spread as the
    first bytes of every 16-row tile of the weight (every BackMma CTA finds the same share in
    L2). One token only (the ``t1`` kernels; other token counts launch no W13T1 and ignore
    it). Unset or ``0``: off (W13T1 as before). Opt-in: H200 session 37 (part 50), 12 MB with
    a 16 MB set-aside took a TP16 KDA layer 0.5 us lower at batch 1, the MLA layer not at all."""
    from decodescope.kernels.specialized import env_knobs

    return int(env_knobs.read(BACK_L2PRE_ENV, tuple(range(PRE_MAX_MB + 1)), "0"))


def l2_persist_mb() -> int:
    """``DECODESCOPE_L2_PERSIST_MB``: the L2 set-aside for persisting accesses this process asks
    for (``cuCtxSetLimit(CU_LIMIT_PERSISTING_L2_CACHE_SIZE)``, a limit of this process's context,
    capped by the device's ``persistingL2CacheMaxSize``) where an ``evict_last`` prefetch is on
    (``DECODESCOPE_MOE_BACK_L2PRE``, ``DECODESCOPE_OPROJ_PREFETCH_EVICT=last``). Unset or
    ``0``: none asked (the context's own, 0 unless set elsewhere)."""
    from decodescope.kernels.specialized import env_knobs

    return int(env_knobs.read(L2_PERSIST_ENV, tuple(range(PRE_MAX_MB + 1)), "0"))


_PERSIST_SET: list[int] = []


def apply_l2_persist() -> None:
    """Ask for :func:`l2_persist_mb` once per process (not while a graph is being captured:
    the eager warm-up before capture sets it). A driver error is a one-line ``RuntimeError``."""
    mb = l2_persist_mb()
    if mb == 0 or [mb] == _PERSIST_SET or torch.cuda.is_current_stream_capturing():
        return
    (err,) = cuda.cuCtxSetLimit(cuda.CUlimit.CU_LIMIT_PERSISTING_L2_CACHE_SIZE, mb << 20)
    if err != cuda.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{L2_PERSIST_ENV}={mb}: cuCtxSetLimit failed ({err.name})")
    _PERSIST_SET[:] = [mb]


def back_pre_plan(H: int, L: int, mb: int) -> tuple[int, int, int]:
    """``(tiles, tile_elems, bytes per tile)`` of a ``mb`` MB prefetch of a ``[H, L]`` BF16
    ``latent_up``: its ``H / 16`` row tiles, each prefetched from its start for an equal number
    of bytes (a multiple of 128, at most the tile)."""
    if H % BACK_ROWS:
        raise ValueError(f"{BACK_L2PRE_ENV}: hidden {H} is not a multiple of {BACK_ROWS}")
    n = H // BACK_ROWS
    elems = BACK_ROWS * L
    per = min(elems * 2, ((mb << 20) // n) // 128 * 128)
    if per < 128:
        raise ValueError(f"{BACK_L2PRE_ENV}={mb}: under 128 bytes per tile of {n}")
    return n, elems, per


@cute.jit
def _rank_one(mY, mBias, bias, lane, sIds, sTw, sCnt, sM, sV, sI, sS, E: cutlass.Constexpr[int],
              K: cutlass.Constexpr[int], scaling: cutlass.Constexpr[float],
              CAP: cutlass.Constexpr[int], mIds, mTw, mPairs, mSlotE, mSlotOff, mSlotN,
              mNact):  # fmt: skip
    """One warp ranks the one token (:func:`route_topk.thresh_topk`) and writes the ids,
    weights and the grouped lists (slot ``r`` = the pick of rank ``r`` by expert index): the
    work of :class:`RouteT1`, and of :class:`W13T1Route`'s warp 0 (into shared memory copies of
    the lists, and in block 0 the global ones too)."""
    for i in cutlass.range_constexpr(E // 32):  # thresh_topk counts its picks here
        sCnt[lane + 32 * i] = Int32(0)
    cute.arch.sync_warp()
    rtk.thresh_topk(mY, mBias, bias, 0, lane, 0, sIds, sTw, sCnt, sM, sV, sI, sS, E, K,
                    scaling, CAP)  # fmt: skip
    if lane < K:  # thresh_topk ends with a warp sync: the picks are final
        e = sIds[lane]
        r = Int32(0)
        for i in cutlass.range_constexpr(K):
            r = r + cutlass.select_(sIds[i] < e, Int32(1), Int32(0))
        mIds[lane] = e
        mTw[lane] = sTw[lane]
        mSlotE[r] = e
        mSlotOff[r] = r
        mSlotN[r] = Int32(1)
        mPairs[r] = lane
    if lane == 0:
        mNact[0] = Int32(K)


def _ld(m, i, ty=Int32):
    """A relaxed GPU-scope load of ``m[i]`` (flat index): served by L2, never a stale L1 line.
    For data another grid wrote, read before this grid's ``griddepcontrol.wait``."""
    return cute.arch.load(m.iterator + i, ty, sem="relaxed", scope="gpu")


def _rank_smem(E: int, CAP: int) -> tuple:
    """:func:`_rank_one`'s shared memory for one warp: picks, weights, per-expert counts, the
    warp's maxima and the threshold candidates (values, indices, scores)."""
    smem = cutlass.memory.SmemAllocator()
    return (
        smem.allocate_tensor(Int32, cute.make_layout(32), byte_alignment=16),
        smem.allocate_tensor(Float32, cute.make_layout(32), byte_alignment=16),
        smem.allocate_tensor(Int32, cute.make_layout(E), byte_alignment=16),
        smem.allocate_tensor(Float32, cute.make_layout(32), byte_alignment=16),
        smem.allocate_tensor(Float32, cute.make_layout(CAP + 4), byte_alignment=16),
        smem.allocate_tensor(Int32, cute.make_layout(CAP + 4), byte_alignment=16),
        smem.allocate_tensor(Float32, cute.make_layout(CAP + 4), byte_alignment=16),
    )


class RouteT1:
    """Kernel 1 of the ``t1`` mode with ``DECODESCOPE_MOE_T1_ROUTE=t1``: one warp ranks the one
    token (:func:`route_topk.thresh_topk`, the grouped route's top-k) and writes the ids,
    weights and the grouped lists directly: at 1 token the ``K`` picks are distinct experts, so
    slot ``r`` is the pick of rank ``r`` by expert index (``slot_e`` increasing, ``slot_off[r] =
    r``, ``slot_n[r] = 1``, ``pairs[r]`` = the pick's position ``j``, ``nact = K``), as
    :func:`moe_grouped.lists_from_ids` has them; no expert-wide count, scan or barrier. With
    ``zero_acc`` it then zeroes ``acc``. No ``hs`` (the shared down runs in :class:`W13T1`).
    PDL: the biases before the wait, the trigger right after it (as :class:`moe_grouped.
    GroupedRoute`), so the w13 CTAs are resident during the ranking."""

    def __init__(self, E, K, L, scaling, pdl=True, zero_acc: bool = False):
        if E % 32 or K > 32:
            raise ValueError(f"experts_t1: route needs num_experts {E} % 32 == 0, top_k {K} <= 32")
        if zero_acc and L % 128:
            raise ValueError(f"experts_t1: zero_acc needs latent {L} a multiple of 128")
        self.E, self.K, self.L, self.scaling, self.pdl = E, K, L, scaling, pdl
        self.zero_acc = zero_acc

    @cute.jit
    def __call__(self, mY, mBias, mIds, mTw, mPairs, mSlotE, mSlotOff, mSlotN, mNact, mAcc,
                 stream: cuda.CUstream):  # fmt: skip
        self.kernel(mY, mBias, mIds, mTw, mPairs, mSlotE, mSlotOff, mSlotN, mNact, mAcc).launch(
            grid=[1, 1, 1], block=[32, 1, 1], stream=stream, use_pdl=self.pdl
        )

    @cute.kernel
    def kernel(self, mY, mBias, mIds, mTw, mPairs, mSlotE, mSlotOff, mSlotN, mNact, mAcc):
        E, K, CAP = self.E, self.K, rtk.CAP
        lane = cute.arch.lane_idx()
        sIds, sTw, sCnt, sM, sV, sI, sS = _rank_smem(E, CAP)
        bias = rtk.load_bias(mBias, lane, E)  # a weight: before the PDL wait
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        _rank_one(mY, mBias, bias, lane, sIds, sTw, sCnt, sM, sV, sI, sS, E, K, self.scaling,
                  CAP, mIds, mTw, mPairs, mSlotE, mSlotOff, mSlotN, mNact)  # fmt: skip
        if const_expr(self.zero_acc):  # acc [L] FP32, 16-byte stores
            zv = cute.make_rmem_tensor((4,), Float32)
            for q in cutlass.range_constexpr(4):
                zv[q] = Float32(0.0)
            for i in cutlass.range_constexpr(self.L // 128):
                cute.autovec_copy(zv, cute.local_tile(mAcc, (4,), (lane + 32 * i,)))


EARLY_ENV = "DECODESCOPE_MOE_T1_EARLY"  # router K parts of FrontMmaEarly (RouteT1Early)
EARLY_SPIN_NS = 2_000_000_000  # RouteT1Early's cap on its wait for the front's router CTAs


def early_split() -> int:
    """``DECODESCOPE_MOE_T1_EARLY``: ``2`` or ``4`` runs the one-token route early (the front's
    router rows as that many K parts per row tile, :class:`.front_mma.FrontMmaEarly`, and
    :class:`RouteT1Early` ranking while the front still streams; opt-in, session 28); ``0`` /
    unset: off (returned as 1)."""
    from decodescope.kernels.specialized import front_mma as fm

    v = os.environ.get(EARLY_ENV, "") or "0"
    choices = ("0", *(str(r) for r in fm.EARLY_SPLITS))
    if v not in choices:
        raise ValueError(f"{EARLY_ENV}={v!r}: expected one of {choices}")
    return max(1, int(v))


def early_plan(T: int, dims: tuple, zero_acc: bool) -> int:
    """The router split the block runs its front and route with (1: the usual launches): with
    ``DECODESCOPE_MOE_T1_EARLY`` set, at one token where these kernels run with
    :class:`RouteT1` (``route_where() == "t1"``) after the tensor-core front (``zero_acc``
    False: it zeroes ``acc``), no K split of W13T1; ``dims = (E, K, L, Ie, H, S)``."""
    rks = early_split()
    if rks == 1 or T != 1 or zero_acc or not use_t1(T, dims):
        return 1
    if route_where() != "t1" or w13_ks() > 1 or dims[0] % 16:
        return 1
    return rks


def early_buffers(owner, rks: int, E: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The early route's partial logits (FP32 ``[(rks - 1) * E]``, one token) and its words
    (the arrival counter, zero, reset by :class:`RouteT1Early`; the phases' timer stamps,
    :data:`.front_mma.STAMPS`), kept on ``owner`` (the MoE block; made on
    first use: the warm-up, before graph capture)."""
    have = getattr(owner, "_t1_early", None)
    if have is None or have[0].numel() != (rks - 1) * E:
        from decodescope.kernels.specialized import front_mma as fm

        have = (torch.zeros((rks - 1) * E, dtype=torch.float32, device=device),
                torch.zeros(fm.EARLY_SIG_WORDS, dtype=torch.int32, device=device))  # fmt: skip
        owner._t1_early = have
    return have


class RouteT1Early(RouteT1):
    """:class:`RouteT1` that ranks before its PDL wait (``DECODESCOPE_MOE_T1_EARLY``): resident
    beside :class:`.front_mma.FrontMmaEarly` (which triggers its dependents right after its own
    wait), every lane acquires the front's arrival counter until its ``NSIG`` router CTAs are in
    (capped at ``EARLY_SPIN_NS``: a front that never counts costs 2 s and wrong picks, never a
    hang), the warp adds the ``RKS - 1`` partial logits into ``y``'s router columns (part 0),
    lane 0 resets the counter, and the token is ranked and the lists written while the front
    still streams its latent and shared rows. Only then the wait (the front complete) and the
    trigger: :class:`W13T1`'s pre-wait shared down reads ``y``'s shared columns, so it must not
    become resident before the front is done. Nothing that ran before the front reads the lists
    (PDL's waits chain: every earlier kernel is complete once the front passed its wait, and this
    kernel launches only after that). H200 s28/n7 (TP16 batch 1; correct, the whole step
    against the standard one): slower, each MoE layer +9 us (it became resident 10 us into the
    front and ended 8.6 us after it: the one-warp ranking beside a front that saturates HBM;
    notes/specialized.md, session 28), so off by default."""

    def __init__(self, E, K, L, scaling, pdl=True, rks: int = 4):
        from decodescope.kernels.specialized import front_mma as fm

        super().__init__(E, K, L, scaling, pdl, False)
        if rks not in fm.EARLY_SPLITS or E % fm.ROWS:
            raise ValueError(f"experts_t1: early route split {rks} (one of {fm.EARLY_SPLITS}), "
                             f"num_experts {E} a multiple of {fm.ROWS}")  # fmt: skip
        self.RKS = rks
        self.NSIG = rks * (E // fm.ROWS)

    @cute.jit
    def __call__(self, mY, mBias, mIds, mTw, mPairs, mSlotE, mSlotOff, mSlotN, mNact, mPart,
                 mSig, stream: cuda.CUstream):  # fmt: skip
        self.kernel(mY, mBias, mIds, mTw, mPairs, mSlotE, mSlotOff, mSlotN, mNact, mPart,
                    mSig).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream,
                                 use_pdl=self.pdl)  # fmt: skip

    @cute.kernel
    def kernel(self, mY, mBias, mIds, mTw, mPairs, mSlotE, mSlotOff, mSlotN, mNact, mPart, mSig):
        from decodescope.kernels.specialized import front_mma as fm
        from decodescope.kernels.specialized.comm import global_timer_ns
        from decodescope.kernels.specialized.mla_decode_split import nanosleep

        E, K, CAP = self.E, self.K, rtk.CAP
        lane = cute.arch.lane_idx()
        sIds, sTw, sCnt, sM, sV, sI, sS = _rank_smem(E, CAP)
        if lane == 0:
            fm.stamp(mSig, fm.STAMPS["route_resident"])
        bias = rtk.load_bias(mBias, lane, E)  # a weight: before anything else
        v = cute.arch.load(mSig.iterator, Int32, sem="acquire", scope="gpu")
        if v < self.NSIG:
            t0 = global_timer_ns()
            going = True
            while going:
                nanosleep(64)
                v = cute.arch.load(mSig.iterator, Int32, sem="acquire", scope="gpu")
                if v >= self.NSIG:  # noqa: SIM114 (two DSL branches: no `or` of IR values)
                    going = False
                elif global_timer_ns() - t0 > cutlass.Int64(EARLY_SPIN_NS):
                    going = False
        for i in cutlass.range_constexpr(E // 32):  # part 0, then parts 1.. in order
            e = lane + 32 * i
            acc = mY[0, e]
            for p in cutlass.range_constexpr(self.RKS - 1):
                acc = acc + mPart[p * E + e]
            mY[0, e] = acc
        cute.arch.sync_warp()  # every lane's sums stored, every lane past the counter
        if lane == 0:
            mSig[0] = Int32(0)
            fm.stamp(mSig, fm.STAMPS["route_counted"])
        _rank_one(mY, mBias, bias, lane, sIds, sTw, sCnt, sM, sV, sI, sS, E, K, self.scaling,
                  CAP, mIds, mTw, mPairs, mSlotE, mSlotOff, mSlotN, mNact)  # fmt: skip
        if lane == 0:
            fm.stamp(mSig, fm.STAMPS["route_ranked"])
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
            if lane == 0:
                fm.stamp(mSig, fm.STAMPS["route_waited"])
            cute.arch.griddepcontrol_launch_dependents()


class W13T1(gwt.GroupedW13Tile):
    """Kernel 2 of the ``t1`` mode: :class:`grouped_w13_tile.GroupedW13Tile`'s items (small row
    blocks, :func:`w13_config`), and before the PDL wait (``shared``) the shared expert's down
    projection, ``ceil(H / grid)`` rows per CTA (module docstring)."""

    def __init__(self, T, E, K, L, Ie, H, S, beta, lbeta, pdl=True, nsm: int = 132,
                 cfg: gwt.TileConfig | None = None, shared: bool = True,
                 kw: int = 1, zt: bool = False, ks: int = 1):  # fmt: skip
        cfg = cfg or w13_config()
        if cfg.persist or cfg.mt != 1:
            raise ValueError("experts_t1: the w13 items run without persist, 8 tokens a pass")
        super().__init__(T, E, K, L, Ie, beta, lbeta, pdl, nsm, cfg)
        self.TZ = gwt.TOK  # token slots of a z stage
        self._split_k(kw)
        if not 1 <= T <= MAX_T:
            raise ValueError(f"experts_t1: {T} tokens, expected 1..{MAX_T}")
        if S % 8 or (E + L) % 4:
            raise ValueError(f"experts_t1: shared_inter {S} (multiple of 8), experts + latent "
                             f"{E + L} (multiple of 4)")  # fmt: skip
        self.H, self.SI, self.shared = H, S, shared
        self.US = S // 8  # 16-byte units of a shared_w2 row
        if self.grid != self.slots * self.NRT:
            raise ValueError(f"experts_t1: w13 needs one item per CTA ({self.slots * self.NRT} "
                             f"items, grid {self.grid})")  # fmt: skip
        self._split_items(ks)
        self.RPC = -(-H // self.grid)  # shared_w2 rows per CTA (contiguous)
        cap = (self.S * 2 * self.R * self.BK) // S  # rows the weight stages hold
        if shared and cap < 1:
            raise ValueError(f"experts_t1: a shared_w2 row ({S} x 2 B) exceeds the stages")
        self.RB = min(self.RPC, cap)  # rows per round
        self.NRB = -(-self.RPC // self.RB)
        if shared and T * 2 * S > self.S * gwt.TOK * self.BK:
            raise ValueError(f"experts_t1: {T} tokens' shared gate/up exceed the z stages")
        if zt:  # the fewest slots >= T that still hold the shared gate/up and the partials
            need = max(T * 2 * S if shared else 0, self.NW * 2 * self.RT * 4 * 32)
            self.TZ = max(T, min(gwt.TOK, -(-need // (self.S * self.BK))))

    @property
    def smem_total(self) -> int:
        """Bytes of the kernel's ``Smem`` struct: the weight and z stages (128-byte aligned),
        the shared expert's ``hs`` rows and with ``KS > 1`` the arrival flag."""
        w = self.S * 2 * self.R * self.BK * 2
        z = self.S * self.TZ * self.BK * 4
        n = -(-(w + z) // 128) * 128 + self.T * self.SI * 2
        if self.KS > 1:  # the arrival flag
            n = -(-n // 16) * 16 + 16
        return -(-n // 128) * 128  # the struct's size: a multiple of its 128-byte alignment

    def _split_items(self, ks: int) -> None:
        """``ks`` CTAs per item (``DECODESCOPE_MOE_T1_KSPLIT``), each on ``NCH / ks`` of its K
        chunks (``NCHC``): ``ks`` times the CTAs, so the grid spreads evenly over the SMs where
        whole items cannot (TP16: 192 items on 132 SMs, 60 SMs with two); the halves' FP32
        partials meet in a workspace, the second to arrive (a per-item counter) adds them and
        runs the SiTU epilogue (:meth:`_ks_finish`). ``ks = 1``: the kernel as before."""
        if ks not in KS_CHOICES:
            raise ValueError(f"experts_t1: ks={ks}, expected one of {KS_CHOICES}")
        self.KS, self.NCHC = ks, self.NCH
        if ks == 1:
            return
        self.NCHC = self.NCH // ks
        if self.NCH % ks or self.NCHC % self.KW:
            raise ValueError(f"experts_t1: ks={ks} with kw={self.KW}: {self.NCH} K chunks do not "
                             f"split evenly")  # fmt: skip
        self.grid = self.slots * self.NRT * ks

    @property
    def ks_floats(self) -> int:
        """FP32 words of one item half's partial accumulators in the workspace."""
        return self.NWR * 2 * self.RT * 4 * 32

    def _split_k(self, kw: int) -> None:
        """``kw`` warps per row group (``DECODESCOPE_MOE_T1_KW``): the CTA's ``NWR`` row warps
        times ``kw``; every warp loads, warp ``wk = warp // NWR`` multiplies the chunks
        ``i % kw == wk`` (``kw`` chunks per pipeline step, each in its own stage), and the
        accumulators are summed across ``wk`` in shared memory before the epilogue (in ``wk``
        order: deterministic; a different FP32 summation order than ``kw = 1``).
        ``kw = 1`` is the kernel as before (the same PTX)."""
        if kw not in KW_CHOICES:
            raise ValueError(f"experts_t1: kw={kw}, expected one of {KW_CHOICES}")
        self.KW, self.NWR = kw, self.NW
        if kw == 1:
            return
        if self.S % kw or self.S // kw < 2:
            raise ValueError(f"experts_t1: kw={kw} needs stages a multiple of it, at least "
                             f"2 x kw (stages {self.S})")  # fmt: skip
        if self.NCH % kw:
            raise ValueError(f"experts_t1: kw={kw} must divide the {self.NCH} K chunks")
        self.NW = self.NWR * kw
        self.NT = 32 * self.NW
        units = 2 * self.R * self.UPR  # 16-byte weight pieces of a chunk
        if units % self.NT or self.R % (self.NT // self.UPR):
            raise ValueError(f"experts_t1: kw={kw}: {self.NT} threads do not tile a chunk "
                             f"({2 * self.R} rows x {self.UPR} pieces)")  # fmt: skip
        self.WP = units // self.NT
        self.RS = self.NT // self.UPR
        self.ZP = -(-gwt.TOK * self.UZ // self.NT)
        if self.NW * 2 * self.RT * 4 * 32 > self.S * self.TZ * self.BK:
            raise ValueError(f"experts_t1: kw={kw}: the z stages cannot hold the partial sums")

    def _smem_struct(self):
        """The kernel's ``Smem`` struct: the weight and z stages, the shared expert's ``hs``."""
        S, R, BK = self.S, self.R, self.BK
        HS = self.T * self.SI

        @cute.struct
        class Smem:
            w: cute.struct.Align[cute.struct.MemRange[BFloat16, S * 2 * R * BK], 128]
            z: cute.struct.Align[cute.struct.MemRange[Float32, S * self.TZ * BK], 128]
            hs: cute.struct.Align[cute.struct.MemRange[BFloat16, HS], 16]

        if self.KS == 1:
            return Smem

        @cute.struct
        class SmemKS:  # the K halves' arrival flag after the stages
            w: cute.struct.Align[cute.struct.MemRange[BFloat16, S * 2 * R * BK], 128]
            z: cute.struct.Align[cute.struct.MemRange[Float32, S * self.TZ * BK], 128]
            hs: cute.struct.Align[cute.struct.MemRange[BFloat16, HS], 16]
            flag: cute.struct.Align[cute.struct.MemRange[Int32, 4], 16]

        return SmemKS

    @cute.jit
    def __call__(self, mY, mW13, mH, mPairs, mSlotE, mSlotOff, mSlotN, mNact, mWs2, mShared,
                 stream: cuda.CUstream):  # fmt: skip
        Smem = self._smem_struct()
        self.smem_cls = Smem
        self.kernel(mY, mW13, mH, mPairs, mSlotE, mSlotOff, mSlotN, mNact, mWs2, mShared).launch(
            grid=[self.grid, 1, 1],
            block=[self.NT, 1, 1],
            smem=Smem.size_in_bytes(),
            stream=stream,
            use_pdl=self.pdl,
        )

    @cute.kernel
    def kernel(self, mY, mW13, mH, mPairs, mSlotE, mSlotOff, mSlotN, mNact, mWs2, mShared):
        self._body(mY, mW13, mH, mPairs, mSlotE, mSlotOff, mSlotN, mNact, mWs2, mShared, None)

    @cute.jit
    def _body(self, mY, mW13, mH, mPairs, mSlotE, mSlotOff, mSlotN, mNact, mWs2, mShared, rt,
              kb=None):  # fmt: skip
        """The kernel (traced inline); ``rt``: :class:`W13T1Route`'s ``(mBias, mIds, mTw)``, the
        routing done here after the wait instead of by a route kernel before; ``kb``:
        :class:`W13T1KS`'s ``(workspace, counters)`` (``KS > 1``)."""
        S, R, BK, NRT, Ie, K = self.S, self.R, self.BK, self.NRT, self.Ie, self.K
        TOK = gwt.TOK
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        warp = tid // 32
        lane = tid % 32
        g = lane // 4
        c = lane % 4
        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(self.smem_cls)
        sW = st.w.get_tensor(cute.make_layout((S, 2 * R, BK), stride=(2 * R * BK, BK, 1)))
        TZ = self.TZ
        sZ = st.z.get_tensor(cute.make_layout((S, TZ, BK), stride=(TZ * BK, BK, 1)))
        if const_expr(self.shared):
            sWf = st.w.get_tensor(cute.make_layout(S * 2 * R * BK))
            sZf = st.z.get_tensor(cute.make_layout(S * TZ * BK))
            sHs = st.hs.get_tensor(cute.make_layout((self.T, self.SI), stride=(self.SI, 1)))
            if const_expr(rt is None):
                self._shared_down(mY, mWs2, mShared, sWf, sZf, sHs, tid, bid, warp, lane)
            else:  # the rows (weights) before the wait; gate/up, hs and the dots after it
                self._shared_rows(mWs2, sWf, tid, bid)
        if const_expr(rt is None):
            if const_expr(self.pdl):
                cute.arch.griddepcontrol_wait()
                cute.arch.griddepcontrol_launch_dependents()
        else:
            lists = self._route(mY, rt, smem, sZf if const_expr(self.shared) else None, tid,
                                bid, warp, lane, mPairs, mSlotE, mSlotOff, mSlotN,
                                mNact)  # fmt: skip
            mPairs, mSlotE, mSlotOff, mSlotN, mNact = lists  # this CTA's copies from now on
            if const_expr(self.shared):
                cute.arch.cp_async_wait_group(0)  # the rows and the gate/up values
                cute.arch.barrier()
                self._shared_hs(sZf, sHs, tid)
                cute.arch.barrier()
                r0 = bid * self.RPC
                nr = cutlass.max(cutlass.min(self.H - r0, self.RPC), 0)
                self._shared_dots(mShared, sWf, sHs, r0, nr, warp, lane)
        atom = mc.mma_atom()
        fa, fb = mc.fragments()
        # one item per CTA (the grid is every (slot, row block) item, checked in __init__): the
        # slot's lists read beside nact (the slot exists; used only when it is active); with
        # KS > 1, KS CTAs per item, CTA kh of them on K chunks kc0 .. kc0 + NCHC
        it = bid
        kh = 0
        kc0 = 0
        if const_expr(self.KS > 1):
            it = bid // self.KS
            kh = bid % self.KS
            kc0 = kh * self.NCHC
        a = it // NRT
        row0 = (it % NRT) * R
        nact = mNact[0]
        e = mSlotE[a]
        off = mSlotOff[a]
        n = mSlotN[a]
        if it < nact * NRT:
            mW = mg._expert_mat(mW13, e, 2 * Ie, self.L)
            nn = cutlass.min(n, TOK)  # one pass: n <= T <= 8
            ztok = []
            for i in cutlass.range_constexpr(self.ZP):
                if const_expr(self.T == 1):  # the one token: no pair lookup before the loads
                    ztok.append(Int32(0))
                else:
                    m = tid // self.UZ + i * (self.NT // self.UZ)
                    ztok.append(mPairs[off + cutlass.min(m, nn - 1)] // K)
            pp = [mPairs[off + cutlass.min(2 * c + s, nn - 1)] for s in range(2)]
            cute.arch.barrier()  # every warp is done with the stages (shared down, last item)
            if const_expr(self.KW == 1):
                for s in cutlass.range_constexpr(S - 1):
                    if const_expr(s < self.NCHC):
                        self._load(mW, mY, sW, sZ, row0, ztok, nn, kc0 + s, s, tid)
                    cute.arch.cp_async_commit_group()
                accs = mc.zero_accs(2 * self.RT)
                for i in cutlass.range(self.NCHC, unroll=1):
                    cute.arch.cp_async_wait_group(S - 2)
                    cute.arch.barrier()  # chunk i landed for all; all past chunk i - 1
                    nxt = i + (S - 1)
                    if nxt < self.NCHC:
                        self._load(mW, mY, sW, sZ, row0, ztok, nn, kc0 + nxt, nxt % S, tid)
                    cute.arch.cp_async_commit_group()
                    self._compute(sW, sZ, i % S, warp, g, c, accs, fa, fb, atom, self._zg(g))
                cute.arch.cp_async_wait_group(0)
                if const_expr(self.KS > 1):
                    self._ks_finish(mH, kb, st, accs, pp, nn, row0, warp, g, c, it, kh, tid, lane,
                                    True)  # fmt: skip
                else:
                    self._epilogue(mH, accs, pp, nn, row0, warp, g, c)
            else:
                self._split_k_item(mW, mY, mH, sW, sZ, st, row0, ztok, pp, nn, tid, warp, lane,
                                   g, c, atom, fa, fb, kc0, kb, it, kh)  # fmt: skip

    def _zg(self, g):
        """The z slot lane group ``g`` reads: ``g`` (None) with 8 slots, else clamped to the
        last slot (its MMA column is then a copy; only columns of real tokens are stored)."""
        return None if self.TZ == gwt.TOK else cutlass.min(g, self.TZ - 1)

    @cute.jit
    def _split_k_item(self, mW, mY, mH, sW, sZ, st, row0, ztok, pp, nn, tid, warp, lane, g, c,
                      atom, fa, fb, kc0=0, kb=None, it=None, kh=None):  # fmt: skip
        """The item with ``KW`` warps per row group (:meth:`_split_k`): pipeline steps of ``KW``
        chunks (chunk ``j KW + w`` in stage ``(j % SG) KW + w``, ``SG = S / KW`` steps in the
        ring, one commit group per step), warp ``wk`` multiplies chunk ``j KW + wk``; then the
        ``wk > 0`` warps' accumulators through the (free) z stages into warp ``wk = 0``'s, which
        stores ``h``."""
        S, KW, NWR, RT = self.S, self.KW, self.NWR, self.RT
        SG = S // KW
        NG = self.NCHC // KW
        wr = warp % NWR
        wk = warp // NWR
        for s in cutlass.range_constexpr(SG - 1):
            if const_expr(s < NG):
                for w in cutlass.range_constexpr(KW):
                    self._load(mW, mY, sW, sZ, row0, ztok, nn, kc0 + s * KW + w, s * KW + w,
                               tid)  # fmt: skip
            cute.arch.cp_async_commit_group()
        accs = mc.zero_accs(2 * RT)
        for j in cutlass.range(NG, unroll=1):
            cute.arch.cp_async_wait_group(SG - 2)
            cute.arch.barrier()  # step j landed for all; every warp past step j - 1
            nxt = j + (SG - 1)
            if nxt < NG:
                for w in cutlass.range_constexpr(KW):
                    self._load(mW, mY, sW, sZ, row0, ztok, nn, kc0 + nxt * KW + w,
                               (nxt % SG) * KW + w, tid)  # fmt: skip
            cute.arch.cp_async_commit_group()
            self._compute(sW, sZ, (j % SG) * KW + wk, wr, g, c, accs, fa, fb, atom,
                          self._zg(g))  # fmt: skip
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()  # every warp done with its chunks: the z stages are free
        NA = 2 * RT * 4  # accumulator registers per lane
        sP = st.z.get_tensor(cute.make_layout((self.NW, NA, 32), stride=(NA * 32, 32, 1)))
        if wk > 0:
            for a in cutlass.range_constexpr(2 * RT):
                for e in cutlass.range_constexpr(4):
                    sP[warp, a * 4 + e, lane] = accs[a][e]
        cute.arch.barrier()
        if wk == 0:
            for kk in cutlass.range_constexpr(1, KW):
                for a in cutlass.range_constexpr(2 * RT):
                    for e in cutlass.range_constexpr(4):
                        accs[a][e] = accs[a][e] + sP[kk * NWR + wr, a * 4 + e, lane]
            if const_expr(self.KS == 1):
                self._epilogue(mH, accs, pp, nn, row0, wr, g, c)
        if const_expr(self.KS > 1):
            self._ks_finish(mH, kb, st, accs, pp, nn, row0, wr, g, c, it, kh, tid, lane,
                            wk == 0)  # fmt: skip

    @cute.jit
    def _ks_finish(self, mH, kb, st, accs, pp, nn, row0, wr, g, c, it, kh, tid, lane, holds):
        """``KS = 2``: the item's two K halves meet. The warps that ``holds`` the CTA's final
        accumulators store them to the workspace (``[item, half, row warp, register, lane]``,
        FP32); a GPU-scope fence, then thread 0 counts this half in (acq_rel); the second half
        to arrive reads the other's partial (relaxed GPU-scope loads: L2), adds it (two
        operands: the same sum in either order), runs the SiTU epilogue and zeroes the counter
        (graph-replay safe)."""
        mWs, mCnt = kb
        NA = 2 * self.RT * 4
        per = self.ks_floats
        sFlag = st.flag.get_tensor(cute.make_layout(4))
        if holds:
            base = (it * 2 + kh) * per + wr * NA * 32 + lane
            for a in cutlass.range_constexpr(2 * self.RT):
                for e in cutlass.range_constexpr(4):
                    mWs[base + (a * 4 + e) * 32] = accs[a][e]
        cute.arch.fence_acq_rel_gpu()
        cute.arch.barrier()
        if tid == 0:
            sFlag[0] = cute.arch.atomic_add(mCnt.iterator + it, Int32(1), sem="acq_rel",
                                            scope="gpu")  # fmt: skip
        cute.arch.barrier()
        if sFlag[0] == 1:  # the other half is in the workspace
            cute.arch.fence_acq_rel_gpu()
            if holds:
                ob = (it * 2 + 1 - kh) * per + wr * NA * 32 + lane
                for a in cutlass.range_constexpr(2 * self.RT):
                    for e in cutlass.range_constexpr(4):
                        accs[a][e] = accs[a][e] + _ld(mWs, ob + (a * 4 + e) * 32, Float32)
                self._epilogue(mH, accs, pp, nn, row0, wr, g, c)
            if tid == 0:
                mCnt[it] = Int32(0)

    @cute.jit
    def _shared_down(self, mY, mWs2, mShared, sWf, sZf, sHs, tid, bid, warp, lane):
        """``shared_out[t, r] = hs[t] . shared_w2[r]`` for this CTA's rows ``bid * RPC ..``:
        the tokens' shared gate/up (FP32) into the z stages and the rows into the weight stages
        by ``cp.async.cg`` (L2: the front kernel's output is complete, this grid's wait not yet
        passed), ``hs = bf16(SiTU)`` while the rows land, then a warp per row (lanes on 16-byte
        units, a butterfly sum), plain FP32 stores. Leaves no ``cp.async`` group open."""
        H, US, NT = self.H, self.US, self.NT
        RB = self.RB
        self._shared_gate_up(mY, sZf, tid)
        r0 = bid * self.RPC
        nr = cutlass.max(cutlass.min(H - r0, self.RPC), 0)  # this CTA's rows (0 past H)
        for rb in cutlass.range_constexpr(self.NRB):
            lo = rb * RB
            n_r = cutlass.max(cutlass.min(nr - lo, RB), 0)
            for i in cutlass.range(tid, n_r * US, NT):
                rr = i // US
                u = i % US
                src = cute.local_tile(mWs2[r0 + lo + rr, None], (8,), (u,))
                mc.cp_async16(cute.local_tile(sWf, (8,), (i,)), src)
            cute.arch.cp_async_commit_group()
            if const_expr(rb == 0):  # hs from the gate/up values, while the rows land
                cute.arch.cp_async_wait_group(1)
                cute.arch.barrier()
                self._shared_hs(sZf, sHs, tid)
            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()  # rows and hs visible to every warp
            self._shared_dots(mShared, sWf, sHs, r0 + lo, n_r, warp, lane)
            cute.arch.barrier()  # every warp done with the stages before they are refilled

    @cute.jit
    def _shared_rows(self, mWs2, sWf, tid, bid):
        """``cp.async.cg`` of this CTA's ``shared_w2`` rows (one round: ``NRB == 1``) into the
        weight stages; one commit group. Weights: before the PDL wait."""
        H, US, NT = self.H, self.US, self.NT
        r0 = bid * self.RPC
        nr = cutlass.max(cutlass.min(H - r0, self.RPC), 0)
        for i in cutlass.range(tid, nr * US, NT):
            rr = i // US
            u = i % US
            src = cute.local_tile(mWs2[r0 + rr, None], (8,), (u,))
            mc.cp_async16(cute.local_tile(sWf, (8,), (i,)), src)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def _route(self, mY, rt, smem, sZf, tid, bid, warp, lane, mPairs, mSlotE, mSlotOff, mSlotN,
               mNact):  # fmt: skip
        """:class:`W13T1Route`: the router biases before the PDL wait; after it (the front
        complete) the shared gate/up copies issued, warp 0 ranks the token into shared-memory
        lists (:func:`_rank_one`, the same in every CTA) and block 0 copies them to the global
        lists (for the w2 kernel, which reads them before its own wait: block 0 triggers the
        dependents only after them and a GPU-scope fence; the other blocks right after the
        wait). Returns the shared-memory ``(pairs, slot_e, slot_off, slot_n, nact)``."""
        E, K, CAP = self.E, self.K, rtk.CAP
        mBias, mIds, mTw = rt

        def vec(ty, n):
            return smem.allocate_tensor(ty, cute.make_layout(n), byte_alignment=16)

        sIds, sTw, sCnt, sM = vec(Int32, 32), vec(Float32, 32), vec(Int32, E), vec(Float32, 32)
        sV, sI, sS = vec(Float32, CAP + 4), vec(Int32, CAP + 4), vec(Float32, CAP + 4)
        qIds, qTw, qPairs = vec(Int32, 32), vec(Float32, 32), vec(Int32, 32)
        qSlotE, qSlotOff, qSlotN, qNact = (
            vec(Int32, 32),
            vec(Int32, 32),
            vec(Int32, 32),
            vec(Int32, 4),
        )
        bias = rtk.load_bias(mBias, lane, E)  # a weight: before the PDL wait
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
            if bid != 0:
                cute.arch.griddepcontrol_launch_dependents()
        if const_expr(self.shared):
            self._shared_gate_up(mY, sZf, tid)  # the front's output: after the wait
        if warp == 0:
            _rank_one(mY, mBias, bias, lane, sIds, sTw, sCnt, sM, sV, sI, sS, E, K, self.scaling,
                      CAP, qIds, qTw, qPairs, qSlotE, qSlotOff, qSlotN, qNact)  # fmt: skip
            cute.arch.sync_warp()
            if bid == 0:
                if lane < K:
                    mIds[lane] = qIds[lane]
                    mTw[lane] = qTw[lane]
                    mPairs[lane] = qPairs[lane]
                    mSlotE[lane] = qSlotE[lane]
                    mSlotOff[lane] = qSlotOff[lane]
                    mSlotN[lane] = qSlotN[lane]
                if lane == 0:
                    mNact[0] = qNact[0]
                cute.arch.fence_acq_rel_gpu()
        cute.arch.barrier()  # the lists in shared memory for every warp
        if const_expr(self.pdl):  # noqa: SIM102 (compile-time, then run-time)
            if bid == 0:
                cute.arch.griddepcontrol_launch_dependents()
        return qPairs, qSlotE, qSlotOff, qSlotN, qNact

    @cute.jit
    def _shared_gate_up(self, mY, sZf, tid):
        """``cp.async.cg`` of the tokens' shared gate/up (FP32, the front's output) into the z
        stages; one commit group."""
        T, E, L, SI, NT = self.T, self.E, self.L, self.SI, self.NT
        UY = 2 * SI // 4  # 16-byte units of a token's gate + up (FP32)
        for i in cutlass.range(tid, T * UY, NT):
            t = i // UY
            u = i % UY
            src = cute.local_tile(mY[t, None], (4,), ((E + L) // 4 + u,))
            mc.cp_async16(cute.local_tile(sZf, (4,), (i,)), src)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def _shared_hs(self, sZf, sHs, tid):
        """``hs = bf16(SiTU(gate, up))`` of the staged shared gate/up values."""
        T, SI, NT = self.T, self.SI, self.NT
        for i in cutlass.range(tid, T * SI, NT):
            t = i // SI
            s = i % SI
            hv = situ(sZf[t * 2 * SI + s], sZf[t * 2 * SI + SI + s], self.beta,
                      self.lbeta)  # fmt: skip
            sHs[t, s] = hv.to(BFloat16)

    @cute.jit
    def _shared_dots(self, mShared, sWf, sHs, r0, n_r, warp, lane):
        """Rows ``r0 .. r0 + n_r`` of ``shared_out``: a warp per staged row (lanes on 16-byte
        units, a butterfly sum), plain FP32 stores."""
        T, US, NW = self.T, self.US, self.NW
        for rr in cutlass.range(warp, n_r, NW):
            acc = cute.make_rmem_tensor((T,), Float32)
            acc.fill(0.0)
            for u in cutlass.range(lane, US, 32):
                wv = cute.make_rmem_tensor((8,), BFloat16)
                cute.autovec_copy(cute.local_tile(sWf, (8,), (rr * US + u,)), wv)
                wf = cute.make_rmem_tensor((8,), Float32)
                wf.store(wv.load().to(Float32))
                for t in cutlass.range_constexpr(T):
                    hb = cute.make_rmem_tensor((8,), BFloat16)
                    cute.autovec_copy(cute.local_tile(sHs[t, None], (8,), (u,)), hb)
                    hf = cute.make_rmem_tensor((8,), Float32)
                    hf.store(hb.load().to(Float32))
                    s_ = acc[t]
                    for q in cutlass.range_constexpr(8):
                        s_ = s_ + wf[q] * hf[q]
                    acc[t] = s_
            for t in cutlass.range_constexpr(T):
                v = acc[t]
                for o in cutlass.range_constexpr(5):
                    v = v + cute.arch.shuffle_sync_bfly(v, offset=16 >> o)
                if lane == 0:
                    mShared[t, r0 + rr] = v


class W13T1KS(W13T1):
    """:class:`W13T1` with ``ks`` (2) CTAs per item, each on a part of its K chunks
    (``DECODESCOPE_MOE_T1_KSPLIT=2``, :meth:`W13T1._split_items`): the launch takes the FP32
    workspace (``items x ks x ks_floats``) and the per-item counters (zero at allocation, reset
    by each item's last half)."""

    def __init__(self, T, E, K, L, Ie, H, S, beta, lbeta, pdl=True, nsm: int = 132,
                 cfg: gwt.TileConfig | None = None, shared: bool = True, kw: int = 1,
                 zt: bool = False, ks: int = 2):  # fmt: skip
        if ks < 2:
            raise ValueError(f"experts_t1: W13T1KS needs ks >= 2, got {ks}")
        super().__init__(T, E, K, L, Ie, H, S, beta, lbeta, pdl, nsm, cfg, shared, kw, zt, ks)

    @property
    def items(self) -> int:
        return self.slots * self.NRT

    @cute.jit
    def __call__(self, mY, mW13, mH, mPairs, mSlotE, mSlotOff, mSlotN, mNact, mWs2, mShared,
                 mWs, mCnt, stream: cuda.CUstream):  # fmt: skip
        Smem = self._smem_struct()
        self.smem_cls = Smem
        self.kernel_ks(mY, mW13, mH, mPairs, mSlotE, mSlotOff, mSlotN, mNact, mWs2, mShared, mWs,
                       mCnt).launch(
            grid=[self.grid, 1, 1],
            block=[self.NT, 1, 1],
            smem=Smem.size_in_bytes(),
            stream=stream,
            use_pdl=self.pdl,
        )  # fmt: skip

    @cute.kernel
    def kernel_ks(self, mY, mW13, mH, mPairs, mSlotE, mSlotOff, mSlotN, mNact, mWs2, mShared, mWs,
                  mCnt):  # fmt: skip
        self._body(mY, mW13, mH, mPairs, mSlotE, mSlotOff, mSlotN, mNact, mWs2, mShared, None,
                   (mWs, mCnt))  # fmt: skip


class W13T1Route(W13T1):
    """:class:`W13T1` that routes for itself (``DECODESCOPE_MOE_T1_ROUTE=w13``; one token): no
    route kernel between the front and w13. Every CTA stages its ``shared_w2`` rows before the
    PDL wait (the front's output is not complete then: this grid follows the front directly),
    and after it warp 0 ranks the token (:func:`_rank_one`, :class:`RouteT1`'s work, the same
    picks in every CTA: one deterministic computation on the same logits) into shared-memory
    lists; block 0 also writes the global ids, weights and lists for the w2 kernel and triggers
    the dependents only after them; then the shared down (``hs``, the dots), then the routed
    item as before. The front must zero ``acc`` (the mma front does; :class:`RouteT1`'s
    ``zero_acc`` has no counterpart here)."""

    def __init__(self, T, E, K, L, Ie, H, S, beta, lbeta, pdl=True, nsm: int = 132,
                 cfg: gwt.TileConfig | None = None, kw: int = 1, zt: bool = False,
                 scaling: float = 1.0):  # fmt: skip
        super().__init__(T, E, K, L, Ie, H, S, beta, lbeta, pdl, nsm, cfg, True, kw, zt)
        if T != 1:
            raise ValueError(f"experts_t1: the w13 route ranks one token, got {T}")
        if E % 32 or K > 32:
            raise ValueError(f"experts_t1: route needs num_experts {E} % 32 == 0, top_k {K} <= 32")
        if self.NRB != 1:
            raise ValueError(f"experts_t1: the w13 route stages its {self.RPC} shared rows in "
                             f"one round ({self.RB} fit)")  # fmt: skip
        self.scaling = float(scaling)

    @property
    def route_smem(self) -> int:
        """Bytes of :meth:`W13T1._route`'s shared-memory tensors (16-byte aligned each)."""
        cap = rtk.CAP + 4
        sizes = [32, 32, self.E, 32, cap, cap, cap] + [32] * 6 + [4]
        return sum(-(-4 * n // 16) * 16 for n in sizes)

    @property
    def smem_total(self) -> int:
        return super().smem_total + self.route_smem

    @cute.jit
    def __call__(self, mY, mW13, mH, mPairs, mSlotE, mSlotOff, mSlotN, mNact, mWs2, mShared,
                 mBias, mIds, mTw, stream: cuda.CUstream):  # fmt: skip
        Smem = self._smem_struct()
        self.smem_cls = Smem
        self.kernel_route(mY, mW13, mH, mPairs, mSlotE, mSlotOff, mSlotN, mNact, mWs2, mShared,
                          mBias, mIds, mTw).launch(
            grid=[self.grid, 1, 1],
            block=[self.NT, 1, 1],
            smem=Smem.size_in_bytes() + self.route_smem,
            stream=stream,
            use_pdl=self.pdl,
        )  # fmt: skip

    @cute.kernel
    def kernel_route(self, mY, mW13, mH, mPairs, mSlotE, mSlotOff, mSlotN, mNact, mWs2, mShared,
                     mBias, mIds, mTw):  # fmt: skip
        self._body(mY, mW13, mH, mPairs, mSlotE, mSlotOff, mSlotN, mNact, mWs2, mShared,
                   (mBias, mIds, mTw))  # fmt: skip


class W13T1Pre(W13T1):
    """:class:`W13T1` that first prefetches part of the MoE back's weight into L2
    (``DECODESCOPE_MOE_BACK_L2PRE``, :func:`back_l2pre_mb`): every CTA, before its shared down
    and its PDL wait, issues ``cp.async.bulk.prefetch.L2`` with an ``evict_last`` cache policy
    for its share of the back's row tiles (tile ``bid + i * grid``, the first ``pre`` bytes of
    each). The CTAs become resident when the route kernel passes its own wait, i.e. when the
    front has completed: the prefetch fills the HBM while the route ranks and lands before the
    routed stream; ``evict_last`` is what may keep the lines through the 40-70 MB of w13 and w2
    streamed before the back reads them. Everything after the prefetch is :class:`W13T1`'s."""

    def __init__(self, *args, pre: tuple[int, int, int], **kwargs):
        super().__init__(*args, **kwargs)
        self.PRE_N, self.PRE_E, self.PRE_B = pre
        if self.PRE_B % 16 or self.PRE_B > 2 * self.PRE_E:
            raise ValueError(f"experts_t1: prefetch of {self.PRE_B} B per tile of "
                             f"{2 * self.PRE_E} B")  # fmt: skip
        self.PRE_PER = -(-self.PRE_N // self.grid)  # tiles per CTA (its first threads)
        if self.PRE_PER > self.NT:
            raise ValueError(f"experts_t1: {self.PRE_PER} prefetch tiles per CTA exceed its "
                             f"{self.NT} threads")  # fmt: skip

    @cute.jit
    def __call__(self, mY, mW13, mH, mPairs, mSlotE, mSlotOff, mSlotN, mNact, mWs2, mShared,
                 mPre, stream: cuda.CUstream):  # fmt: skip
        Smem = self._smem_struct()
        self.smem_cls = Smem
        self.kernel_pre(mY, mW13, mH, mPairs, mSlotE, mSlotOff, mSlotN, mNact, mWs2, mShared,
                        mPre).launch(
            grid=[self.grid, 1, 1],
            block=[self.NT, 1, 1],
            smem=Smem.size_in_bytes(),
            stream=stream,
            use_pdl=self.pdl,
        )  # fmt: skip

    @cute.kernel
    def kernel_pre(self, mY, mW13, mH, mPairs, mSlotE, mSlotOff, mSlotN, mNact, mWs2, mShared,
                   mPre):  # fmt: skip
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        if tid < self.PRE_PER:
            tile = bid + tid * self.grid
            if tile < self.PRE_N:
                pol = cute.arch.inline_ptx(
                    "createpolicy.fractional.L2::evict_last.b64 {$w0}, 1.0;",
                    write_only_types=[Int64],
                )
                for j in cutlass.range_constexpr(-(-self.PRE_B // PRE_CHUNK)):
                    nb = min(PRE_CHUNK, self.PRE_B - j * PRE_CHUNK)
                    src = mPre.iterator + (tile * self.PRE_E + j * (PRE_CHUNK // 2))
                    cute.arch.inline_ptx(
                        "cp.async.bulk.prefetch.L2.global.L2::cache_hint [{$r0}], {$r1}, {$r2};",
                        read_only_args=[src, Int32(nb), pol],
                    )
        self._body(mY, mW13, mH, mPairs, mSlotE, mSlotOff, mSlotN, mNact, mWs2, mShared, None)


class W2T1(gw2.GroupedW2Tile):
    """Kernel 3 of the ``t1`` mode: :class:`grouped_w2_tile.GroupedW2Tile`'s items (``cp``
    loads), one per CTA, their route lists read and (``pre``) their weight copies issued before
    the PDL wait; without ``shared`` no shared-expert CTAs (the w13 kernel did that)."""

    def __init__(self, T, E, K, L, Ie, H, S, pdl=True, nsm: int = 132,
                 kn: gw2.TileKnobs | None = None, shared: bool = False,
                 pre: bool = True):  # fmt: skip
        super().__init__(T, E, K, L, Ie, H, S, pdl, nsm, kn)
        if self.bulk:  # (the order knob does not apply: one item per CTA, item = CTA)
            raise ValueError(
                "experts_t1: the w2 tile with cp loads only (DECODESCOPE_MOE_W2T_LOAD)"
            )
        if self.nr < self.slots * self.CE:
            raise ValueError(f"experts_t1: w2 needs one item per CTA ({self.slots * self.CE} "
                             f"items, {self.nr} CTAs: raise DECODESCOPE_MOE_W2T_CAP)")  # fmt: skip
        if not 1 <= T <= self.MP:
            raise ValueError(f"experts_t1: {T} tokens, expected 1..{self.MP} (one pass)")
        self.pre = pre
        if not shared:
            self.CS = 0
            self.grid = self.nr

    @cute.kernel
    def kernel(self, mH, mHs, mW2, mWs2, mAcc, mShared, mPairs, mTw, mSlotE, mSlotOff, mSlotN,
               mNact):  # fmt: skip
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        sW, sX = self.stage_buffers(smem)
        if const_expr(self.CS > 0):
            if bid < self.CS:
                if const_expr(self.pdl):
                    cute.arch.griddepcontrol_wait()
                    cute.arch.griddepcontrol_launch_dependents()
                self._shared(mHs, mWs2, mShared, bid, tid)
            else:
                self._item_t1(mH, mW2, mAcc, mPairs, mTw, mSlotE, mSlotOff, mSlotN, mNact, sW,
                              sX, bid - self.CS, tid)  # fmt: skip
        else:
            self._item_t1(mH, mW2, mAcc, mPairs, mTw, mSlotE, mSlotOff, mSlotN, mNact, sW, sX,
                          bid, tid)  # fmt: skip

    @cute.jit
    def _item_t1(self, mH, mW2, mAcc, mPairs, mTw, mSlotE, mSlotOff, mSlotN, mNact, sW, sX,
                 item, tid):  # fmt: skip
        """Item ``item`` (if it exists): lists and (``pre``) weight copies, the PDL wait, the
        ``h`` rows, the K loop, the weighted atomics. One pass (``n <= T <= MP``)."""
        L, Ie, MP, NCH, NS, U, NT = (self.L, self.Ie, self.MP, self.NCH, self.stages, self.U,
                                     self.NT)  # fmt: skip
        warp = tid // 32
        lane = tid % 32
        g = lane // 4
        c = lane % 4
        a = item // self.CE  # < slots: the grid is every item (checked in __init__)
        row0 = (item % self.CE) * self.R
        total = _ld(mNact, 0) * self.CE
        e = _ld(mSlotE, a)  # beside nact; used only when the slot is active
        off = _ld(mSlotOff, a)
        n = _ld(mSlotN, a)
        if item < total:
            mW = mg._expert_mat(mW2, e, L, Ie)
            if const_expr(self.pre):
                for s in cutlass.range_constexpr(NS - 1):
                    if const_expr(s < NCH):
                        self._load_w(mW, sW, row0, s, s, tid)
            np_ = cutlass.min(n, MP)
            hrows = []
            for i in cutlass.range_constexpr(-(-(MP * U) // NT)):
                t, _ = gw2.piece(tid + i * NT, U)
                hrows.append(_ld(mPairs, off + cutlass.min(t, np_ - 1)))
            slots = []
            for jt in cutlass.range_constexpr(self.MT):
                for s2 in cutlass.range_constexpr(2):
                    j = jt * 8 + 2 * c + s2
                    p = _ld(mPairs, off + cutlass.min(j, np_ - 1))
                    slots.append((j, p, _ld(mTw, p, Float32)))
            if const_expr(self.pdl):
                cute.arch.griddepcontrol_wait()
                cute.arch.griddepcontrol_launch_dependents()
            if const_expr(not self.pre):
                for s in cutlass.range_constexpr(NS - 1):
                    if const_expr(s < NCH):
                        self._load_w(mW, sW, row0, s, s, tid)
            for s in cutlass.range_constexpr(NS - 1):
                if const_expr(s < NCH):
                    self._load_h(mH, sX, hrows, np_, s, s, tid)
                cute.arch.cp_async_commit_group()
            atom = mc.mma_atom()
            fa, fb = mc.fragments()
            accs = mc.zero_accs(self.RT * self.MT)
            for i in cutlass.range_constexpr(NCH):
                cute.arch.cp_async_wait_group(NS - 2)
                cute.arch.barrier()
                nxt = i + NS - 1
                if const_expr(nxt < NCH):
                    self._load_w(mW, sW, row0, nxt, nxt % NS, tid)
                    self._load_h(mH, sX, hrows, np_, nxt, nxt % NS, tid)
                cute.arch.cp_async_commit_group()
                self._compute(sW, sX, i % NS, warp, g, c, accs, fa, fb, atom)
            cute.arch.cp_async_wait_group(0)
            self._epilogue(mAcc, accs, slots, np_, row0, warp, g)


# -- torch-facing --------------------------------------------------------------------------


def build_w13(T, E, K, L, Ie, H, S, beta, lbeta, pdl=True, nsm=132, cfg=None, shared=True,
              kw=1, zt=False):  # fmt: skip
    """``(op, fake args)`` of :class:`W13T1`."""
    op = W13T1(T, E, K, L, Ie, H, S, beta, lbeta, pdl, nsm, cfg, shared, kw, zt)
    i32 = torch.int32
    sl = op.slots
    args = (
        itf.fake(torch.float32, (T, E + L + 2 * S)),
        itf.fake(torch.bfloat16, (E, 2 * Ie, L)),
        itf.fake(torch.bfloat16, (T * K, Ie)),
        itf.fake(i32, (T * K,)),
        itf.fake(i32, (sl,)),
        itf.fake(i32, (sl,)),
        itf.fake(i32, (sl,)),
        itf.fake(i32, (4,)),
        itf.fake(torch.bfloat16, (H, S)),
        itf.fake(torch.float32, (T, H)),
        itf.env_stream(),
    )
    return op, args


def build_w13_pre(T, E, K, L, Ie, H, S, beta, lbeta, pdl=True, nsm=132, cfg=None, shared=True,
                  kw=1, zt=False, pre=None):  # fmt: skip
    """``(op, fake args)`` of :class:`W13T1Pre`: :func:`build_w13`'s and the back's weight as
    ``[tiles, tile_elems]`` (``pre``: :func:`back_pre_plan`; None: its 12 MB plan)."""
    pre = pre or back_pre_plan(H, L, 12)
    op = W13T1Pre(T, E, K, L, Ie, H, S, beta, lbeta, pdl, nsm, cfg, shared, kw, zt, pre=pre)
    _, args = build_w13(T, E, K, L, Ie, H, S, beta, lbeta, pdl, nsm, cfg, shared, kw, zt)
    return op, args[:-1] + (itf.fake(torch.bfloat16, pre[:2]),) + args[-1:]


def build_w2(T, E, K, L, Ie, H, S, pdl=True, nsm=132, kn=None, shared=False, pre=True):
    """``(op, fake args)`` of :class:`W2T1` (:func:`moe_grouped._build_w2`'s argument list)."""
    op = W2T1(T, E, K, L, Ie, H, S, pdl, nsm, kn, shared, pre)
    _, args = gw2.build(T, E, K, L, Ie, H, S, pdl, nsm, op.kn)
    return op, args


def build_w13_ks(T, E, K, L, Ie, H, S, beta, lbeta, pdl=True, nsm=132, cfg=None, shared=True,
                 kw=1, zt=False, ks=2):  # fmt: skip
    """``(op, fake args)`` of :class:`W13T1KS`: :func:`build_w13`'s and the workspace and the
    counters."""
    op = W13T1KS(T, E, K, L, Ie, H, S, beta, lbeta, pdl, nsm, cfg, shared, kw, zt, ks)
    _, args = build_w13(T, E, K, L, Ie, H, S, beta, lbeta, pdl, nsm, cfg, shared, kw, zt)
    extra = (itf.fake(torch.float32, (op.items * ks * op.ks_floats,)),
             itf.fake(torch.int32, (op.items,)))  # fmt: skip
    return op, args[:-1] + extra + args[-1:]


def ks_buffers(bufs, op: W13T1KS, device) -> tuple[torch.Tensor, torch.Tensor]:
    """:class:`W13T1KS`'s workspace and counters, kept on the block's grouped buffers (made on
    first use: the warm-up, before graph capture; the counters zero, reset by the kernel)."""
    n = op.items * op.KS * op.ks_floats
    have = getattr(bufs, "_t1_ks", None)
    if have is None or have[0].numel() < n or have[1].numel() < op.items:
        have = (torch.empty(n, dtype=torch.float32, device=device),
                torch.zeros(op.items, dtype=torch.int32, device=device))  # fmt: skip
        bufs._t1_ks = have
    return have


def build_w13_route(T, E, K, L, Ie, H, S, beta, lbeta, pdl=True, nsm=132, cfg=None, kw=1,
                    zt=False, scaling=1.0):  # fmt: skip
    """``(op, fake args)`` of :class:`W13T1Route`: :func:`build_w13`'s and the router bias,
    the top-k ids and weights."""
    op = W13T1Route(T, E, K, L, Ie, H, S, beta, lbeta, pdl, nsm, cfg, kw, zt, scaling)
    _, args = build_w13(T, E, K, L, Ie, H, S, beta, lbeta, pdl, nsm, cfg, True, kw, zt)
    i32, f32 = torch.int32, torch.float32
    extra = (itf.fake(f32, (E,)), itf.fake(i32, (K,)), itf.fake(f32, (K,)))
    return op, args[:-1] + extra + args[-1:]


def build_route(E, K, L, NF, scaling, pdl=True, zero_acc=False):
    """``(op, fake args)`` of :class:`RouteT1` (``NF``: the front output's width)."""
    op = RouteT1(E, K, L, scaling, pdl, zero_acc)
    i32, f32 = torch.int32, torch.float32
    args = (
        itf.fake(f32, (1, NF)),
        itf.fake(f32, (E,)),
        itf.fake(i32, (K,)),
        itf.fake(f32, (K,)),
        itf.fake(i32, (K,)),
        itf.fake(i32, (K,)),
        itf.fake(i32, (K,)),
        itf.fake(i32, (K,)),
        itf.fake(i32, (4,)),
        itf.fake(f32, (L,)),
        itf.env_stream(),
    )
    return op, args


def build_route_early(E, K, L, NF, scaling, pdl=True, rks=4):
    """``(op, fake args)`` of :class:`RouteT1Early`."""
    op = RouteT1Early(E, K, L, scaling, pdl, rks)
    _, args = build_route(E, K, L, NF, scaling, pdl)
    from decodescope.kernels.specialized import front_mma as fm

    extra = (
        itf.fake(torch.float32, ((rks - 1) * E,)),
        itf.fake(torch.int32, (fm.EARLY_SIG_WORDS,)),
    )
    return op, args[:-2] + extra + args[-1:]


def experts_t1(route, y_front, w13, w2, shared_w2, h, acc, shared_out, topk_w, bufs, *,
               top_k: int, beta: float, lbeta: float, pdl: bool, nsm: int, parts=(0, 1, 2),
               router_bias=None, topk_ids=None, scaling: float = 1.0,
               zero_acc: bool = False, early=None, back_w=None) -> None:  # fmt: skip
    """The ``t1`` launches (called by :func:`moe_grouped.moe_grouped`, which checked the
    tensors and compiled ``route``, the :class:`moe_grouped.GroupedRoute` launch): the route
    (``route``, or :class:`RouteT1` with ``DECODESCOPE_MOE_T1_ROUTE=t1``, which needs
    ``router_bias``, ``topk_ids``, ``scaling``, ``zero_acc``; with ``early = (rks, part, sig)``,
    the buffers the block's :class:`.front_mma.FrontMmaEarly` wrote this step,
    :class:`RouteT1Early`), then :class:`W13T1` (shared down before its wait), then
    :class:`W2T1`. ``parts`` as there. ``back_w``: the MoE back's ``latent_up [H, L]``, which
    :class:`W13T1Pre` prefetches into L2 with ``DECODESCOPE_MOE_BACK_L2PRE`` set."""
    E, twoI, L = w13.shape
    Ie = twoI // 2
    H, S = shared_w2.shape
    T = y_front.shape[0]
    K = top_k
    dims = (T, E, K, L, Ie, H, S)
    sh13 = shared_where() == "w13"
    rw = route_where()
    ks = w13_ks()
    cfg, kw = w13_plan(T, dims[1:], nsm, sh13, route=rw == "w13", ks=ks)
    pre_mb = back_l2pre_mb()
    if pre_mb and (rw == "w13" or ks > 1):
        raise ValueError(f"{BACK_L2PRE_ENV}={pre_mb} runs on the plain W13T1, not with "
                         f"DECODESCOPE_MOE_T1_ROUTE=w13 or {KS_ENV}")  # fmt: skip
    if pre_mb and 1 in parts and (back_w is None or back_w.dtype != torch.bfloat16
                                  or back_w.dim() != 2 or not back_w.is_contiguous()):  # fmt: skip
        raise ValueError(f"{BACK_L2PRE_ENV}={pre_mb} needs the back's weight, a contiguous "
                         f"[H, L] BF16 tensor (the MoE block passes its latent_up)")  # fmt: skip
    if early is not None and rw != "t1":
        raise ValueError(f"{EARLY_ENV}: the early route is RouteT1's (DECODESCOPE_MOE_T1_ROUTE "
                         f"t1, not {rw})")  # fmt: skip
    if rw == "w13":
        if ks > 1:
            raise ValueError(f"DECODESCOPE_MOE_T1_ROUTE=w13 runs one CTA per item, not "
                             f"{KS_ENV}={ks}")  # fmt: skip
        if T != 1 or not sh13 or router_bias is None or topk_ids is None or zero_acc:
            raise ValueError("DECODESCOPE_MOE_T1_ROUTE=w13 needs 1 token, "
                             "DECODESCOPE_MOE_T1_SHARED=w13 and a front that zeroes acc "
                             "(DECODESCOPE_MOE_FRONT mma)")  # fmt: skip

        def route():  # the w13 kernel ranks the token itself
            return None

    elif rw == "t1":
        if T != 1 or not sh13 or router_bias is None or topk_ids is None:
            raise ValueError("DECODESCOPE_MOE_T1_ROUTE=t1 needs 1 token and "
                             "DECODESCOPE_MOE_T1_SHARED=w13")  # fmt: skip
        b0 = bufs
        ids, tw0 = topk_ids.view(-1), topk_w.view(-1)
        if early is not None:
            if zero_acc:
                raise ValueError(f"{EARLY_ENV}: the early route needs a front that zeroes acc")
            rks, part, sig = early
            rk = itf.compiled(
                ("moe_t1_route_early", E, K, L, y_front.shape[1], scaling, pdl, rks),
                lambda: build_route_early(E, K, L, y_front.shape[1], scaling, pdl, rks),
            )

            def route():
                rk(y_front, router_bias, ids, tw0, b0.pairs, b0.slot_e, b0.slot_off,
                   b0.slot_n, b0.nact, part, sig)  # fmt: skip

        else:
            rk = itf.compiled(
                ("moe_t1_route", E, K, L, y_front.shape[1], scaling, pdl, zero_acc),
                lambda: build_route(E, K, L, y_front.shape[1], scaling, pdl, zero_acc),
            )

            def route():
                rk(y_front, router_bias, ids, tw0, b0.pairs, b0.slot_e, b0.slot_off,
                   b0.slot_n, b0.nact, acc.view(-1))  # fmt: skip

    kn = w2_knobs()
    pre = w2_pre()
    zt = w13_zt()
    if rw == "w13":
        w13r = itf.compiled(
            ("moe_t1_w13_route", *dims, beta, lbeta, pdl, nsm, cfg, kw, zt, scaling),
            lambda: build_w13_route(
                T, E, K, L, Ie, H, S, beta, lbeta, pdl, nsm, cfg, kw, zt, scaling
            ),  # fmt: skip
        )
        ids_r, tw_r = topk_ids.view(-1), topk_w.view(-1)

        def w13k(*a):
            w13r(*a, router_bias, ids_r, tw_r)

    elif ks > 1:
        w13s = itf.compiled(
            ("moe_t1_w13_ks", *dims, beta, lbeta, pdl, nsm, cfg, sh13, kw, zt, ks),
            lambda: build_w13_ks(
                T, E, K, L, Ie, H, S, beta, lbeta, pdl, nsm, cfg, sh13, kw, zt, ks
            ),  # fmt: skip
        )
        kop = W13T1KS(T, E, K, L, Ie, H, S, beta, lbeta, pdl, nsm, cfg, sh13, kw, zt, ks)
        ws, cnt = ks_buffers(bufs, kop, y_front.device)

        def w13k(*a):
            w13s(*a, ws, cnt)

    elif pre_mb and 1 in parts:  # (a caller launching the route alone passes no back_w)
        apply_l2_persist()
        pplan = back_pre_plan(back_w.shape[0], back_w.shape[1], pre_mb)
        w13p = itf.compiled(
            ("moe_t1_w13_pre", *dims, beta, lbeta, pdl, nsm, cfg, sh13, kw, zt, pplan),
            lambda: build_w13_pre(
                T, E, K, L, Ie, H, S, beta, lbeta, pdl, nsm, cfg, sh13, kw, zt, pplan
            ),  # fmt: skip
        )
        bw = back_w.view(pplan[0], pplan[1])

        def w13k(*a):
            w13p(*a, bw)

    else:
        w13k = itf.compiled(
            ("moe_t1_w13", *dims, beta, lbeta, pdl, nsm, cfg, sh13)
            + ((("kw", kw),) if kw > 1 else ())
            + ((("zt", 1),) if zt else ()),
            lambda: build_w13(T, E, K, L, Ie, H, S, beta, lbeta, pdl, nsm, cfg, sh13, kw, zt),
        )
    if w2_persist(Ie):  # DECODESCOPE_MOE_T1_W2=persist: the same arguments, another kernel
        from decodescope.kernels.specialized import w2_t1_persist as wp

        if not sh13:
            raise ValueError("DECODESCOPE_MOE_T1_W2=persist needs DECODESCOPE_MOE_T1_SHARED=w13")
        pk = wp.knobs()
        w2k = itf.compiled(
            ("moe_t1_w2p", *dims, pdl, nsm, kn, pk),
            lambda: wp.build(T, E, K, L, Ie, H, S, pdl, nsm, pk),
        )
    else:
        w2k = itf.compiled(
            ("moe_t1_w2", *dims, pdl, nsm, kn, not sh13, pre),
            lambda: build_w2(T, E, K, L, Ie, H, S, pdl, nsm, kn, not sh13, pre),
        )
    b = bufs
    tw = topk_w.view(-1)
    if 0 in parts:
        route()
    if 1 in parts:
        w13k(y_front, w13, h, b.pairs, b.slot_e, b.slot_off, b.slot_n, b.nact, shared_w2,
             shared_out)  # fmt: skip
    if 2 in parts:
        w2k(h, b.hs, w2, shared_w2, acc.view(-1), shared_out, b.pairs, tw, b.slot_e,
            b.slot_off, b.slot_n, b.nact)  # fmt: skip
