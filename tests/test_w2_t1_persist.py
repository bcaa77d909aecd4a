"""``kernels/specialized/w2_t1_persist.py`` (``DECODESCOPE_MOE_T1_W2=persist``): compiles for
sm_90a on the CPU at the kimi-k3 TP8 / TP16 shapes and the tiny preset; its work split and ring
replayed in Python (every selected expert's rows covered exactly once, each CTA's steps loaded
once, in order, into stage ``step % NS``, at most two slots per CTA); the knobs, the selection
(default unchanged: W2T1) and the block's wiring; on a GPU (``-m gpu``) the kernel alone against
a torch reference (``acc``'s tail and ``shared_out`` NaN-poisoned, left untouched) and the
script's checks of the ``grouped_t1_w2p`` chain."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from decodescope.kernels.config import LayerSpec, get_config
from decodescope.kernels.specialized import experts_t1 as t1
from decodescope.kernels.specialized import interface as itf  # sets CUTE_DSL_ARCH first
from decodescope.kernels.specialized import moe_grouped as mg
from decodescope.kernels.specialized import w2_t1_persist as wp
from decodescope.kernels.weights import make_layer_weights

_VARS = ("DECODESCOPE_MOE_T1", "DECODESCOPE_MOE_T1_ROWS", "DECODESCOPE_MOE_T1_STAGES",
         "DECODESCOPE_MOE_T1_BK", "DECODESCOPE_MOE_T1_SHARED", "DECODESCOPE_MOE_T1_W2PRE",
         "DECODESCOPE_MOE_EXPERTS", "DECODESCOPE_MOE_T1_ROUTE", "DECODESCOPE_MOE_T1_W2",
         *(v for v, _ in wp.ENV.values()))  # fmt: skip
_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_specialized_moe.py"


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
    d = _dims("kimi-k3", tp)
    op, args = wp.build(*d)
    assert (op.R, op.NS, op.nbuf, op.CS) == (32, 5, 5, 0)
    assert op.grid == 3 * 132 and op.units == 16 * d[3] // 32
    assert op.UPC <= op.CE and 3 * (op.smem + 384 + 1024) <= 228 * 1024  # 3 CTAs per SM
    assert itf.compile_only(op, *args) is not None


@pytest.mark.parametrize("T,pk,want", [(4, wp.PersistKnobs(4, 4, 2), (64, 4, 264)),
                                       (1, wp.PersistKnobs(2, 7, 3), (32, 7, 396))])  # fmt: skip
def test_compiles_knobs(T, pk, want, clean_env):
    """Other tilings: 64-row units, 4 stages, 2 CTAs per SM at 4 tokens (one pass); 7 stages
    (the script's ``grouped_t1_w2p_ps7``: 6 chunks before the wait, 3 CTAs per SM still)."""
    d = _dims("kimi-k3", 8, T=T)
    op, args = wp.build(*d, pk=pk)
    assert (op.R, op.NS, op.grid) == want
    assert 3 * (op.smem + 384 + 1024) <= 228 * 1024 or pk.per_sm < 3
    assert itf.compile_only(op, *args) is not None


@pytest.mark.parametrize("tp", [1, 2])
def test_compiles_tiny(tp, clean_env):
    d = _dims("tiny", tp)
    op, args = wp.build(*d)
    assert op.grid == op.units  # 4 slots x 4 units: fewer than 3 x 132
    assert itf.compile_only(op, *args) is not None


def _routings():
    """(name, T, ids): 16 distinct experts at 1 token (twice), repeated experts at 4 and 8."""
    g = torch.Generator().manual_seed(3)
    E, K = 896, 16
    out = [("t1", 1, torch.randperm(E, generator=g)[:K][None]),
           ("t1_ends", 1, torch.cat([torch.arange(8), torch.arange(E - 8, E)])[None])]  # fmt: skip
    rest = torch.tensor([e for e in range(E) if e not in (7, 100)])
    ids = torch.stack([rest[torch.randperm(rest.numel(), generator=g)[:K]] for _ in range(4)])
    ids[:, 0] = 7  # one expert for every token, another shared by two (distinct per token)
    ids[1:3, 1] = 100
    out.append(("t4_rep", 4, ids))
    ids = torch.stack([torch.randperm(40, generator=g)[:K] for _ in range(8)])  # heavy repeats
    out.append(("t8_rep", 8, ids))
    return out


@pytest.mark.parametrize("tp", [8, 16])
@pytest.mark.parametrize("name,T,ids", _routings(), ids=[r[0] for r in _routings()])
@pytest.mark.parametrize("pk", [None, wp.PersistKnobs(4, 4, 2), wp.PersistKnobs(1, 3, 1)])
def test_split_covers_rows_once(tp, name, T, ids, pk, clean_env):
    """Every selected expert's ``L`` rows in exactly one CTA's epilogues; each CTA's steps
    loaded once, in order, into stage ``step % NS``, from at most two slots."""
    d = _dims("kimi-k3", tp, T)
    op = wp.W2T1Persist(*d, pk=pk)
    se, _, sn, nact, _ = mg.lists_from_ids(ids, d[1])
    assert int(sn.sum()) == T * d[2]
    rows = {}
    counts = []
    for b in range(op.grid):
        ev = op.plan(nact, b)
        loads = [x for x in ev if x[0] == "load"]
        epis = [x for x in ev if x[0] == "epi"]
        lo, hi = wp.split(nact * op.CE, op.grid, b)
        counts.append(hi - lo)
        assert [x[1] for x in loads] == list(range((hi - lo) * op.NCH))
        assert all(x[6] == x[1] % op.NS and x[5] == x[1] % op.NCH for x in loads)
        assert [x[1] for x in epis] == list(range(lo, hi))
        assert len({x[2] for x in epis}) <= 2
        for _, _u, a, row0 in epis:
            e = int(se[a])
            for r in range(row0, min(row0 + op.R, op.L)):
                rows[(e, r)] = rows.get((e, r), 0) + 1
    want = {(int(e), r) for e in se for r in range(op.L)}
    assert set(rows) == want and set(rows.values()) == {1}
    assert max(counts) - min(counts) <= 1 and max(counts) <= op.UPC


def test_knobs_and_selection(clean_env):
    mp = clean_env
    assert wp.variant() == "persist" and t1.w2_persist()  # the default since session 12
    assert t1.w2_persist(384) and not t1.w2_persist(192)  # TP8-wide experts only (TP16: tile)
    mp.setenv("DECODESCOPE_MOE_T1_SHARED", "w2")  # no shared-down CTAs in the persistent w2
    assert wp.variant() == "tile" and not t1.w2_persist()
    mp.delenv("DECODESCOPE_MOE_T1_SHARED")
    mp.setenv("DECODESCOPE_MOE_T1_W2", "tile")
    assert wp.variant() == "tile" and not t1.w2_persist()
    assert wp.knobs() == wp.PersistKnobs(2, 5, 3)
    mp.setenv("DECODESCOPE_MOE_T1_W2", "persist")
    mp.setenv("DECODESCOPE_MOE_T1_W2P_STAGES", "4")
    assert t1.w2_persist() and wp.knobs().stages == 4
    for d in (_dims("kimi-k3", 8), _dims("kimi-k3", 16), _dims("tiny", 1), _dims("tiny", 2)):
        assert t1.fits(1, d[1:])
    mp.setenv("DECODESCOPE_MOE_T1_SHARED", "w2")  # the persistent w2 has no shared CTAs
    assert not t1.fits(1, _dims("kimi-k3", 8)[1:])
    mp.delenv("DECODESCOPE_MOE_T1_SHARED")
    for var, bad in (("DECODESCOPE_MOE_T1_W2", "ring"), ("DECODESCOPE_MOE_T1_W2P_WARPS", "3"),
                     ("DECODESCOPE_MOE_T1_W2P_PERSM", "x")):  # fmt: skip
        old = __import__("os").environ.get(var, "")
        mp.setenv(var, bad)
        with pytest.raises(ValueError, match=var):
            (wp.variant(), wp.knobs())
        mp.setenv(var, old)
    with pytest.raises(ValueError, match="slots"):  # a grid below the slots: refused
        wp.W2T1Persist(*_dims("kimi-k3", 8, 8), nsm=8, pk=wp.PersistKnobs(per_sm=1))


def test_block_wiring(clean_env):
    """``DECODESCOPE_MOE_T1_W2=persist``: the same three launches, W2T1Persist third (its knobs
    in the key); ``tile``: W2T1; unset: persist from ``PERSIST_MIN_IE`` (CPU: builds run, nothing
    compiled)."""
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
    mp.setenv("DECODESCOPE_MOE_T1_W2", "persist")
    mp.setenv("DECODESCOPE_MOE_T1_W2P_PERSM", "2")
    blk.experts()
    assert calls == ["moe_t1_route", "moe_t1_w13", "moe_t1_w2p"]
    op = built[-1]
    assert isinstance(op, wp.W2T1Persist) and op.pk.per_sm == 2 and keys[-1][-1] == op.pk
    mp.setenv("DECODESCOPE_MOE_T1_SHARED", "w2")
    mp.setenv("DECODESCOPE_MOE_T1_ROUTE", "grouped")
    mp.setenv("DECODESCOPE_MOE_T1", "t1")  # explicit: the launch says why (unset: the pipe)
    with pytest.raises(ValueError, match="DECODESCOPE_MOE_T1_SHARED=w13"):
        blk.experts()
    mp.delenv("DECODESCOPE_MOE_T1_SHARED")
    mp.delenv("DECODESCOPE_MOE_T1_ROUTE")
    mp.setenv("DECODESCOPE_MOE_T1_W2", "tile")
    mp.delenv("DECODESCOPE_MOE_T1")
    calls.clear()
    blk.experts()
    assert calls == ["moe_t1_route", "moe_t1_w13", "moe_t1_w2"]
    assert type(built[-1]) is t1.W2T1
    mp.delenv("DECODESCOPE_MOE_T1_W2")
    mp.delenv("DECODESCOPE_MOE_T1_W2P_PERSM")
    calls.clear()
    blk.experts()  # the default at tiny's 64-wide experts (under PERSIST_MIN_IE): W2T1
    assert calls == ["moe_t1_route", "moe_t1_w13", "moe_t1_w2"]
    mp.setattr(wp, "PERSIST_MIN_IE", 64)
    calls.clear()
    blk.experts()
    assert calls == ["moe_t1_route", "moe_t1_w13", "moe_t1_w2p"]


def _script():
    spec = importlib.util.spec_from_file_location("gpu_specialized_moe_w2p", _SCRIPT)
    gs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gs)
    return gs


def test_script_variants():
    gs = _script()
    env = gs.variant_env("grouped_t1_w2p")
    assert env["DECODESCOPE_MOE_T1"] == "t1" and env["DECODESCOPE_MOE_T1_W2"] == "persist"
    assert env["DECODESCOPE_MOE_T1_W2P_WARPS"] == "" and env["DECODESCOPE_MOE_T1_ROUTE"] == ""
    assert gs.variant_env("grouped_t1")["DECODESCOPE_MOE_T1_W2"] == ""  # the default: persist
    assert gs.variant_env("grouped_t1_w2t")["DECODESCOPE_MOE_T1_W2"] == "tile"
    env = gs.variant_env("grouped_t1_w2p_pw4_ps4_pm2")
    assert (env["DECODESCOPE_MOE_T1_W2P_WARPS"], env["DECODESCOPE_MOE_T1_W2P_STAGES"],
            env["DECODESCOPE_MOE_T1_W2P_PERSM"]) == ("4", "4", "2")  # fmt: skip
    assert gs.variant_name("grouped_t1_rt1_w2p") == "grouped_t1_rt1_w2p"


# -- GPU (the lead's H200 runs: pytest -m gpu tests/test_w2_t1_persist.py) ----------------------


def _ref(h, w2, tw, se, so, sn, nact, pairs, T, K, L):
    """``acc[t] = sum over the pairs p of token t: tw[p] * (w2[e] @ h[p])`` (FP32)."""
    acc = torch.zeros(T, L, dtype=torch.float32, device=h.device)
    for a in range(nact):
        e, off, n = int(se[a]), int(so[a]), int(sn[a])
        for p in pairs[off : off + n].tolist():
            acc[p // K] += float(tw[p]) * (w2[e].float() @ h[p].float())
    return acc


@pytest.mark.gpu
@pytest.mark.parametrize("preset,tp,T,pk", [("kimi-k3", 8, 1, None), ("kimi-k3", 16, 1, None),
                                            ("kimi-k3", 8, 4, None),
                                            ("kimi-k3", 8, 1, wp.PersistKnobs(4, 4, 2)),
                                            ("tiny", 1, 1, None), ("tiny", 2, 1, None)])  # fmt: skip
def test_w2p_alone_gpu(preset, tp, T, pk, clean_env):
    """The kernel alone on random ``h``, ``w2`` and routings vs the torch reference (rel. L2
    1e-4); ``acc``'s tail past ``T x L`` and ``shared_out`` NaN-poisoned and still NaN after."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    dev = "cuda"
    d = _dims(preset, tp, T)
    _, E, K, L, Ie, H, S = d
    g = torch.Generator().manual_seed(tp * 10 + T)
    gd = torch.Generator(device=dev).manual_seed(tp * 10 + T)
    op = wp.W2T1Persist(*d, pk=pk)
    fn = itf.compiled(("test_w2p", *d, pk), lambda: wp.build(*d, pk=pk))
    w2 = (torch.randn(E, L, Ie, device=dev, generator=gd) * 0.05).to(torch.bfloat16)
    sw2 = torch.zeros(H, S, dtype=torch.bfloat16, device=dev)
    hs = torch.zeros(T, S, dtype=torch.bfloat16, device=dev)

    def pad(x):  # the slot lists are sized for the worst case
        return torch.cat([x, torch.zeros(op.slots - x.numel(), dtype=torch.int32)]).to(dev)

    for draw in range(2):
        ids = torch.randperm(E, generator=g)[: T * K].view(T, K)
        ids[1:, 0] = ids[0, 0]  # T > 1: one expert shared by every token (distinct per token)
        se, so, sn, nact, pairs = mg.lists_from_ids(ids, E)
        h = torch.randn(T * K, Ie, generator=g).to(torch.bfloat16).to(dev)
        tw = torch.rand(T * K, generator=g).to(dev)
        nact_t = torch.tensor([nact, 0, 0, 0], dtype=torch.int32, device=dev)
        big = torch.full((T * L + 256,), float("nan"), device=dev)
        acc = big[: T * L]
        acc.zero_()
        shared_out = torch.full((T, H), float("nan"), device=dev)
        fn(h, hs, w2, sw2, acc, shared_out, pairs.to(dev), tw, pad(se), pad(so), pad(sn),
           nact_t)  # fmt: skip
        torch.cuda.synchronize()
        ref = _ref(h, w2, tw, se, so, sn, nact, pairs, T, K, L)
        err = ((acc.view(T, L) - ref).norm() / ref.norm()).item()
        assert err <= 1e-4, (draw, err)
        assert torch.isnan(big[T * L :]).all() and torch.isnan(shared_out).all()


@pytest.mark.gpu
@pytest.mark.parametrize("preset,tp,var", [("kimi-k3", 8, "grouped_t1_w2p"),
                                           ("kimi-k3", 16, "grouped_t1_w2p"),
                                           ("kimi-k3", 8, "grouped_t1_w2p_pw4_ps4"),
                                           ("tiny", 1, "grouped_t1_w2p")])  # fmt: skip
def test_w2p_chain_gpu(preset, tp, var, monkeypatch, clean_env):
    """The script's checks (h, shared_out, weights poisoned first; lists, routed sum, block vs
    the references) at 1 token with the persistent w2, two fresh draws."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from decodescope.kernels.specialized.moe_block import SpecializedMoE

    gs = _script()
    for k, v in gs.variant_env(var).items():
        monkeypatch.setenv(k, v)
    cfg = get_config(preset, tp)
    w = make_layer_weights(cfg, LayerSpec(1, "kda", "moe"), seed=tp, device="cuda")
    blk = SpecializedMoE(cfg, w, 1)
    gs.RESULTS.clear()
    for draw in range(2):
        ctx = {"preset": preset, "tp": tp, "tokens": 1, "draw": draw, "experts": var}
        gs.run_checks(cfg, w, blk, 1, ctx, seed=23 + draw, front_norm=False, fronts=False)
    bad = [r for r in gs.RESULTS if r.get("status") in ("FAIL", "error")]
    assert not bad, bad
    assert any(r.get("check") == "shared_out" for r in gs.RESULTS)
