"""``kernels/specialized/w13_t1_persist.py`` (``DECODESCOPE_MOE_T1_W13=persist``): compiles for
sm_90a on the CPU at the kimi-k3 TP8 / TP16 shapes (several tilings) and the tiny preset; its
work split and ring replayed in Python (every selected expert's ``h`` rows of every pair stored
exactly once, each CTA's steps loaded once, in order, into stage ``step % NS``, at most two slots
per CTA, run lengths differing by at most one); the knobs, the selection (default unchanged:
W13T1), the block's wiring and the script's variant names; on a GPU (``-m gpu``) the kernel alone
against a torch reference and bit for bit against W13T1 (``h`` and ``shared_out`` NaN-poisoned
first, ``h``'s tail left untouched), and the script's checks of the ``grouped_t1_w13p`` chain."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from decodescope.kernels.config import LayerSpec, get_config
from decodescope.kernels.specialized import experts_t1 as t1
from decodescope.kernels.specialized import interface as itf  # sets CUTE_DSL_ARCH first
from decodescope.kernels.specialized import moe_grouped as mg
from decodescope.kernels.specialized import w13_t1_persist as w13p
from decodescope.kernels.weights import make_layer_weights

_VARS = ("DECODESCOPE_MOE_T1", "DECODESCOPE_MOE_T1_ROWS", "DECODESCOPE_MOE_T1_STAGES",
         "DECODESCOPE_MOE_T1_BK", "DECODESCOPE_MOE_T1_SHARED", "DECODESCOPE_MOE_T1_W2PRE",
         "DECODESCOPE_MOE_EXPERTS", "DECODESCOPE_MOE_T1_ROUTE", "DECODESCOPE_MOE_T1_W2",
         "DECODESCOPE_MOE_T1_W13", *(v for v, _ in w13p.ENV.values()))  # fmt: skip
_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_specialized_moe.py"
BETA, LBETA = 4.0, 25.0


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


@pytest.mark.parametrize("tp,units,upc", [(8, 384, 3), (16, 192, 2)])
def test_compiles_kimi_k3(tp, units, upc, clean_env):
    d = _dims("kimi-k3", tp)
    op, args = w13p.build(*d, BETA, LBETA)
    assert (op.R, op.S, op.NW, op.grid, op.units, op.UPC) == (16, 16, 1, 132, units, upc)
    assert op.RPC == 55 and op.NRB == 1  # ceil(7168 / 132) shared rows per CTA, one round
    assert op.cfg.smem_bytes + d[6] * 2 + 1024 <= 228 * 1024  # one CTA per SM
    assert itf.compile_only(op, *args) is not None


@pytest.mark.parametrize("pk,want", [(w13p.PersistKnobs(1, 8, 2), (16, 8, 264)),
                                     (w13p.PersistKnobs(2, 6, 1), (32, 6, 132)),
                                     (w13p.PersistKnobs(1, 6, 3), (16, 6, 384)),
                                     (w13p.PersistKnobs(1, 16, 1, 4), (16, 16, 132))])  # fmt: skip
def test_compiles_knobs(pk, want, clean_env):
    """Other tilings at TP8: 2 CTAs per SM with 8 stages, 32-row units, W13T1's own shape, the
    shared down 4 rows per warp iteration."""
    d = _dims("kimi-k3", 8)
    op, args = w13p.build(*d, BETA, LBETA, pk=pk)
    assert (op.R, op.S, op.grid) == want
    assert pk.per_sm * (op.cfg.smem_bytes + d[6] * 2 + 1024) <= 228 * 1024
    assert itf.compile_only(op, *args) is not None


@pytest.mark.parametrize("tp", [1, 2])
def test_compiles_tiny(tp, clean_env):
    d = _dims("tiny", tp)
    op, args = w13p.build(*d, BETA, LBETA)
    assert op.grid == op.units  # 4 slots x NRT units: fewer than 132
    assert itf.compile_only(op, *args) is not None


def test_compiles_tokens4_no_shared(clean_env):
    """4 tokens (one pass, up to MAX_T) and the shared down left to w2 (``shared=False``)."""
    d = _dims("kimi-k3", 8, T=4)
    op, args = w13p.build(*d, BETA, LBETA, shared=False, pk=w13p.PersistKnobs(1, 8, 2))
    assert op.grid == 264 and not op.shared
    assert itf.compile_only(op, *args) is not None


def _routings():
    """(name, T, ids): 16 distinct experts at 1 token (twice), repeated experts at 4 and 8."""
    g = torch.Generator().manual_seed(5)
    E, K = 896, 16
    out = [("t1", 1, torch.randperm(E, generator=g)[:K][None]),
           ("t1_ends", 1, torch.cat([torch.arange(8), torch.arange(E - 8, E)])[None])]  # fmt: skip
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(4)])
    ids[:, 0] = ids[0, 0]  # one expert for every token (distinct per token)
    out.append(("t4_rep", 4, ids))
    ids = torch.stack([torch.randperm(40, generator=g)[:K] for _ in range(8)])  # heavy repeats
    out.append(("t8_rep", 8, ids))
    return out


@pytest.mark.parametrize("tp", [8, 16])
@pytest.mark.parametrize("name,T,ids", _routings(), ids=[r[0] for r in _routings()])
@pytest.mark.parametrize("pk", [None, w13p.PersistKnobs(1, 8, 2), w13p.PersistKnobs(2, 3, 1),
                                w13p.PersistKnobs(1, 2, 3)])  # fmt: skip
def test_split_covers_rows_once(tp, name, T, ids, pk, clean_env):
    """Every pair's ``Ie`` rows of ``h`` in exactly one CTA's epilogues; each CTA's steps loaded
    once, in order, into stage ``step % NS`` (never one of the ``NS - 1`` stages still in use),
    from at most two slots; run lengths differ by at most one."""
    d = _dims("kimi-k3", tp, T)
    _, E, K, _, Ie, _, _ = d
    op = w13p.W13T1Persist(*d, BETA, LBETA, shared=False, pk=pk)  # (8 tokens' shared z:
    se, so, sn, nact, pairs = mg.lists_from_ids(ids, E)  # more than 2 x 8 stages hold)
    assert int(sn.sum()) == T * K
    stored = {}
    counts = []
    for b in range(op.grid):
        ev = op.plan(nact, b)
        loads = [x for x in ev if x[0] == "load"]
        epis = [x for x in ev if x[0] == "epi"]
        lo, hi = w13p.split(nact * op.NRT, op.grid, b)
        counts.append(hi - lo)
        assert [x[1] for x in loads] == list(range((hi - lo) * op.NCH))
        for _, k, u, _a, _row0, kc, stg in loads:
            assert stg == k % op.S and kc == k % op.NCH and u == lo + k // op.NCH
        assert [x[1] for x in epis] == list(range(lo, hi))
        assert len({x[2] for x in epis}) <= 2
        for _, _u, a, row0 in epis:
            off, n = int(so[a]), int(sn[a])
            for p in pairs[off : off + n].tolist():
                for r in range(row0, min(row0 + op.R, Ie)):
                    stored[(p, r)] = stored.get((p, r), 0) + 1
    assert set(stored) == {(p, r) for p in range(T * K) for r in range(Ie)}
    assert set(stored.values()) == {1}
    assert max(counts) - min(counts) <= 1 and max(counts) <= op.UPC <= op.NRT


def test_knobs_and_selection(clean_env):
    mp = clean_env
    assert w13p.variant() == "tile" and not t1.w13_persist()  # the default: W13T1
    assert w13p.knobs() == w13p.PersistKnobs(1, 16, 1)
    mp.setenv("DECODESCOPE_MOE_T1_W13", "tile")
    assert not t1.w13_persist()
    mp.setenv("DECODESCOPE_MOE_T1_W13", "persist")
    mp.setenv("DECODESCOPE_MOE_T1_W13P_STAGES", "8")
    mp.setenv("DECODESCOPE_MOE_T1_W13P_PERSM", "2")
    assert t1.w13_persist() and w13p.knobs() == w13p.PersistKnobs(1, 8, 2)
    for var, bad in (("DECODESCOPE_MOE_T1_W13", "ring"), ("DECODESCOPE_MOE_T1_W13P_WARPS", "3"),
                     ("DECODESCOPE_MOE_T1_W13P_STAGES", "17"),
                     ("DECODESCOPE_MOE_T1_W13P_PERSM", "x"),
                     ("DECODESCOPE_MOE_T1_W13P_PERSM", "0"),
                     ("DECODESCOPE_MOE_T1_W13P_SDROWS", "3")):  # fmt: skip
        old = __import__("os").environ.get(var, "")
        mp.setenv(var, bad)
        with pytest.raises(ValueError, match=var) as ei:
            (w13p.variant(), w13p.knobs())
        assert "\n" not in str(ei.value)
        mp.setenv(var, old)
    d = _dims("kimi-k3", 8)
    with pytest.raises(ValueError, match="DECODESCOPE_MOE_T1_W13P_") as ei:  # 8 x 64 KB stages
        w13p.W13T1Persist(*d, BETA, LBETA, pk=w13p.PersistKnobs(8, 16, 1))
    assert "\n" not in str(ei.value)
    with pytest.raises(ValueError, match="slots"):  # a grid below the slots: refused
        w13p.W13T1Persist(*d, BETA, LBETA, nsm=8, pk=w13p.PersistKnobs(per_sm=1))


def test_block_wiring(clean_env):
    """``DECODESCOPE_MOE_T1_W13=persist``: the same three launches, W13T1Persist second (its
    knobs in the key); ``tile`` and unset: W13T1 (CPU: builds run, nothing compiled)."""
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
    blk.experts()  # unset: W13T1
    assert calls[:2] == ["moe_t1_route", "moe_t1_w13"] and len(calls) == 3
    mp.setenv("DECODESCOPE_MOE_T1_W13", "persist")
    mp.setenv("DECODESCOPE_MOE_T1_W13P_PERSM", "2")
    mp.setenv("DECODESCOPE_MOE_T1_W13P_STAGES", "4")
    calls.clear()
    keys.clear()
    built.clear()
    blk.experts()
    assert calls[:2] == ["moe_t1_route", "moe_t1_w13p"] and len(calls) == 3
    (i,) = [j for j, k in enumerate(keys) if k[0] == "moe_t1_w13p"]
    op = built[i]
    assert isinstance(op, w13p.W13T1Persist) and op.pk == w13p.PersistKnobs(1, 4, 2)
    assert keys[i][-1] == op.pk and op.S == 4 and op.shared
    mp.setenv("DECODESCOPE_MOE_T1_W13", "tile")
    calls.clear()
    keys.clear()
    built.clear()
    blk.experts()
    assert calls[:2] == ["moe_t1_route", "moe_t1_w13"]
    (i,) = [j for j, k in enumerate(keys) if k[0] == "moe_t1_w13"]
    assert type(built[i]) is t1.W13T1


def _script():
    spec = importlib.util.spec_from_file_location("gpu_specialized_moe_w13p", _SCRIPT)
    gs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gs)
    return gs


def test_script_variants():
    gs = _script()
    env = gs.variant_env("grouped_t1_w13p")
    assert env["DECODESCOPE_MOE_T1"] == "t1" and env["DECODESCOPE_MOE_T1_W13"] == "persist"
    assert env["DECODESCOPE_MOE_T1_W13P_STAGES"] == "" and env["DECODESCOPE_MOE_T1_W2"] == ""
    assert gs.variant_env("grouped_t1")["DECODESCOPE_MOE_T1_W13"] == ""  # the default: tile
    env = gs.variant_env("grouped_t1_w13p_w2_s8_m2")
    assert (env["DECODESCOPE_MOE_T1_W13P_WARPS"], env["DECODESCOPE_MOE_T1_W13P_STAGES"],
            env["DECODESCOPE_MOE_T1_W13P_PERSM"]) == ("2", "8", "2")  # fmt: skip
    env = gs.variant_env("grouped_t1_rt1_w2p_pw4_w13p_m3")
    assert env["DECODESCOPE_MOE_T1_W2"] == "persist" and env["DECODESCOPE_MOE_T1_W2P_WARPS"] == "4"
    assert env["DECODESCOPE_MOE_T1_W13P_PERSM"] == "3" and env["DECODESCOPE_MOE_T1_ROUTE"] == "t1"
    env = gs.variant_env("grouped_t1_s8_w2t_w13p_s12")  # T1 stages vs the w13p stages
    assert env["DECODESCOPE_MOE_T1_STAGES"] == "8" and env["DECODESCOPE_MOE_T1_W13P_STAGES"] == "12"
    assert env["DECODESCOPE_MOE_T1_W2"] == "tile"
    env = gs.variant_env("grouped_t1_w13p_s12_i4")
    assert (env["DECODESCOPE_MOE_T1_W13P_STAGES"], env["DECODESCOPE_MOE_T1_W13P_SDROWS"]) == (
        "12",
        "4",
    )
    assert gs.variant_env("grouped_t1_w13p")["DECODESCOPE_MOE_T1_W13P_SDROWS"] == ""
    for v in ("grouped_t1", "grouped_t1_w2p", "grouped_t1_w2t", "grouped_t1_w2p_pw4_ps4_pm2",
              "grouped_t1_rt1_w2p", "grouped_t1_w2sh_nopre", "grouped_t1base",
              "grouped_t1_w13p", "grouped_t1_w2p_w13p_w1_s16_m1"):  # fmt: skip
        assert gs.variant_name(v) == v
        gs.variant_env(v)


# -- GPU (the lead's H200 runs: pytest -m gpu tests/test_w13_t1_persist.py) ---------------------


def _ref(y, w13, sw2, se, so, sn, nact, pairs, T, E, K, L, Ie, S):
    """``h[p] = bf16(SiTU(w13[e] @ bf16(z_t)))`` for every listed pair, and ``shared_out[t] =
    bf16(SiTU(shared gate, up)) @ shared_w2^T`` (FP32)."""
    from decodescope.kernels.reference import situ_ref

    z = y[:, E : E + L].to(torch.bfloat16).float()
    h = torch.zeros(T * K, Ie, dtype=torch.float32, device=y.device)
    for a in range(nact):
        e, off, n = int(se[a]), int(so[a]), int(sn[a])
        for p in pairs[off : off + n].tolist():
            gu = w13[e].float() @ z[p // K]
            h[p] = situ_ref(gu[:Ie], gu[Ie:], BETA, LBETA).to(torch.bfloat16).float()
    gs, us = y[:, E + L : E + L + S], y[:, E + L + S : E + L + 2 * S]
    hs = situ_ref(gs, us, BETA, LBETA).to(torch.bfloat16).float()
    return h, hs @ sw2.float().T


@pytest.mark.gpu
@pytest.mark.parametrize("preset,tp,T,pk", [("kimi-k3", 8, 1, None), ("kimi-k3", 16, 1, None),
                                            ("kimi-k3", 8, 1, w13p.PersistKnobs(1, 8, 2)),
                                            ("kimi-k3", 8, 1, w13p.PersistKnobs(2, 6, 1)),
                                            ("kimi-k3", 8, 1, w13p.PersistKnobs(1, 16, 1, 4)),
                                            ("kimi-k3", 16, 1, w13p.PersistKnobs(1, 8, 2, 2)),
                                            ("kimi-k3", 8, 4, w13p.PersistKnobs(1, 8, 2)),
                                            ("tiny", 1, 1, None), ("tiny", 2, 1, None)])  # fmt: skip
def test_w13p_alone_gpu(preset, tp, T, pk, clean_env):
    """The kernel alone on random ``y``, ``w13``, ``shared_w2`` and routings: ``h`` and
    ``shared_out`` vs the torch reference (rel. L2 1e-2 / 1e-4) and bit for bit vs W13T1 (same
    chunk order and arithmetic); ``h`` (and its tail past ``T x K`` rows) and ``shared_out``
    NaN-poisoned first: every listed row written, the tail still NaN."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    dev = "cuda"
    d = _dims(preset, tp, T)
    _, E, K, L, Ie, H, S = d
    g = torch.Generator().manual_seed(tp * 10 + T)
    gd = torch.Generator(device=dev).manual_seed(tp * 10 + T)
    op = w13p.W13T1Persist(*d, BETA, LBETA, pk=pk)
    fn = itf.compiled(("test_w13p", *d, pk), lambda: w13p.build(*d, BETA, LBETA, pk=pk))
    tile = itf.compiled(
        ("test_w13p_tile", *d), lambda: t1.build_w13(*d, BETA, LBETA, True, 1 << 16)
    )
    w13 = (torch.randn(E, 2 * Ie, L, device=dev, generator=gd) * 0.05).to(torch.bfloat16)
    sw2 = (torch.randn(H, S, device=dev, generator=gd) * 0.05).to(torch.bfloat16)

    def pad(x):  # the slot lists are sized for the worst case
        return torch.cat([x, torch.zeros(op.slots - x.numel(), dtype=torch.int32)]).to(dev)

    for draw in range(2):
        ids = torch.randperm(E, generator=g)[: T * K].view(T, K)
        ids[1:, 0] = ids[0, 0]  # T > 1: one expert shared by every token (distinct per token)
        se, so, sn, nact, pairs = mg.lists_from_ids(ids, E)
        y = torch.randn(T, E + L + 2 * S, generator=g).to(dev)
        nact_t = torch.tensor([nact, 0, 0, 0], dtype=torch.int32, device=dev)
        outs = []
        for kern in (fn, tile):
            big = torch.full((T * K + 4, Ie), float("nan"), dtype=torch.bfloat16, device=dev)
            h = big[: T * K]
            shared_out = torch.full((T, H), float("nan"), device=dev)
            kern(y, w13, h, pairs.to(dev), pad(se), pad(so), pad(sn), nact_t, sw2, shared_out)
            torch.cuda.synchronize()
            assert torch.isnan(big[T * K :].float()).all()
            outs.append((h.float(), shared_out))
        (h, so_), (ht, sot) = outs
        href, sref = _ref(y, w13, sw2, se, so, sn, nact, pairs, T, E, K, L, Ie, S)
        assert torch.isfinite(h).all() and torch.isfinite(so_).all()
        assert ((h - href).norm() / href.norm()).item() <= 1e-2, draw
        assert ((so_ - sref).norm() / sref.norm()).item() <= 1e-4, draw
        assert torch.equal(h, ht) and torch.equal(so_, sot), draw  # W13T1's rounding, bit for bit


@pytest.mark.gpu
@pytest.mark.parametrize("preset,tp,var", [("kimi-k3", 8, "grouped_t1_w13p"),
                                           ("kimi-k3", 16, "grouped_t1_w13p"),
                                           ("kimi-k3", 8, "grouped_t1_w13p_s8_m2"),
                                           ("kimi-k3", 8, "grouped_t1_w13p_i4"),
                                           ("kimi-k3", 8, "grouped_t1_w2t_w13p"),
                                           ("tiny", 1, "grouped_t1_w13p"),
                                           ("tiny", 2, "grouped_t1_w13p")])  # fmt: skip
def test_w13p_chain_gpu(preset, tp, var, monkeypatch, clean_env):
    """The script's checks (h, shared_out, weights poisoned first; lists, routed sum, block vs
    the references) at 1 token with the persistent w13, two fresh draws."""
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
        gs.run_checks(cfg, w, blk, 1, ctx, seed=29 + draw, front_norm=False, fronts=False)
    bad = [r for r in gs.RESULTS if r.get("status") in ("FAIL", "error")]
    assert not bad, bad
    assert any(r.get("check") == "shared_out" for r in gs.RESULTS)
