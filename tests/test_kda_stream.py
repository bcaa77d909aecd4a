"""The KDA decode's persistent state stream (``DECODESCOPE_KDA_STREAM``,
:mod:`decodescope.kernels.specialized.kda_decode_stream`), its batched chain
(``DECODESCOPE_KDA_CHAIN``, :meth:`.kda_decode.KDADecode.item_tokens_batched`) and that chain's
occupancy and rolled-loop knobs (``DECODESCOPE_KDA_OCC``, ``DECODESCOPE_KDA_ROLL``): sm_90a
compiles on the CPU at the kimi-k3 TP8 / TP16 shapes (1 and 8 tokens), the knobs' values and
one-line errors, the bulk copies before the PDL wait and the block barriers in the PTX, the
state rows each lane owns, and the CTAs' walk over the items replayed in Python (every item
once; every wait on a slot's mbarrier matches the arming of that slot for the same item, in
order). The GPU tests (``-m gpu``, the ``gks`` fixture of ``conftest.py``) run
``scripts/gpu_kda_split.py``'s checks against :func:`kda_decode.kda_decode_ref`, and the
batched chain against the per-token one on the same inputs (within tolerance)."""

from __future__ import annotations

import dataclasses
import re
from collections import Counter

import pytest
import torch

from decodescope.kernels.config import LayerSpec, get_config
from decodescope.kernels.specialized import interface as itf  # sets CUTE_DSL_ARCH first
from decodescope.kernels.specialized import kda_decode as kda
from decodescope.kernels.specialized import kda_decode_stream as kst
from decodescope.kernels.weights import make_layer_weights


@pytest.fixture
def clean_env(monkeypatch):
    for v in (kda.VSPLIT_ENV, kda.EARLY_ENV, kda.STREAM_ENV, kda.CHAIN_ENV, kda.OCC_ENV,
              kda.ROLL_ENV, kda.STAGE_ENV, kda.SPLIT_STAGE_ENV):  # fmt: skip
        monkeypatch.delenv(v, raising=False)
    return monkeypatch


def _plan(
    tp: int, B: int, T: int, ns: int, cpsm: int = 1, pdl: bool = True, chain: str = "token"
) -> kda.KDAPlan:
    p = kda.plan_for(get_config("kimi-k3", tp), B, T)
    return dataclasses.replace(p, vsplit=1, stream=ns, stream_cpsm=cpsm, pdl=pdl, chain=chain)


@pytest.mark.parametrize(
    "tp,B,T,ns,cpsm", [(8, 64, 1, 2, 1), (8, 64, 1, 1, 2), (16, 64, 1, 3, 1), (8, 8, 8, 2, 1)]
)
def test_compiles(tp, B, T, ns, cpsm, clean_env):
    p = _plan(tp, B, T, ns, cpsm)
    op = kda.make_op(p)
    assert isinstance(op, kst.KDADecodeStream)
    assert op.ctas == min(p.heads * B, kda.NUM_SMS * cpsm)
    assert itf.compile_only(op, *kda._fake_args(p)) is not None


def test_bulk_before_wait(clean_env):
    """The first ``stages`` states' bulk copies (``PIECES`` each) precede ``griddepcontrol.wait``;
    the refills follow it; the consumers wait on the mbarriers."""
    p = _plan(8, 64, 1, 2)
    ptx = itf.ptx_text(kda.make_op(p), *kda._fake_args(p))
    w = ptx.find("griddepcontrol.wait")
    assert w > 0
    assert ptx[:w].count("cp.async.bulk.shared") == 2 * kst.PIECES
    assert ptx[w:].count("cp.async.bulk.shared") == kst.PIECES
    assert "mbarrier.try_wait" in ptx[w:]


def test_selection(clean_env):
    mp = clean_env
    assert kda.stream_for(1) == (0, 1)  # unset: off (the one-CTA kernel)
    assert kda.plan_for(get_config("kimi-k3", 8), 64, 1).stream == 0
    for v, want in (("2", (2, 1)), ("3x1", (3, 1)), ("1x2", (1, 2)), ("0", (0, 1))):
        mp.setenv(kda.STREAM_ENV, v)
        assert kda.stream_for(1) == want
        assert kda.stream_for(8) == (0, 1)  # the split runs instead
    mp.setenv(kda.STREAM_ENV, "2")
    p = kda.plan_for(get_config("kimi-k3", 8), 64, 1)
    assert (p.vsplit, p.stream, p.stream_cpsm) == (1, 2, 1)
    assert isinstance(kda.make_op(p), kst.KDADecodeStream)
    assert kda.plan_for(get_config("kimi-k3", 8), 1, 1).stream == 0  # split 8 at one sequence
    mp.setenv(kda.STREAM_ENV, "4")
    with pytest.raises(ValueError, match="DECODESCOPE_KDA_STREAM='4'"):
        kda.stream_for(1)


@pytest.mark.parametrize("tp,B,T,ns", [(8, 64, 1, 0), (16, 64, 8, 0), (8, 64, 1, 2),
                                       (16, 32, 8, 2)])  # fmt: skip
def test_batched_compiles(tp, B, T, ns, clean_env):
    p = _plan(tp, B, T, ns, chain="batched")
    op = kda.make_op(p)
    assert op.batched and op.nt == T and op.nred == 3 * T * op.warps
    assert itf.compile_only(op, *kda._fake_args(p)) is not None


@pytest.mark.parametrize("T", [1, 8])
def test_batched_barriers(T, clean_env):
    """The one-CTA kernel's block barriers (``bar.sync``): the per-token chain ten per token
    (two per q / k / o reduction, four more), the batched chain four for all tokens (the staged
    projection's, the two reductions' and the one after the decay / q / k rows); with ``T``
    tokens unrolled. And the staging itself: the batched chain reads the projection by 16-byte
    loads issued before any is used (q, k, v, g and f_a of all tokens: ``ceil(5 T hd / 8 /
    threads)`` per thread) and only beta and the conv history / weights by 16-bit loads, the
    same count at 1 and 8 tokens; the per-token chain one 16-bit load per value and token."""
    counts, loads = {}, {}
    for chain in ("token", "batched"):
        p = _plan(8, 64, T, 0, chain=chain)
        op = kda.make_op(p)
        ptx = itf.ptx_text(op, *kda._fake_args(p))
        counts[chain] = ptx.count("bar.sync")
        loads[chain] = (len(re.findall(r"ld\.global\S*\.v4", ptx)),
                        len(re.findall(r"ld\.global\S*\.(?:b16|u16)\b", ptx)))  # fmt: skip
    assert counts == {"token": 10 * T, "batched": 4}
    hd = kda.plan_for(get_config("kimi-k3", 8), 64, T).head_dim
    staged = -(-5 * T * hd // 8 // op.threads)
    # (an iteration spanning the q / k / v / g and the f_a parts has one load site of each)
    assert loads["batched"][0] - loads["token"][0] in (staged, staged + 1)
    assert loads["batched"][1] < loads["token"][1]
    if T == 8:
        p1 = _plan(8, 64, 1, 0, chain="batched")
        ptx1 = itf.ptx_text(kda.make_op(p1), *kda._fake_args(p1))
        assert len(re.findall(r"ld\.global\S*\.(?:b16|u16)\b", ptx1)) == loads["batched"][1]


@pytest.mark.parametrize("tp,T,vs", [(8, 1, 8), (16, 8, 8), (8, 8, 2)])
def test_batched_split(tp, T, vs, clean_env):
    """The cluster split's batched chain: compiles; the staged projection's block barrier,
    one block barrier pair and one cluster barrier for all tokens (the per-token loop: five and
    one per token, plus the exit's)."""
    counts = {}
    for chain in ("token", "batched"):
        p = dataclasses.replace(kda.plan_for(get_config("kimi-k3", tp), 1, T), vsplit=vs,
                                chain=chain)  # fmt: skip
        op = kda.make_op(p)
        assert op.batched == (chain == "batched")
        ptx = itf.ptx_text(op, *kda._fake_args(p))
        counts[chain] = (ptx.count("bar.sync"), ptx.count("barrier.cluster.wait"))
    assert counts == {"token": (5 * T, T + 1), "batched": (4, 2)}


@pytest.mark.parametrize("tp,B,T,vs", [(8, 1, 8, 8), (16, 1, 8, 8), (8, 2, 8, 4), (8, 1, 2, 2)])
def test_split_stage(tp, B, T, vs, clean_env):
    """``DECODESCOPE_KDA_SPLIT_STAGE``: the cluster split's batched chain stages its projection
    (one block barrier more, three 16-byte stores to shared memory at 8 tokens, 16-bit global
    loads only for beta, the conv history and weights: fewer than per token); on by default,
    ``0`` off, and the per-token chain never stages; a bad value is a one-line error."""
    mp = clean_env
    cfg = get_config("kimi-k3", tp)
    on = dataclasses.replace(kda.plan_for(cfg, B, T), vsplit=vs, chain="batched")
    assert on.split_stage and kda.make_op(on).staged
    mp.setenv(kda.SPLIT_STAGE_ENV, "0")
    assert not kda.plan_for(cfg, B, T).split_stage
    base = dataclasses.replace(on, split_stage=False)
    assert not kda.make_op(base).staged
    assert not kda.make_op(dataclasses.replace(on, chain="token")).staged
    got = {}
    for p in (base, on):
        ptx = itf.ptx_text(kda.make_op(p), *kda._fake_args(p))
        got[p.split_stage] = (ptx.count("bar.sync"), ptx.count("st.shared.v4"),
                              len(re.findall(r"ld\.global\S*\.(?:b16|u16)\b", ptx)))  # fmt: skip
    assert got[True][0] == got[False][0] + 1
    assert got[False][1] == 0 and got[True][1] >= 1
    assert got[True][2] < got[False][2]
    mp.setenv(kda.SPLIT_STAGE_ENV, "2")
    with pytest.raises(ValueError, match="DECODESCOPE_KDA_SPLIT_STAGE='2'"):
        kda.split_stage_enabled()


@pytest.mark.gpu
@pytest.mark.parametrize("tp,B,T,vs", [(8, 1, 8, 8), (16, 1, 8, 8), (8, 2, 8, 4), (16, 8, 8, 2)])
def test_split_stage_gpu(gks, tp, B, T, vs, clean_env):
    """The split's staged batched chain against the reference, two draws (output poisoned)."""
    cfg = get_config("kimi-k3", tp)
    w = make_layer_weights(cfg, LayerSpec(1, "kda", "moe"), seed=tp, device="cuda")
    p = dataclasses.replace(kda.plan_for(cfg, B, T), vsplit=vs, chain="batched", split_stage=True)
    for d in range(2):
        res = gks.check(cfg, w, p, B, T, seed=5 + d)
        assert res["ok"], res


@pytest.mark.parametrize("chain", ["token", "batched"])
def test_rows(chain, clean_env):
    """``srow``: the state rows of a column's two lanes (``half``) x ``hd / 2`` registers
    cover the column's rows once; the batched chain's are contiguous per lane (its 16-byte
    shared-memory loads read rows ``4g .. 4g + 3`` of the lane's block)."""
    op = kda.KDADecode(_plan(8, 64, 1, 0, chain=chain))
    rows = [op.srow(ii, half) for half in range(2) for ii in range(64)]
    assert sorted(rows) == list(range(128))
    if chain == "batched":
        assert rows == list(range(128))


def test_chain_selection(clean_env):
    """Unset or ``auto``: batched everywhere but the cluster split at one token (H200 s30);
    ``token`` / ``batched`` everywhere; a bad value is a one-line error."""
    mp = clean_env
    c8, c16 = get_config("kimi-k3", 8), get_config("kimi-k3", 16)
    assert kda.chain_mode() == "batched" and kda.chain_mode(1, 8) == "token"
    assert kda.chain_mode(8, 8) == "batched" and kda.chain_mode(1, 1) == "batched"
    assert kda.plan_for(c8, 1, 1).chain == "token"  # split 8, one token
    assert kda.plan_for(c8, 1, 8).chain == "batched"  # split 8, the verify step
    assert kda.plan_for(c8, 64, 1).chain == "batched"  # one CTA per item
    assert kda.plan_for(c16, 64, 8).chain == "batched"
    mp.setenv(kda.CHAIN_ENV, "auto")
    assert kda.plan_for(c8, 1, 1).chain == "token"
    mp.setenv(kda.CHAIN_ENV, "token")
    assert kda.plan_for(c16, 64, 8).chain == "token"
    mp.setenv(kda.CHAIN_ENV, "batched")
    assert kda.plan_for(c8, 1, 1).chain == "batched"
    mp.setenv(kda.CHAIN_ENV, "fast")
    with pytest.raises(ValueError, match="DECODESCOPE_KDA_CHAIN='fast'"):
        kda.chain_mode()
    mp.delenv(kda.CHAIN_ENV)
    with pytest.raises(ValueError, match="chain 'fast'"):
        kda.KDADecode(dataclasses.replace(_plan(8, 64, 1, 0), chain="fast"))


def test_occupancy(clean_env):
    """``DECODESCOPE_KDA_OCC``: the batched one-CTA kernel asks for two CTAs per SM at one token
    always; from two tokens ``auto`` (unset) takes two where it means fewer waves (TP8 64 x 8:
    6 -> 3; TP16 32 x 8: 2 -> 1; not at 384 CTAs, 3 -> 2, nor within one wave), ``1`` / ``2``
    force it; the per-token chain asks for nothing (its launch unchanged); a bad value is a
    one-line error."""
    mp = clean_env
    c8, c16 = get_config("kimi-k3", 8), get_config("kimi-k3", 16)
    assert kda.make_op(kda.plan_for(c8, 64, 1)).occupancy()["min_blocks_per_mp"] == 2
    auto = {(tp, b): kda.plan_for(c, b, 8).occ
            for tp, c in ((8, c8), (16, c16)) for b in (8, 16, 32, 64)}  # fmt: skip
    assert auto == {(8, 8): 1, (8, 16): 2, (8, 32): 1, (8, 64): 2,
                    (16, 8): 1, (16, 16): 1, (16, 32): 2, (16, 64): 1}  # fmt: skip
    assert kda.make_op(kda.plan_for(c8, 64, 8)).occupancy()["min_blocks_per_mp"] == 2
    assert kda.make_op(kda.plan_for(c8, 32, 8)).occupancy() == {}
    mp.setenv(kda.OCC_ENV, "1")
    assert kda.make_op(kda.plan_for(c8, 64, 8)).occupancy() == {}
    mp.setenv(kda.OCC_ENV, "2")
    assert kda.plan_for(c8, 64, 8).occ == 2
    assert kda.make_op(kda.plan_for(c8, 64, 8)).occupancy()["min_blocks_per_mp"] == 2
    mp.setenv(kda.CHAIN_ENV, "token")
    assert kda.make_op(kda.plan_for(c8, 64, 8)).occupancy() == {}
    mp.setenv(kda.OCC_ENV, "3")
    with pytest.raises(ValueError, match="DECODESCOPE_KDA_OCC='3'"):
        kda.occ_for()


def test_stage_knob(clean_env):
    """``DECODESCOPE_KDA_STAGE``: on by default; ``0`` gives session 30's prologue back (each
    projection value loaded where it is used: no 16-byte staging loads, one barrier fewer); only
    the batched chain stages; a bad value is a one-line error."""
    mp = clean_env
    c8 = get_config("kimi-k3", 8)
    p = kda.plan_for(c8, 64, 8)
    assert p.stage and kda.make_op(p).staged
    assert not kda.make_op(dataclasses.replace(p, chain="token")).staged
    mp.setenv(kda.STAGE_ENV, "0")
    p0 = kda.plan_for(c8, 64, 8)
    assert not p0.stage and not kda.make_op(p0).staged
    ptx = {q.stage: itf.ptx_text(kda.make_op(q), *kda._fake_args(q)) for q in (p, p0)}
    assert ptx[True].count("bar.sync") == ptx[False].count("bar.sync") + 1
    assert "st.shared.v4" in ptx[True] and "st.shared.v4" not in ptx[False]
    mp.setenv(kda.STAGE_ENV, "on")
    with pytest.raises(ValueError, match="DECODESCOPE_KDA_STAGE='on'"):
        kda.stage_enabled()


def test_roll(clean_env):
    """``DECODESCOPE_KDA_ROLL=1``: the batched chain's token passes as one loop (PTX about
    half the size at 8 tokens, the passes emitted once); only from two tokens and only for the
    batched chain; off by default; a bad value is a one-line error."""
    mp = clean_env
    c16 = get_config("kimi-k3", 16)
    assert not kda.plan_for(c16, 64, 8).roll
    mp.setenv(kda.ROLL_ENV, "1")
    p8 = kda.plan_for(c16, 64, 8)
    assert p8.roll and kda.make_op(p8).roll
    assert not kda.make_op(kda.plan_for(c16, 64, 1)).roll  # one token: nothing to roll
    assert not kda.make_op(dataclasses.replace(p8, chain="token")).roll
    sizes = {}
    for roll in (False, True):
        p = dataclasses.replace(p8, roll=roll)
        ptx = itf.ptx_text(kda.make_op(p), *kda._fake_args(p))
        sizes[roll] = (ptx.count("\n"), ptx.count("ld.shared.v4"))
    assert sizes[True][0] < 0.7 * sizes[False][0]
    assert sizes[True][1] < 0.5 * sizes[False][1]  # the passes' loads: once, not per token
    p = dataclasses.replace(p8, stream=2)  # the stream takes it too
    assert itf.compile_only(kda.make_op(p), *kda._fake_args(p)) is not None
    mp.setenv(kda.ROLL_ENV, "yes")
    with pytest.raises(ValueError, match="DECODESCOPE_KDA_ROLL='yes'"):
        kda.roll_enabled()


def test_refused(clean_env):
    with pytest.raises(ValueError, match="4 stages x 1 CTAs per SM of 64 KB"):
        kst.KDADecodeStream(_plan(8, 64, 1, 4))
    with pytest.raises(ValueError, match="2 stages x 2 CTAs per SM"):
        kst.KDADecodeStream(_plan(8, 64, 1, 2, 2))


@pytest.mark.parametrize("tp,B,ns,cpsm", [(8, 64, 2, 1), (16, 64, 3, 1), (8, 64, 1, 2),
                                          (16, 7, 2, 1), (8, 32, 3, 1)])  # fmt: skip
def test_walk(tp, B, ns, cpsm):
    """The kernel's loop replayed per CTA: item ``it`` from ``cta`` in steps of the grid; the
    ``kk``-th item waits on slot ``kk % NS`` for parity ``(kk // NS) % 2``; thread 0 arms slot
    ``s`` for items ``cta + s x grid`` up front and for ``it + NS x grid`` after reading ``it``.
    Each slot's arms and waits name the same items in the same order (so the parity the k-th
    wait expects is the phase the k-th arming completes), and every item runs once."""
    op = kst.KDADecodeStream(_plan(tp, B, 1, ns, cpsm))
    grid, items = op.ctas, op.items
    done = Counter()
    for cta in range(grid):
        arms = {s: [] for s in range(ns)}
        waits = {s: [] for s in range(ns)}
        for s in range(ns):
            if cta + s * grid < items:
                arms[s].append(cta + s * grid)
        it, kk = cta, 0
        while it < items:
            slot = kk % ns
            assert arms[slot][len(waits[slot])] == it  # armed before, for this item
            assert len(waits[slot]) % 2 == (kk // ns) % 2  # the parity the kernel waits for
            waits[slot].append(it)
            done[it] += 1
            if it + ns * grid < items:
                arms[slot].append(it + ns * grid)
            it += grid
            kk += 1
        assert arms == waits  # nothing armed is left unconsumed
    assert len(done) == items and set(done.values()) == {1}


# -- GPU (the lead's H200 runs: pytest -m gpu tests/test_kda_stream.py) -------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("tp,B,T,ns,cpsm", [(8, 64, 1, 2, 1), (16, 64, 1, 3, 1), (8, 64, 1, 1, 2),
                                            (16, 32, 1, 2, 1), (8, 8, 8, 2, 1), (16, 64, 8, 2, 1),
                                            (8, 7, 1, 1, 1)])  # fmt: skip
@pytest.mark.parametrize("chain", ["token", "batched"])
def test_stream_gpu(gks, tp, B, T, ns, cpsm, chain, clean_env):
    """Output (poisoned first), FP32 state and conv history against the reference, two draws."""
    cfg = get_config("kimi-k3", tp)
    w = make_layer_weights(cfg, LayerSpec(1, "kda", "moe"), seed=tp, device="cuda")
    p = _plan(tp, B, T, ns, cpsm, chain=chain)
    for d in range(2):
        res = gks.check(cfg, w, p, B, T, seed=5 + d)
        assert res["ok"], res


@pytest.mark.gpu
@pytest.mark.parametrize("tp,B,T,vs", [(8, 1, 1, 8), (16, 1, 8, 8), (8, 2, 8, 4)])
def test_batched_split_gpu(gks, tp, B, T, vs, clean_env):
    """The split's batched chain against the reference, two draws (output poisoned)."""
    cfg = get_config("kimi-k3", tp)
    w = make_layer_weights(cfg, LayerSpec(1, "kda", "moe"), seed=tp, device="cuda")
    p = dataclasses.replace(kda.plan_for(cfg, B, T), vsplit=vs, chain="batched")
    for d in range(2):
        res = gks.check(cfg, w, p, B, T, seed=5 + d)
        assert res["ok"], res


@pytest.mark.gpu
@pytest.mark.parametrize("tp,B,T,ns", [(16, 64, 8, 0), (8, 8, 8, 0), (16, 32, 8, 2), (8, 3, 2, 0)])
def test_roll_gpu(gks, tp, B, T, ns, clean_env):
    """The rolled token loop against the reference, two draws (output poisoned)."""
    cfg = get_config("kimi-k3", tp)
    w = make_layer_weights(cfg, LayerSpec(1, "kda", "moe"), seed=tp, device="cuda")
    p = dataclasses.replace(_plan(tp, B, T, ns, chain="batched"), roll=True)
    for d in range(2):
        res = gks.check(cfg, w, p, B, T, seed=5 + d)
        assert res["ok"], res


@pytest.mark.gpu
@pytest.mark.parametrize("tp,B,T,ns,vs", [(8, 64, 1, 0, 1), (16, 8, 8, 0, 1), (8, 64, 8, 2, 1),
                                          (16, 3, 1, 2, 1), (8, 1, 1, 0, 8), (16, 1, 8, 0, 8),
                                          (8, 2, 8, 0, 4), (16, 8, 8, 0, 2)])  # fmt: skip
def test_batched_matches_token_gpu(gks, tp, B, T, ns, vs, clean_env):
    """The batched chain against the per-token one on the same fresh inputs (the one-CTA
    kernel, the stream, the cluster split): the FP32 state within 1e-5 (rel. L2: the one-CTA
    passes add in four partial sums), the conv history equal, the BF16 output within 1e-2."""
    from decodescope.kernels import reference as R
    from decodescope.kernels.weights import make_state

    cfg = get_config("kimi-k3", tp)
    w = make_layer_weights(cfg, LayerSpec(1, "kda", "moe"), seed=tp, device="cuda")
    st = make_state(cfg, LayerSpec(1, "kda", "moe"), B, T, seed=9, device="cuda")
    proj = torch.randn(B * T, cfg.kda_in_proj_out, device="cuda").to(torch.bfloat16)
    got = []
    for chain in ("token", "batched"):
        p = dataclasses.replace(_plan(tp, B, T, ns, chain=chain), vsplit=vs)
        s, c = st["kda_state"].clone(), st["conv_state"].clone()
        out = torch.full((B * T, cfg.kda_dim), float("nan"), dtype=torch.bfloat16, device="cuda")
        gks.run_one(kda.compile_plan(p), cfg, w, proj, s, c, out, p)
        torch.cuda.synchronize()
        got.append((out, s, c))
    (o0, s0, c0), (o1, s1, c1) = got
    assert torch.isfinite(o1.float()).all()
    assert R.rel_l2(o1, o0) < 1e-2 and R.rel_l2(s1, s0) < 1e-5 and torch.equal(c1, c0)
