"""``kernels/specialized/experts_t1.py`` (``DECODESCOPE_MOE_T1=t1``, the expert part at 1 token):
compiles for sm_90a on the CPU at the kimi-k3 TP8 / TP16 shapes and the tiny preset; its index
math replayed in Python (every ``h`` element and every shared-expert output row stored exactly
once); the knobs and the selection (default unchanged: the pipe kernel); the block's wiring; on a
GPU (``-m gpu``) the checks of ``scripts/gpu_specialized_moe.py`` (outputs poisoned first)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from decodescope.kernels.config import LayerSpec, get_config
from decodescope.kernels.specialized import experts_t1 as t1
from decodescope.kernels.specialized import grouped_w2_tile as gw2
from decodescope.kernels.specialized import grouped_w13_tile as gt
from decodescope.kernels.specialized import interface as itf  # sets CUTE_DSL_ARCH first
from decodescope.kernels.specialized import moe_grouped as mg
from decodescope.kernels.weights import make_layer_weights

_VARS = ("DECODESCOPE_MOE_T1", "DECODESCOPE_MOE_T1_ROWS", "DECODESCOPE_MOE_T1_STAGES",
         "DECODESCOPE_MOE_T1_BK", "DECODESCOPE_MOE_T1_SHARED", "DECODESCOPE_MOE_T1_W2PRE",
         "DECODESCOPE_MOE_EXPERTS", "DECODESCOPE_MOE_T1_ROUTE", "DECODESCOPE_MOE_T1_KW",
         "DECODESCOPE_MOE_T1_ZT", "DECODESCOPE_MOE_T1_KSPLIT", "DECODESCOPE_MOE_T1_EARLY",
         "DECODESCOPE_FRONT_NORM_FOLD", "DECODESCOPE_MOE_FRONT", "DECODESCOPE_MOE_BACK_L2PRE",
         "DECODESCOPE_L2_PERSIST_MB")  # fmt: skip


@pytest.fixture
def clean_env(monkeypatch):
    for v in _VARS:
        monkeypatch.delenv(v, raising=False)
    return monkeypatch


def _dims(preset: str, tp: int, T: int = 1):
    cfg = get_config(preset, tp)
    e = cfg.moe
    return (T, e.num_experts, e.top_k, cfg.expert_dim, cfg.expert_inter, cfg.hidden,
            cfg.shared_inter)  # fmt: skip


@pytest.mark.parametrize("tp", [8, 16])
def test_compiles_kimi_k3(tp, clean_env):
    """Both kernels at 1 token with the default knobs: w13 with the shared down before its
    wait, w2 without shared-expert CTAs and with its weights before its wait."""
    d = _dims("kimi-k3", tp)
    op, args = t1.build_w13(*d, 4.0, 25.0)
    assert (op.R, op.S, op.BK, op.NW, op.shared) == (16, 6, 128, 1, True)
    assert op.grid == 16 * d[4] // 16  # 16 experts x Ie / 16 items, all resident
    assert op.RPC * op.grid >= d[5] and op.NRB == 1
    assert itf.compile_only(op, *args) is not None
    op2, args2 = t1.build_w2(*d)
    assert op2.CS == 0 and op2.grid == op2.nr == 16 * d[3] // op2.R and op2.pre
    assert itf.compile_only(op2, *args2) is not None


@pytest.mark.parametrize("w2sh,pre", [(True, False)])
def test_compiles_ab_forms(w2sh, pre, clean_env):
    """The A/B forms at TP8: the shared down in w2's first CTAs, w2's weights after the wait."""
    d = _dims("kimi-k3", 8)
    op, args = t1.build_w13(*d, 4.0, 25.0, shared=not w2sh)
    assert not op.shared
    assert itf.compile_only(op, *args) is not None
    op2, args2 = t1.build_w2(*d, shared=w2sh, pre=pre)
    assert op2.CS > 0 and op2.grid == op2.CS + op2.nr and not op2.pre
    assert itf.compile_only(op2, *args2) is not None
    op3, args3 = t1.build_w2(*d, kn=gw2.TileKnobs(warps=2))  # the script's _w2w2
    assert op3.R == 32 and op3.grid == 16 * d[3] // 32
    assert itf.compile_only(op3, *args3) is not None


@pytest.mark.parametrize("tp,kw,bk,stages", [(8, 2, 128, 6), (16, 2, 128, 6), (8, 4, 64, 8),
                                              (16, 4, 128, 8)])  # fmt: skip
def test_compiles_split_k(tp, kw, bk, stages, clean_env):
    """W13T1 with ``kw`` warps splitting each item's K chunks (``DECODESCOPE_MOE_T1_KW``): the
    same grid and shared memory, ``kw`` times the threads, the loads spread over all of them."""
    d = _dims("kimi-k3", tp)
    c = gt.TileConfig(16, bk, stages, 1)
    op, args = t1.build_w13(*d, 4.0, 25.0, True, 132, c, True, kw)
    base = t1.W13T1(*d, 4.0, 25.0, cfg=c)
    assert (op.KW, op.NWR, op.NW, op.NT, op.grid) == (kw, 1, kw, 32 * kw, base.grid)
    assert op.WP * op.NT == base.WP * base.NT and op.R % op.RS == 0
    assert itf.compile_only(op, *args) is not None


def test_split_k_refused(clean_env):
    """One-line errors for K splits the ring or the chunks cannot take."""
    d = _dims("kimi-k3", 8)
    with pytest.raises(ValueError, match="kw=3"):
        t1.W13T1(*d, 4.0, 25.0, kw=3)
    with pytest.raises(ValueError, match="stages a multiple"):
        t1.W13T1(*d, 4.0, 25.0, cfg=gt.TileConfig(16, 128, 5, 1), kw=2)
    with pytest.raises(ValueError, match="stages a multiple"):
        t1.W13T1(*d, 4.0, 25.0, cfg=gt.TileConfig(16, 128, 6, 1), kw=4)
    clean_env.setenv("DECODESCOPE_MOE_T1_KW", "3")
    with pytest.raises(ValueError, match="DECODESCOPE_MOE_T1_KW='3'"):
        t1.w13_kw()
    clean_env.setenv("DECODESCOPE_MOE_T1_KW", "2")
    assert t1.w13_kw() == 2 and t1.fits(1, _dims("kimi-k3", 8)[1:])
    clean_env.setenv("DECODESCOPE_MOE_T1_STAGES", "5")  # kw 2 with 5 stages: not taken
    assert not t1.fits(1, _dims("kimi-k3", 8)[1:])
    clean_env.delenv("DECODESCOPE_MOE_T1_KW")  # unset: the default split where it fits, else 1
    assert t1.fits(1, _dims("kimi-k3", 8)[1:])
    assert t1.w13_kw_for(1, _dims("kimi-k3", 8)[1:], t1.w13_config(), True) == 1


@pytest.mark.parametrize("tp,kw,bk,stages,tz", [(8, 2, 128, 8, 2), (16, 2, 128, 8, 1),
                                               (8, 1, 128, 8, 2), (8, 2, 64, 8, 3)])  # fmt: skip
def test_tight_z(tp, kw, bk, stages, tz, clean_env):
    """``DECODESCOPE_MOE_T1_ZT=1``: z stages of the fewest token slots that hold the token, the
    pre-wait shared gate/up and the K split's partial sums, so 8 stages of 128 K fit the shared
    memory of today's 6 (3 CTAs per SM at TP8)."""
    d = _dims("kimi-k3", tp)
    c = gt.TileConfig(16, bk, stages, 1)
    op, args = t1.build_w13(*d, 4.0, 25.0, True, 132, c, True, kw, True)
    slots = op.TZ
    assert slots == tz and op.S * slots * op.BK >= max(2 * d[6], op.NW * 2 * op.RT * 4 * 32)
    assert itf.compile_only(op, *args) is not None
    clean_env.setenv("DECODESCOPE_MOE_T1_ZT", "1")
    clean_env.setenv("DECODESCOPE_MOE_T1_STAGES", str(stages))
    clean_env.setenv("DECODESCOPE_MOE_T1_BK", str(bk))
    assert t1.w13_zt() and t1.fits(1, d[1:])
    clean_env.setenv("DECODESCOPE_MOE_T1_ZT", "2")
    with pytest.raises(ValueError, match="DECODESCOPE_MOE_T1_ZT='2'"):
        t1.w13_zt()


@pytest.mark.parametrize("preset,tp,kw", [("kimi-k3", 8, 2), ("kimi-k3", 16, 2), ("tiny", 1, 1)])
def test_split_k_default(preset, tp, kw, clean_env):
    """Unset ``DECODESCOPE_MOE_T1_KW``: 2 at the kimi-k3 shapes (H200 s13/r2), 1 where the K
    chunks are too few to split (tiny: one chunk); the block compiles W13T1 with it."""
    d = _dims(preset, tp)
    assert t1.w13_kw_for(1, d[1:], t1.w13_config(), True) == kw


@pytest.mark.parametrize("preset,tp,nsm,stages,kw", [
    ("kimi-k3", 16, 132, 8, 4),  # 192 CTAs: 2 per SM on an H200
    ("kimi-k3", 16, 96, 8, 4),   # 192 = 2 x 96
    ("kimi-k3", 16, 95, 6, 2),   # one CTA too many for 2 per SM
    ("kimi-k3", 8, 132, 6, 2),   # 384 CTAs need 3 per SM: the 6-stage form
    ("tiny", 1, 132, 6, 1),      # one K chunk: neither split nor wide
])  # fmt: skip
def test_wide_default(preset, tp, nsm, stages, kw, clean_env):
    """Unset ``DECODESCOPE_MOE_T1_STAGES`` and ``_KW``: 8 stages and 4 warps per item where the
    w13 grid fits at 2 CTAs per SM (:func:`experts_t1.w13_plan`), else the 6-stage form with
    :func:`experts_t1.w13_kw_for`; what :func:`experts_t1.fits` and the launch use."""
    d = _dims(preset, tp)
    cfg, k = t1.w13_plan(1, d[1:], nsm, True)
    assert (cfg.stages, k) == (stages, kw)
    op = t1.W13T1(*d, 4.0, 25.0, nsm=nsm, cfg=cfg, kw=k)
    if stages == t1.WIDE_STAGES:
        assert op.grid <= 2 * nsm and 2 * (op.smem_total + 1024) <= t1.SMEM_SM
        assert op.NW == 4 and t1.fits(1, d[1:])


@pytest.mark.parametrize("var,val", [("DECODESCOPE_MOE_T1_STAGES", "6"),
                                     ("DECODESCOPE_MOE_T1_KW", "2")])  # fmt: skip
def test_wide_default_explicit(var, val, clean_env):
    """Either knob set explicitly turns the wide default off (the A/B's old form: both set)."""
    d = _dims("kimi-k3", 16)
    clean_env.setenv(var, val)
    cfg, k = t1.w13_plan(1, d[1:], 132, True)
    assert (cfg.stages, k) == (6, 2)
    clean_env.setenv("DECODESCOPE_MOE_T1_STAGES", "8")
    clean_env.setenv("DECODESCOPE_MOE_T1_KW", "4")
    cfg, k = t1.w13_plan(1, d[1:], 132, True)
    assert (cfg.stages, k) == (8, 4)


def test_smem_total_matches_struct(clean_env):
    """``W13T1.smem_total`` is the size of the ``Smem`` struct the kernel allocates."""
    d = _dims("kimi-k3", 16)
    cfg, k = t1.w13_plan(1, d[1:], 132, True)
    op, args = t1.build_w13(*d, 4.0, 25.0, True, 132, cfg, True, k)
    assert itf.compile_only(op, *args) is not None
    assert op.smem_cls.size_in_bytes() == op.smem_total


def _recorded_block(mp, preset: str = "kimi-k3", tp: int = 16):
    """A one-token :class:`SpecializedMoE` (TP16 kimi-k3 unless said) whose launches are
    recorded (``(name, number of arguments, the last argument)``) and whose ops are built, not
    compiled (``itf.compiled`` replaced)."""
    from decodescope.kernels.specialized.moe_block import SpecializedMoE

    calls, built = [], []

    def fake_compiled(key, build):
        op, _ = build()
        built.append(op)
        return lambda *a, key=key: calls.append((key[0], len(a), a[-1] if a else None))

    mp.setattr(itf, "compiled", fake_compiled)
    cfg = get_config(preset, tp)
    w = make_layer_weights(cfg, LayerSpec(1, "kda", "moe"), seed=1)
    return SpecializedMoE(cfg, w, 1), calls, built


@pytest.mark.parametrize("tp", [8, 16])
def test_ksplit(tp, clean_env):
    """``DECODESCOPE_MOE_T1_KSPLIT=2`` (:class:`W13T1KS`): two CTAs per item, each on 14 of its
    28 K chunks (the 6-stage, 2-warp form: the wide one's 4 warps do not divide 14), the grid
    doubled (TP16 384 CTAs: 3 per SM on 120 SMs and 2 on 12 instead of 2 on 60 and 1 on 72),
    every (item, half) one CTA; the PTX: one acq_rel atomic (the arrival, GPU scope), relaxed
    GPU-scope loads of the other half, the fence before the atomic; the workspace sized from
    the op and kept on the buffers."""
    d = _dims("kimi-k3", tp)
    clean_env.setenv("DECODESCOPE_MOE_T1_KSPLIT", "2")
    assert t1.w13_ks() == 2 and t1.fits(1, d[1:])
    cfg, kw = t1.w13_plan(1, d[1:], 132, True, ks=t1.w13_ks())
    assert (cfg.stages, kw) == (6, 2)
    op, args = t1.build_w13_ks(*d, 4.0, 25.0, True, 132, cfg, True, kw, False, 2)
    assert op.grid == 2 * op.items == 2 * 16 * d[4] // 16 and op.NCHC * 2 == op.NCH
    assert sorted((b // 2, b % 2) for b in range(op.grid)) == [
        (i, h) for i in range(op.items) for h in range(2)
    ]
    assert op._smem_struct().size_in_bytes() == op.smem_total
    assert 3 * (op.smem_total + 1024) <= t1.SMEM_SM  # 3 per SM
    ptx = itf.ptx_text(op, *args)
    atom = ptx.find("atom.global.acq_rel.add")  # GPU scope: PTX's default
    assert atom > 0 and ptx.count("atom.") == 1
    assert 0 < ptx.find("fence.acq_rel.gpu") < atom
    assert ptx.count("ld.relaxed.gpu") >= 2 * op.RT * 4
    assert itf.compile_only(op, *args) is not None

    class Bufs:
        pass

    b = Bufs()
    ws, cnt = t1.ks_buffers(b, op, torch.device("cpu"))
    assert ws.numel() == op.items * 2 * op.ks_floats and int(cnt.abs().sum()) == 0
    assert t1.ks_buffers(b, op, torch.device("cpu"))[0] is ws  # kept


def test_ksplit_selection(clean_env):
    """The block's launches with ``KSPLIT=2``: the route, W13T1KS with the workspace and the
    counters (12 tensors), w2; with the w13 route: not taken by default (the pipe, as any
    combination the t1 kernels refuse), a one-line error with ``DECODESCOPE_MOE_T1=t1``; a bad
    value, one line."""
    mp = clean_env
    blk, calls, built = _recorded_block(mp)
    mp.setenv("DECODESCOPE_MOE_T1_KSPLIT", "2")
    blk.experts()
    assert [c[0] for c in calls] == ["moe_t1_route", "moe_t1_w13_ks", "moe_t1_w2"]
    assert calls[1][1] == 12 and isinstance(built[1], t1.W13T1KS) and built[1].KS == 2
    mp.setenv("DECODESCOPE_MOE_T1_ROUTE", "w13")
    assert not t1.fits(1, _dims("kimi-k3", 16)[1:])  # unset DECODESCOPE_MOE_T1: the pipe
    mp.setenv("DECODESCOPE_MOE_T1", "t1")  # set: the refusal is the launch's one-line error
    with pytest.raises(ValueError, match="DECODESCOPE_MOE_T1_ROUTE=w13 runs one CTA per item"):
        blk.experts()
    mp.setenv("DECODESCOPE_MOE_T1_KSPLIT", "3")
    with pytest.raises(ValueError, match="DECODESCOPE_MOE_T1_KSPLIT='3'"):
        t1.w13_ks()


@pytest.mark.parametrize("tp", [8, 16])
def test_w13_route_compiles(tp, clean_env):
    """``DECODESCOPE_MOE_T1_ROUTE=w13`` (:class:`W13T1Route`): W13T1 at the plan's tiling with
    the router bias, ids and weights as extra arguments, its shared memory the struct plus the
    route's lists (``smem_total``), 2 CTAs per SM on 8 stages at TP16 as the default form; the
    PTX: the bias loads and the shared rows' ``cp.async`` before the PDL wait, the ranking
    (ballots) after it, the dependents triggered twice (other blocks right after the wait,
    block 0 after its list stores and a GPU-scope fence)."""
    d = _dims("kimi-k3", tp)
    cfg, kw = t1.w13_plan(1, d[1:], 132, True, route=True)
    assert (cfg.stages, kw) == ((8, 4) if tp == 16 else (6, 2))
    op, args = t1.build_w13_route(*d, 4.0, 25.0, True, 132, cfg, kw, False, 1.0)
    assert op.grid == 16 * d[4] // 16 and op.NRB == 1
    assert op._smem_struct().size_in_bytes() + op.route_smem == op.smem_total
    if tp == 16:
        assert 2 * (op.smem_total + 1024) <= t1.SMEM_SM
    ptx = itf.ptx_text(op, *args)
    w = ptx.find("griddepcontrol.wait")
    assert w > 0 and ptx.count("griddepcontrol.wait") == 1
    assert ptx[:w].count("cp.async.cg") >= 1 and ptx[:w].count("ld.global") >= d[1] // 32
    assert "vote.sync.ballot" not in ptx[:w] and "vote.sync.ballot" in ptx[w:]
    trig = [i for i in range(len(ptx)) if ptx.startswith("griddepcontrol.launch_dependents", i)]
    fence = ptx.find("fence.acq_rel.gpu")
    assert len(trig) == 2 and w < trig[0] < fence < trig[1]
    assert itf.compile_only(op, *args) is not None


def test_w13_route_selection(clean_env):
    """``DECODESCOPE_MOE_T1_ROUTE=w13`` at 1 token: :func:`fits` takes the kimi-k3 shapes with
    the shared down in w13, refuses it in w2 and above one token; the block launches W13T1Route
    and the w2 kernel, no route kernel (CPU: launches recorded, builds run, nothing compiled);
    a front that leaves ``acc`` to the route (``zero_acc``) is refused in one line."""
    from decodescope.kernels.specialized import moe_grouped as mg

    mp = clean_env
    mp.setenv("DECODESCOPE_MOE_T1_ROUTE", "w13")
    assert t1.route_where() == "w13"
    for tp in (8, 16):
        assert t1.fits(1, _dims("kimi-k3", tp)[1:])
    assert not t1.fits(2, _dims("kimi-k3", 8, T=2)[1:])
    mp.setenv("DECODESCOPE_MOE_T1_SHARED", "w2")
    assert not t1.fits(1, _dims("kimi-k3", 8)[1:])
    mp.delenv("DECODESCOPE_MOE_T1_SHARED")
    blk, calls, built = _recorded_block(mp)
    cfg = blk.cfg
    blk.experts()
    assert [c[0] for c in calls] == ["moe_t1_w13_route", "moe_t1_w2"]  # W2T1 at TP16
    assert calls[0][1] == 13  # W13T1's ten tensors, the bias, the ids, the weights
    assert isinstance(built[0], t1.W13T1Route) and built[0].KW == 4
    with pytest.raises(ValueError, match="DECODESCOPE_MOE_T1_ROUTE=w13 needs 1 token"):
        mg.moe_grouped(blk.y_front, blk.bias, blk.w13, blk.w2, blk.shared_w2, blk.h, blk.acc,
                       blk.shared_out, blk.topk_ids, blk.topk_weights,
                       mg.buffers_for(blk, 1, cfg.moe.num_experts, 16, cfg.shared_inter,
                                      blk.acc.device),
                       top_k=16, scaling=1.0, beta=blk.beta, lbeta=blk.lbeta,
                       zero_acc=True)  # fmt: skip
    mp.setenv("DECODESCOPE_MOE_T1_ROUTE", "x")
    with pytest.raises(ValueError, match="DECODESCOPE_MOE_T1_ROUTE='x'"):
        t1.route_where()


@pytest.mark.parametrize("tp", [1, 2])
def test_compiles_tiny(tp, clean_env):
    """The tiny preset (one K chunk, rows past Ie at TP 2 none: Ie 32 = 2 x 16)."""
    d = _dims("tiny", tp, T=1)
    op, args = t1.build_w13(*d, 4.0, 25.0)
    assert itf.compile_only(op, *args) is not None
    op2, args2 = t1.build_w2(*d)
    assert itf.compile_only(op2, *args2) is not None


@pytest.mark.parametrize("tp,zero_acc", [(8, False), (8, True), (16, False)])
def test_route_t1_compiles(tp, zero_acc):
    cfg = get_config("kimi-k3", tp)
    e = cfg.moe
    nf = e.num_experts + cfg.expert_dim + 2 * cfg.shared_inter
    op, args = t1.build_route(e.num_experts, e.top_k, cfg.expert_dim, nf, 1.0, True, zero_acc)
    assert itf.compile_only(op, *args) is not None


def _route_t1_lists(ids: list[int]):
    """:class:`RouteT1`'s list writes replayed (lane j: its pick's rank by expert index)."""
    K = len(ids)
    slot_e, slot_off, slot_n, pairs = [None] * K, [None] * K, [None] * K, [None] * K
    for j, e in enumerate(ids):
        r = sum(1 for i in range(K) if ids[i] < e)
        slot_e[r], slot_off[r], slot_n[r], pairs[r] = e, r, 1, j
    return slot_e, slot_off, slot_n, K, pairs


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_route_t1_lists(seed):
    """The lists RouteT1 writes equal :func:`moe_grouped.lists_from_ids` of its ids (what the
    grouped route kernel writes and the GPU script checks), on the router's own top-k."""
    from decodescope.kernels.specialized.router_topk import router_topk_ref

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, 896, generator=g)
    bias = torch.randn(896, generator=g) * 0.1
    ids, _ = router_topk_ref(logits, bias, 16, 1.0)
    se, so, sn, nact, pairs = mg.lists_from_ids(ids, 896)
    got = _route_t1_lists([int(x) for x in ids[0]])
    assert got == (se.tolist(), so.tolist(), sn.tolist(), nact, pairs.tolist())


def _shared_rows(op: t1.W13T1) -> dict[int, int]:
    """:meth:`W13T1._shared_down`'s row loops replayed: how often each output row is stored."""
    from collections import Counter

    out: Counter = Counter()
    for bid in range(op.grid):
        r0 = bid * op.RPC
        nr = min(op.H - r0, op.RPC)
        for rb in range(op.NRB):
            lo = rb * op.RB
            n_r = min(nr - lo, op.RB)
            for warp in range(op.NW):
                for rr in range(warp, n_r, op.NW):
                    out[r0 + lo + rr] += 1
    return out


@pytest.mark.parametrize(
    "tp,cfg",
    [(8, None), (16, None), (8, gt.TileConfig(rows=32, bk=128, stages=5, rt=1)),
     (8, gt.TileConfig(rows=32, bk=64, stages=3, rt=1))],  # the last: 3 rounds per CTA
)  # fmt: skip
def test_shared_rows_once(tp, cfg, clean_env):
    d = _dims("kimi-k3", tp)
    op = t1.W13T1(*d, 4.0, 25.0, cfg=cfg)
    out = _shared_rows(op)
    assert sorted(out) == list(range(op.H)) and set(out.values()) == {1}


def test_shared_rows_several_rounds():
    """Stages small enough that a CTA's rows take several rounds (NRB > 1); a capped grid (one
    item per CTA needed) is refused."""
    d = _dims("kimi-k3", 8)
    op = t1.W13T1(*d, 4.0, 25.0, cfg=gt.TileConfig(rows=16, bk=64, stages=3, rt=1))
    assert op.NRB > 1
    out = _shared_rows(op)
    assert sorted(out) == list(range(op.H)) and set(out.values()) == {1}
    with pytest.raises(ValueError, match="one item per CTA"):
        t1.W13T1(*d, 4.0, 25.0, nsm=1, cfg=op.cfg)
    _, args = t1.build_w13(*d, 4.0, 25.0, True, 132, op.cfg)
    assert itf.compile_only(op, *args) is not None  # the rounds' code path


@pytest.mark.parametrize("tp,T", [(8, 1), (16, 1), (8, 4)])
def test_every_h_written_once(tp, T):
    """The w13 items (:func:`grouped_w13_tile.coverage` replays the same loops; one pass per
    item since ``n <= T <= 8``): every ``h`` element of every pair stored exactly once."""
    d = _dims("kimi-k3", tp, T)
    E, K, Ie = d[1], d[2], d[4]
    g = torch.Generator().manual_seed(T)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    ids[:, 0] = 5
    _, _, sn, nact, _ = mg.lists_from_ids(ids, E)
    op = t1.W13T1(*d, 4.0, 25.0)
    out = gt.coverage(op, nact, sn.tolist())
    assert len(out) == int(sn.sum()) * Ie and set(out.values()) == {1}


def test_knobs(clean_env):
    mp = clean_env
    assert t1.mode(1) == "t1" and t1.mode(2) == "pipe"  # the default since s10/r2
    assert t1.w13_config() == gt.TileConfig(16, 128, 6, 1)
    assert t1.shared_where() == "w13" and t1.w2_pre() and t1.route_where() == "t1"
    mp.setenv("DECODESCOPE_MOE_EXPERTS", "grouped")  # explicit grouped: its own kernels
    assert t1.mode(1) == "grouped"
    mp.delenv("DECODESCOPE_MOE_EXPERTS")
    mp.setenv("DECODESCOPE_MOE_T1_SHARED", "w2")  # RouteT1 writes no hs
    assert t1.route_where() == "grouped"
    mp.delenv("DECODESCOPE_MOE_T1_SHARED")
    mp.setenv("DECODESCOPE_MOE_T1", "t1")
    assert t1.mode(1) == "t1" and t1.mode(2) == "pipe" and t1.mode(8) == "pipe"
    mp.setenv("DECODESCOPE_MOE_T1_ROWS", "32")
    mp.setenv("DECODESCOPE_MOE_T1_STAGES", "5")
    assert t1.w13_config() == gt.TileConfig(32, 128, 5, 1)
    for var, bad, msg in (
        ("DECODESCOPE_MOE_T1", "fast", "DECODESCOPE_MOE_T1='fast'"),
        ("DECODESCOPE_MOE_T1_ROWS", "48", "rows=48"),
        ("DECODESCOPE_MOE_T1_STAGES", "x", "DECODESCOPE_MOE_T1_STAGES='x'"),
        ("DECODESCOPE_MOE_T1_SHARED", "back", "DECODESCOPE_MOE_T1_SHARED='back'"),
        ("DECODESCOPE_MOE_T1_W2PRE", "2", "DECODESCOPE_MOE_T1_W2PRE='2'"),
        ("DECODESCOPE_MOE_T1_ROUTE", "one", "DECODESCOPE_MOE_T1_ROUTE='one'"),
    ):
        old = __import__("os").environ.get(var, "")
        mp.setenv(var, bad)
        with pytest.raises(ValueError, match=msg):
            (t1.mode(1), t1.w13_config(), t1.shared_where(), t1.w2_pre(), t1.route_where())
        mp.setenv(var, old)
    with pytest.raises(ValueError, match="tokens"):
        t1.W13T1(*_dims("kimi-k3", 8, 9), 4.0, 25.0)


def test_selection(clean_env):
    """Default: t1 at 1 token where it fits (kimi-k3 TP8 / TP16, tiny), the pipe where it does
    not or with ``DECODESCOPE_MOE_T1=pipe``; ``t1|grouped`` select the grouped path at 1 token
    only; an explicit ``DECODESCOPE_MOE_EXPERTS`` wins."""
    mp = clean_env
    dims = _dims("kimi-k3", 8)[1:]
    for d in (dims, _dims("kimi-k3", 16)[1:], _dims("tiny", 1)[1:], _dims("tiny", 2)[1:]):
        assert mg.selected(1, d) and t1.fits(1, d)
    assert not mg.selected(2, dims) and mg.selected(8, dims)
    bad = (dims[0], dims[1], 3584 + 64, dims[3], dims[4], dims[5])  # latent not a multiple of 128
    assert not t1.fits(1, bad) and not mg.selected(1, bad)  # the default falls back to the pipe
    mp.setenv("DECODESCOPE_MOE_T1", "t1")
    assert mg.selected(1, bad)  # set explicitly: the launch says why it cannot
    mp.setenv("DECODESCOPE_MOE_T1", "pipe")
    assert not mg.selected(1, dims)
    for v in ("t1", "grouped"):
        mp.setenv("DECODESCOPE_MOE_T1", v)
        assert mg.selected(1, dims) and not mg.selected(2, dims) and mg.selected(8, dims)
    mp.setenv("DECODESCOPE_MOE_EXPERTS", "pipe")
    assert not mg.selected(1, dims)
    mp.setenv("DECODESCOPE_MOE_T1", "pipe")
    mp.setenv("DECODESCOPE_MOE_EXPERTS", "auto")
    assert not mg.selected(1, dims)


def test_block_wiring(clean_env):
    """``DECODESCOPE_MOE_T1=t1`` at 1 token: the block's expert step launches the route, W13T1
    and W2T1 (in that order, with their knobs in the compile keys); ``grouped``: the grouped
    kernels' own; unset: t1 with RouteT1; ``pipe``: the pipe kernel (CPU: launches recorded,
    builds run, nothing compiled)."""
    from decodescope.kernels.specialized.moe_block import SpecializedMoE

    mp = clean_env
    keys, built, calls = [], [], []

    def fake_compiled(key, build):
        keys.append(key)
        op, _ = build()
        built.append(op)
        return lambda *a, key=key: calls.append(key[0])

    mp.setattr(itf, "compiled", fake_compiled)
    cfg = get_config("tiny", 1)
    w = make_layer_weights(cfg, LayerSpec(1, "kda", "moe"), seed=1)
    blk = SpecializedMoE(cfg, w, 1)
    mp.setenv("DECODESCOPE_MOE_T1", "t1")
    mp.setenv("DECODESCOPE_MOE_T1_STAGES", "4")
    mp.setenv("DECODESCOPE_MOE_T1_ROUTE", "grouped")
    blk.experts()
    assert calls == ["moe_grouped_route", "moe_t1_w13", "moe_t1_w2"]
    ops = dict(zip([k[0] for k in keys], built, strict=True))
    assert isinstance(ops["moe_t1_w13"], t1.W13T1) and ops["moe_t1_w13"].S == 4
    assert isinstance(ops["moe_t1_w2"], t1.W2T1) and ops["moe_t1_w2"].CS == 0
    calls.clear()
    mp.setenv("DECODESCOPE_MOE_T1_ROUTE", "t1")
    blk.experts()
    assert calls == ["moe_t1_route", "moe_t1_w13", "moe_t1_w2"]
    mp.setenv("DECODESCOPE_MOE_T1_SHARED", "w2")  # RouteT1 writes no hs: refused
    with pytest.raises(ValueError, match="DECODESCOPE_MOE_T1_SHARED=w13"):
        blk.experts()
    mp.delenv("DECODESCOPE_MOE_T1_SHARED")
    mp.delenv("DECODESCOPE_MOE_T1_ROUTE")
    calls.clear()
    mp.setenv("DECODESCOPE_MOE_T1", "grouped")
    blk.experts()
    assert calls == ["moe_grouped_route", "moe_grouped_w13", "moe_grouped_w2"]
    calls.clear()
    mp.delenv("DECODESCOPE_MOE_T1")
    mp.delenv("DECODESCOPE_MOE_T1_STAGES")
    blk.experts()  # the default: t1 with RouteT1
    assert calls == ["moe_t1_route", "moe_t1_w13", "moe_t1_w2"]
    calls.clear()
    mp.setenv("DECODESCOPE_MOE_T1", "pipe")
    blk.experts()
    assert len(calls) == 1 and calls[0] != "moe_grouped_route"  # the persistent kernel


@pytest.mark.parametrize("tp", [8, 16])
def test_back_prefetch_compiles(tp, clean_env):
    """``DECODESCOPE_MOE_BACK_L2PRE``: :class:`W13T1Pre` at the plan the default picks compiles
    for sm_90a; its PTX creates one ``evict_last`` policy and issues the bulk L2 prefetches with
    it before the PDL wait; every one of the back's 448 row tiles has a CTA and a thread."""
    d = _dims("kimi-k3", tp)
    cfg, kw = t1.w13_plan(1, d[1:], 132, True)
    plan = t1.back_pre_plan(d[5], d[3], 12)
    assert plan == (448, 16 * d[3], 28032) and plan[2] % 128 == 0
    op, args = t1.build_w13_pre(*d, 4.0, 25.0, True, 132, cfg, True, kw, False, plan)
    assert isinstance(op, t1.W13T1Pre) and op.PRE_PER * op.grid >= 448 and op.PRE_PER <= op.NT
    base, _ = t1.build_w13(*d, 4.0, 25.0, True, 132, cfg, True, kw)
    assert (op.grid, op.NT, op.smem_total) == (base.grid, base.NT, base.smem_total)
    ptx = itf.ptx_text(op, *args)
    pol = ptx.index("createpolicy.fractional.L2::evict_last.b64")
    pf = ptx.index("cp.async.bulk.prefetch.L2.global.L2::cache_hint")
    assert pol < pf < ptx.index("griddepcontrol.wait")
    assert ptx.count("cp.async.bulk.prefetch.L2") == 1  # one run per tile (28 KB < 32 KB)
    big = t1.back_pre_plan(d[5], d[3], 40)  # 93.6 KB of each 112 KB tile: three instructions
    op40, args40 = t1.build_w13_pre(*d, 4.0, 25.0, True, 132, cfg, True, kw, False, big)
    assert itf.ptx_text(op40, *args40).count("cp.async.bulk.prefetch.L2") == 3


def test_back_prefetch_knobs(clean_env, monkeypatch):
    """The knobs' one-line errors, the plan's arithmetic and refusals, the set-aside asked once
    (the driver call replaced on the CPU)."""
    mp = clean_env
    assert t1.back_l2pre_mb() == 0 and t1.l2_persist_mb() == 0
    for bad in ("x", "41", "-1"):
        mp.setenv("DECODESCOPE_MOE_BACK_L2PRE", bad)
        with pytest.raises(ValueError, match="DECODESCOPE_MOE_BACK_L2PRE="):
            t1.back_l2pre_mb()
    mp.setenv("DECODESCOPE_MOE_BACK_L2PRE", "12")
    assert t1.back_l2pre_mb() == 12
    assert t1.back_pre_plan(7168, 3584, 40)[2] == (40 << 20) // 448 // 128 * 128
    assert t1.back_pre_plan(64, 64, 40)[2] == 16 * 64 * 2  # capped at the whole tile
    with pytest.raises(ValueError, match="not a multiple of 16"):
        t1.back_pre_plan(7160, 3584, 12)
    d = _dims("kimi-k3", 8)
    cfg, kw = t1.w13_plan(1, d[1:], 132, True)
    with pytest.raises(ValueError, match="prefetch of 208 B per tile of 200 B"):
        t1.W13T1Pre(*d, 4.0, 25.0, True, 132, cfg, True, kw, pre=(448, 100, 208))
    calls = []
    mp.setattr(t1.cuda, "cuCtxSetLimit", lambda lim, n: calls.append((lim, n)) or
               (t1.cuda.CUresult.CUDA_SUCCESS,))  # fmt: skip
    mp.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    mp.setattr(t1, "_PERSIST_SET", [])
    t1.apply_l2_persist()  # unset: nothing asked
    mp.setenv("DECODESCOPE_L2_PERSIST_MB", "16")
    t1.apply_l2_persist()
    t1.apply_l2_persist()  # once per process
    assert calls == [(t1.cuda.CUlimit.CU_LIMIT_PERSISTING_L2_CACHE_SIZE, 16 << 20)]


def test_back_prefetch_wiring(clean_env):
    """The block hands its ``latent_up`` down: with the knob the one-token experts launch
    :class:`W13T1Pre` with the weight viewed as its row tiles; the route alone needs no weight,
    the full launch without one a one-line refusal; with the w13 route a one-line refusal;
    unset, the plain W13T1 (CPU: launches recorded, builds run)."""
    mp = clean_env
    blk, calls, built = _recorded_block(mp, "tiny", 1)
    cfg = blk.cfg
    blk.experts()
    assert [c[0] for c in calls] == ["moe_t1_route", "moe_t1_w13", "moe_t1_w2"]
    calls.clear()
    built.clear()
    mp.setenv("DECODESCOPE_MOE_BACK_L2PRE", "1")
    blk.experts()
    H, L = cfg.hidden, cfg.expert_dim
    assert [c[0] for c in calls] == ["moe_t1_route", "moe_t1_w13_pre", "moe_t1_w2"]
    assert tuple(calls[1][2].shape) == (H // 16, 16 * L)
    assert isinstance(built[1], t1.W13T1Pre)
    calls.clear()  # the route alone (the GPU script's route checks): no weight needed
    bufs = mg.buffers_for(blk, 1, cfg.moe.num_experts, blk.top_k, cfg.shared_inter, "cpu")
    mg.moe_grouped(blk.y_front, blk.bias, blk.w13, blk.w2, blk.shared_w2, blk.h, blk.acc,
                   blk.shared_out, blk.topk_ids, blk.topk_weights, bufs, top_k=blk.top_k,
                   scaling=blk.scaling, beta=blk.beta, lbeta=blk.lbeta, parts=(0,))  # fmt: skip
    assert [c[0] for c in calls] == ["moe_t1_route"]
    with pytest.raises(ValueError, match="needs the back's weight"):
        mg.moe_grouped(blk.y_front, blk.bias, blk.w13, blk.w2, blk.shared_w2, blk.h, blk.acc,
                       blk.shared_out, blk.topk_ids, blk.topk_weights, bufs, top_k=blk.top_k,
                       scaling=blk.scaling, beta=blk.beta, lbeta=blk.lbeta)  # fmt: skip
    mp.setenv("DECODESCOPE_MOE_T1_ROUTE", "w13")
    with pytest.raises(ValueError, match="DECODESCOPE_MOE_BACK_L2PRE=1 runs on the plain"):
        blk.experts()


def test_script_variants():
    spec = importlib.util.spec_from_file_location("gpu_specialized_moe_t1", _SCRIPT)
    gs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gs)
    env = gs.variant_env("grouped_t1")
    assert env["DECODESCOPE_MOE_T1"] == "t1" and env["DECODESCOPE_MOE_EXPERTS"] == "grouped"
    assert env["DECODESCOPE_MOE_T1_ROWS"] == "" and env["DECODESCOPE_MOE_GROUPED_ROUTE"] == "thresh"
    assert gs.variant_env("grouped_t1_w2w2")["DECODESCOPE_MOE_W2T_WARPS"] == "2"
    assert gs.variant_env("grouped_t1_rt1")["DECODESCOPE_MOE_T1_ROUTE"] == "t1"
    assert gs.variant_env("grouped_t1")["DECODESCOPE_MOE_T1_ROUTE"] == ""  # the default: t1
    assert gs.variant_env("grouped_t1_rtg")["DECODESCOPE_MOE_T1_ROUTE"] == "grouped"
    env = gs.variant_env("grouped_t1_r32_s5_w2sh_nopre")
    assert (env["DECODESCOPE_MOE_T1_ROWS"], env["DECODESCOPE_MOE_T1_STAGES"]) == ("32", "5")
    assert env["DECODESCOPE_MOE_T1_SHARED"] == "w2" and env["DECODESCOPE_MOE_T1_W2PRE"] == "0"
    assert gs.variant_env("grouped_t1base")["DECODESCOPE_MOE_T1"] == "grouped"
    assert gs.variant_name("grouped_t1_k64") == "grouped_t1_k64"
    env = gs.variant_env("grouped_t1_s8_k64_kw4")
    assert (env["DECODESCOPE_MOE_T1_BK"], env["DECODESCOPE_MOE_T1_KW"]) == ("64", "4")
    assert gs.variant_env("grouped_t1")["DECODESCOPE_MOE_T1_KW"] == ""
    env = gs.variant_env("grouped_t1_s8_zt")
    assert (env["DECODESCOPE_MOE_T1_STAGES"], env["DECODESCOPE_MOE_T1_ZT"]) == ("8", "1")
    assert gs.variant_env("grouped_t1_ks2")["DECODESCOPE_MOE_T1_KSPLIT"] == "2"
    assert gs.variant_env("grouped_t1_rtw")["DECODESCOPE_MOE_T1_ROUTE"] == "w13"
    assert gs.variant_env("grouped_t1_e4")["DECODESCOPE_MOE_T1_EARLY"] == "4"
    assert gs.variant_env("grouped_t1_kw2")["DECODESCOPE_MOE_T1_EARLY"] == ""


# -- GPU (the lead's H200 runs: pytest -m gpu tests/test_experts_t1.py) -------------------------

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_specialized_moe.py"


@pytest.fixture(scope="module")
def gsm():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    spec = importlib.util.spec_from_file_location("gpu_specialized_moe", _SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.gpu
@pytest.mark.parametrize("preset,tp,var", [("kimi-k3", 8, "grouped_t1"),
                                           ("kimi-k3", 16, "grouped_t1"),
                                           ("kimi-k3", 8, "grouped_t1_w2sh_nopre"),
                                           ("kimi-k3", 8, "grouped_t1_rt1"),
                                           ("kimi-k3", 16, "grouped_t1_rt1"),
                                           ("kimi-k3", 8, "grouped_t1_kw2"),
                                           ("kimi-k3", 16, "grouped_t1_kw2"),
                                           ("kimi-k3", 16, "grouped_t1_s6_kw2"),
                                           ("kimi-k3", 16, "grouped_t1_s8_kw4"),
                                           ("kimi-k3", 8, "grouped_t1_rtw"),
                                           ("kimi-k3", 8, "grouped_t1_ks2"),
                                           ("kimi-k3", 16, "grouped_t1_ks2"),
                                           ("kimi-k3", 16, "grouped_t1_rtw"),
                                           ("kimi-k3", 16, "grouped_t1_e4"),
                                           ("kimi-k3", 8, "grouped_t1_e2"),
                                           ("kimi-k3", 8, "grouped_t1_s8_k64_kw4"),
                                           ("kimi-k3", 8, "grouped_t1_s8_zt"),
                                           ("kimi-k3", 16, "grouped_t1_s8_zt"),
                                           ("tiny", 1, "grouped_t1")])  # fmt: skip
def test_t1_gpu(gsm, preset, tp, var, monkeypatch):
    """Lists, h (poisoned first) vs bf16(SiTU(w13 z)), routed sum, shared output, up-projection
    and the block vs the references at 1 token, two fresh draws; then the default selection
    path (``DECODESCOPE_MOE_EXPERTS`` unset) with ``DECODESCOPE_MOE_T1=t1``."""
    from decodescope.kernels.specialized.moe_block import SpecializedMoE

    for k, v in gsm.variant_env(var).items():
        monkeypatch.setenv(k, v)
    cfg = get_config(preset, tp)
    w = make_layer_weights(cfg, LayerSpec(1, "kda", "moe"), seed=tp, device="cuda")
    blk = SpecializedMoE(cfg, w, 1)
    gsm.RESULTS.clear()
    for draw in range(2):
        ctx = {"preset": preset, "tp": tp, "tokens": 1, "draw": draw, "experts": var}
        gsm.run_checks(cfg, w, blk, 1, ctx, seed=17 + draw, front_norm=False, fronts=False)
    monkeypatch.delenv("DECODESCOPE_MOE_EXPERTS")
    ctx = {"preset": preset, "tp": tp, "tokens": 1, "draw": 2, "experts": var + "_auto"}
    gsm.run_checks(cfg, w, blk, 1, ctx, seed=19, front_norm=False, fronts=False)
    bad = [r for r in gsm.RESULTS if r.get("status") in ("FAIL", "error")]
    assert not bad, bad
    assert any(r.get("check") == "shared_out" for r in gsm.RESULTS)


@pytest.mark.gpu
@pytest.mark.parametrize("tp,mb,persist", [(8, 12, 0), (16, 12, 0), (16, 12, 16)])
def test_back_prefetch_gpu(gsm, tp, mb, persist, monkeypatch):
    """``DECODESCOPE_MOE_BACK_L2PRE`` (with and without an L2 set-aside) is a hint: the block's
    one-token output matches the default's (the routed sum's FP32 atomics may order
    differently) and every check of the script passes with it, two fresh draws."""
    from decodescope.kernels.specialized.moe_block import SpecializedMoE

    for v in ("DECODESCOPE_MOE_BACK_L2PRE", "DECODESCOPE_L2_PERSIST_MB"):
        monkeypatch.delenv(v, raising=False)
    cfg = get_config("kimi-k3", tp)
    w = make_layer_weights(cfg, LayerSpec(1, "kda", "moe"), seed=tp, device="cuda")
    blk = SpecializedMoE(cfg, w, 1)
    g = torch.Generator(device="cuda").manual_seed(29)
    h = torch.randn(1, cfg.hidden, device="cuda", generator=g).to(torch.bfloat16)
    out0 = torch.full_like(h, float("nan"))
    blk.forward(h, out0)
    monkeypatch.setenv("DECODESCOPE_MOE_BACK_L2PRE", str(mb))
    if persist:
        monkeypatch.setenv("DECODESCOPE_L2_PERSIST_MB", str(persist))
    try:
        out1 = torch.full_like(h, float("nan"))
        blk.forward(h, out1)
        torch.cuda.synchronize()
        rel = ((out1.float() - out0.float()).norm() / out0.float().norm()).item()
        assert torch.isfinite(out1).all() and rel < 1e-2, rel
        gsm.RESULTS.clear()
        for draw in range(2):
            ctx = {"preset": "kimi-k3", "tp": tp, "tokens": 1, "draw": draw,
                   "experts": f"t1_l2pre{mb}_p{persist}"}  # fmt: skip
            gsm.run_checks(cfg, w, blk, 1, ctx, seed=31 + draw, front_norm=False, fronts=False)
        bad = [r for r in gsm.RESULTS if r.get("status") in ("FAIL", "error")]
        assert not bad, bad
    finally:
        if persist:
            t1.cuda.cuCtxSetLimit(t1.cuda.CUlimit.CU_LIMIT_PERSISTING_L2_CACHE_SIZE, 0)
            t1._PERSIST_SET.clear()


def test_early_plan(clean_env):
    """``DECODESCOPE_MOE_T1_EARLY``: off unless set; at one token with RouteT1 and the
    tensor-core front (which zeroes ``acc``) the router split it names; off with the w13 route,
    the K split, more tokens or a front that leaves ``acc`` to the route; a bad value, one line."""
    d = _dims("kimi-k3", 16)[1:]
    assert t1.early_split() == 1 and t1.early_plan(1, d, False) == 1
    clean_env.setenv("DECODESCOPE_MOE_T1_EARLY", "4")
    assert t1.early_plan(1, d, False) == 4
    assert t1.early_plan(1, d, True) == 1 and t1.early_plan(8, d, False) == 1
    clean_env.setenv("DECODESCOPE_MOE_T1_KSPLIT", "2")
    assert t1.early_plan(1, d, False) == 1
    clean_env.delenv("DECODESCOPE_MOE_T1_KSPLIT")
    clean_env.setenv("DECODESCOPE_MOE_T1_ROUTE", "w13")
    assert t1.early_plan(1, d, False) == 1
    clean_env.setenv("DECODESCOPE_MOE_T1_EARLY", "3")
    with pytest.raises(ValueError, match="DECODESCOPE_MOE_T1_EARLY='3'"):
        t1.early_split()


@pytest.mark.parametrize("tp,rks", [(16, 4), (8, 2)])
def test_front_early_compiles(tp, rks):
    """:class:`.front_mma.FrontMmaEarly`: each of the 56 router row tiles as ``rks`` CTAs on
    ``1 / rks`` of K (the grid grows by ``56 (rks - 1)``), the other tiles one CTA each; the
    PTX: one GPU-scope fence before the one acq_rel atomic (the router CTAs counting in)."""
    from decodescope.kernels.specialized import front_mma as fm

    cfg = get_config("kimi-k3", tp)
    E = cfg.moe.num_experts
    NF = E + cfg.expert_dim + 2 * cfg.shared_inter
    op, args = fm._build(1, cfg.hidden, NF, cfg.expert_dim, E, True, "ring", early=(rks, E))
    base = fm.FrontMma(1, cfg.hidden, NF, cfg.expert_dim, E, True, "ring")
    assert rks * E // 16 == op.NSIG and op.grid == base.grid + (rks - 1) * E // 16
    assert op.CPWR * rks == op.CPW == base.CPW
    ptx = itf.ptx_text(op, *args)
    atom = ptx.find("atom.global.acq_rel")
    assert ptx.count("atom.") == 1 and 0 < ptx.find("fence.acq_rel.gpu") < atom
    assert itf.compile_only(op, *args) is not None
    with pytest.raises(ValueError, match="router split 3"):
        fm.FrontMmaEarly(1, cfg.hidden, NF, cfg.expert_dim, E, True, "ring", 3, E)


def test_route_early_compiles():
    """:class:`RouteT1Early`: the arrival counter acquired (with ``nanosleep`` between reads and
    the global timer's cap) and the lists stored before the PDL wait, the dependents
    triggered after it (W13T1's pre-wait shared down reads the front's output); the phases'
    timer stamps around them."""
    cfg = get_config("kimi-k3", 16)
    e = cfg.moe
    NF = e.num_experts + cfg.expert_dim + 2 * cfg.shared_inter
    op, args = t1.build_route_early(e.num_experts, e.top_k, cfg.expert_dim, NF, 2.5, True, 4)
    assert 4 * e.num_experts // 16 == op.NSIG
    ptx = itf.ptx_text(op, *args)
    acq, wait = ptx.find("ld.acquire.gpu"), ptx.find("griddepcontrol.wait")
    assert 0 < acq < wait < ptx.find("griddepcontrol.launch_dependents")
    assert "nanosleep" in ptx and "globaltimer" in ptx
    # before the counter only the resident stamp (its 2 words: one or two stores), after the
    # wait only the waited one: every list store between them
    assert 1 <= ptx[:acq].count("st.global") <= 2 and 1 <= ptx[wait:].count("st.global") <= 2
    assert ptx[acq:wait].count("st.global") > 2 * e.top_k
    assert itf.compile_only(op, *args) is not None


def test_early_selection(clean_env):
    """The block with ``DECODESCOPE_MOE_T1_EARLY=4``: the front as FrontMmaEarly (the partial
    logits and the counter: 7 tensors), then RouteT1Early on the same buffers, W13T1, w2; an
    expert step with no front of its own before it (timing one part) runs the usual route, as
    does the w13 route's block; a bad value is the front's one-line error."""
    from decodescope.kernels.specialized import front_mma as fm

    mp = clean_env
    blk, calls, built = _recorded_block(mp)
    mp.setenv("DECODESCOPE_MOE_T1_EARLY", "4")
    h = torch.zeros(1, blk.cfg.hidden, dtype=torch.bfloat16)
    blk.front(h)
    blk.experts()
    names = [c[0] for c in calls]
    assert names == ["moe_front_mma_early", "moe_t1_route_early", "moe_t1_w13", "moe_t1_w2"]
    assert calls[0][1] == 7 and calls[1][1] == 11
    assert isinstance(built[0], fm.FrontMmaEarly) and isinstance(built[1], t1.RouteT1Early)
    assert built[0].NSIG == built[1].NSIG == 224
    part, sig = blk._t1_early
    assert part.numel() == 3 * 896 and int(sig[0]) == 0 and sig.numel() == 16
    calls.clear()
    blk.experts()  # no front before it: the usual route
    assert [c[0] for c in calls][0] == "moe_t1_route"
    calls.clear()
    mp.setenv("DECODESCOPE_MOE_T1_ROUTE", "w13")
    mp.setenv("DECODESCOPE_MOE_T1", "t1")
    blk.front(h)
    assert calls[0][0] == "moe_front_mma"
    mp.setenv("DECODESCOPE_MOE_T1_EARLY", "8")
    with pytest.raises(ValueError, match="DECODESCOPE_MOE_T1_EARLY='8'"):
        blk.front(h)


def test_early_stamps_read_and_script_refusal():
    """The early route's timer stamps read back from their int32 words (low word with its top
    bit set: unsigned); ``scripts/early_stamps.py`` without the knob is a one-line error."""
    import os
    import subprocess
    import sys

    from decodescope.kernels.specialized import front_mma as fm

    sig = torch.zeros(fm.EARLY_SIG_WORDS, dtype=torch.int32)
    t = (5 << 32) | 0x80000001
    w = fm.STAMPS["route_ranked"]
    sig[w] = torch.tensor(0x80000001, dtype=torch.int64).to(torch.int32)
    sig[w + 1] = 5
    assert fm.read_stamps(sig)["route_ranked"] == t
    assert fm.read_stamps(sig)["router_done"] == 0
    script = Path(__file__).resolve().parents[1] / "scripts" / "early_stamps.py"
    env = {k: v for k, v in os.environ.items() if k != "DECODESCOPE_MOE_T1_EARLY"}
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env)
    assert (
        p.returncode == 2 and p.stderr.count("\n") == 1 and "DECODESCOPE_MOE_T1_EARLY" in p.stderr
    )
