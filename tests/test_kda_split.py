"""The KDA decode split over thread-block clusters (``DECODESCOPE_KDA_VSPLIT``,
:mod:`decodescope.kernels.specialized.kda_decode_split`): sm_90a compiles on the CPU at the
kimi-k3 TP8 / TP16 shapes (1 and 8 tokens), the split's selection and one-line errors, and the
thread-to-state mapping replayed in Python (every state entry, output column and conv channel
owned exactly once). The GPU test (``-m gpu``) runs ``scripts/gpu_kda_split.py``'s checks
against :func:`kda_decode.kda_decode_ref`."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from decodescope.kernels.config import LayerSpec, get_config
from decodescope.kernels.specialized import interface as itf  # sets CUTE_DSL_ARCH first
from decodescope.kernels.specialized import kda_decode as kda
from decodescope.kernels.specialized import kda_decode_split as kds
from decodescope.kernels.weights import make_layer_weights


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv(kda.VSPLIT_ENV, raising=False)
    monkeypatch.delenv(kda.EARLY_ENV, raising=False)
    return monkeypatch


def _plan(tp: int, B: int, T: int, vs: int) -> kda.KDAPlan:
    return dataclasses.replace(kda.plan_for(get_config("kimi-k3", tp), B, T), vsplit=vs)


@pytest.mark.parametrize("tp,T,vs", [(8, 1, 4), (8, 1, 8), (16, 1, 8), (8, 8, 8), (16, 8, 2)])
def test_compiles(tp, T, vs, clean_env):
    p = _plan(tp, 1, T, vs)
    op = kda.make_op(p)
    assert isinstance(op, kds.KDADecodeSplit) and op.cw * vs == p.head_dim
    assert op.lpc * op.cw == kds.THREADS and op.rpt * op.lpc == p.head_dim
    assert itf.compile_only(op, *kda._fake_args(p)) is not None


def test_selection(clean_env):
    mp = clean_env
    assert kda.vsplit_for(1, 12, 128) == 8  # unset: auto at one token (H200 s14/r1, early loads)
    assert kda.vsplit_for(1, 12, 128, tokens=8) == 8  # and from two (H200 s13/r4)
    assert kda.vsplit_for(8, 12, 128, tokens=8) == 1 and kda.vsplit_for(8, 6, 128, tokens=8) == 2
    assert kda.plan_for(get_config("kimi-k3", 8), 1, 8).vsplit == 8
    mp.setenv(kda.VSPLIT_ENV, "0")  # auto: the largest split within the SMs, 1 from half of them
    assert kda.vsplit_for(1, 12, 128) == 8 and kda.vsplit_for(1, 6, 128) == 8
    assert kda.vsplit_for(2, 12, 128) == 4 and kda.vsplit_for(4, 12, 128) == 2
    assert kda.vsplit_for(8, 12, 128) == 1 and kda.vsplit_for(1, 4, 32) == 1
    mp.setenv(kda.VSPLIT_ENV, "4")
    assert kda.vsplit_for(8, 12, 128) == 4
    assert kda.plan_for(get_config("kimi-k3", 8), 1, 1).vsplit == 4
    assert isinstance(kda.make_op(kda.plan_for(get_config("kimi-k3", 8), 1, 1)),
                      kds.KDADecodeSplit)  # fmt: skip
    mp.setenv(kda.VSPLIT_ENV, "3")
    with pytest.raises(ValueError, match="DECODESCOPE_KDA_VSPLIT='3'"):
        kda.vsplit_for(1, 12, 128)


@pytest.mark.parametrize("T", [1, 8])
def test_early(T, clean_env):
    """``DECODESCOPE_KDA_EARLY=1``: the split's state / conv / weight loads before its PDL wait
    (PTX: global loads before ``griddepcontrol.wait``), the projection's after it; unset: none
    before it. A bad value is a one-line error."""
    counts = []
    for early in (False, True):
        p = dataclasses.replace(_plan(8, 1, T, 8), early=early, pdl=True)
        ptx = itf.ptx_text(kda.make_op(p), *kda._fake_args(p))
        w = ptx.find("griddepcontrol.wait")
        counts.append((ptx[:w].count("ld.global"), ptx[w:].count("ld.global")))
    (before0, _), (before1, after1) = counts
    assert before0 == 0 and before1 > 0 and after1 > 0
    assert kda.plan_for(get_config("kimi-k3", 8), 1, T).early  # unset: on (H200 s14/r1)
    clean_env.setenv(kda.EARLY_ENV, "0")
    assert not kda.plan_for(get_config("kimi-k3", 8), 1, T).early
    clean_env.setenv(kda.EARLY_ENV, "1")
    assert kda.plan_for(get_config("kimi-k3", 8), 1, T).early
    clean_env.setenv(kda.EARLY_ENV, "yes")
    with pytest.raises(ValueError, match="DECODESCOPE_KDA_EARLY='yes'"):
        kda.early_enabled()


def test_refused(clean_env):
    tiny = get_config("tiny", 1)  # head_dim 32: the split kernel takes 128
    p = dataclasses.replace(kda.plan_for(tiny, 1, 1), vsplit=2)
    with pytest.raises(ValueError, match="head_dim 32"):
        kda.make_op(p)
    with pytest.raises(ValueError, match="vsplit=16"):
        kds.KDADecodeSplit(_plan(8, 1, 1, 16))


@pytest.mark.parametrize("vs", [2, 4, 8])
def test_ownership(vs):
    """The kernel's index math replayed: per head, CTA rank ``r`` and thread ``t``: its state
    entries (row ``ii * LPC + t % LPC``, column ``r * CW + t // LPC``), the output / v-conv
    column of each column's first lane, the q / k conv channel it writes. Each exactly once."""
    op = kds.KDADecodeSplit(_plan(8, 1, 1, vs))
    hd = 128
    state, outs, qk = Counter(), Counter(), Counter()
    for r in range(vs):
        for t in range(kds.THREADS):
            jl, rp = t // op.lpc, t % op.lpc
            j = r * op.cw + jl
            for ii in range(op.rpt):
                state[(ii * op.lpc + rp, j)] += 1
            if rp == 0:
                outs[j] += 1
            which, ch = t // hd, t % hd
            if ch // op.cw == r:
                qk[(which, ch)] += 1
    assert len(state) == hd * hd and set(state.values()) == {1}
    assert len(outs) == hd and set(outs.values()) == {1}
    assert len(qk) == 2 * hd and set(qk.values()) == {1}


# -- GPU (the lead's H200 runs: pytest -m gpu tests/test_kda_split.py) --------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("tp,B,T,vs,early", [(8, 1, 1, 8, False), (8, 1, 8, 8, False),
                                             (16, 1, 1, 8, False), (8, 2, 1, 4, False),
                                             (16, 1, 8, 2, False), (8, 1, 1, 8, True),
                                             (16, 1, 8, 8, True)])  # fmt: skip
def test_split_gpu(gks, tp, B, T, vs, early, clean_env):
    """Output (poisoned first), FP32 state and conv history against the reference, two draws
    (``early``: the loads before the PDL wait; one kernel alone, nothing to overlap)."""
    cfg = get_config("kimi-k3", tp)
    w = make_layer_weights(cfg, LayerSpec(1, "kda", "moe"), seed=tp, device="cuda")
    p = dataclasses.replace(_plan(tp, B, T, vs), early=early)
    for d in range(2):
        res = gks.check(cfg, w, p, B, T, seed=5 + d)
        assert res["ok"], res
