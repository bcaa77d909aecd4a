"""``DECODESCOPE_FAST_SIGMOID``: the kernels' sigmoid on the approximate reciprocal (sm_90a PTX
compiled on the CPU). Off, a kernel's sigmoids are IEEE reciprocals (``rcp.rn.f32``, a slow path
behind a branch in SASS); on, one ``rcp.approx.ftz.f32`` each and no ``rcp.rn``. The default's
PTX is unchanged by the knob's code (``scripts/ptx_snapshot.py``: 112 of 112 cases identical,
session 31). Numerics on the GPU: staged, not yet run."""

from __future__ import annotations

import pytest

from decodescope.kernels.config import get_config
from decodescope.kernels.specialized import interface as itf  # sets CUTE_DSL_ARCH first
from decodescope.kernels.specialized import kda_decode as kda
from decodescope.kernels.specialized import utils


@pytest.fixture
def fs_env(monkeypatch):
    for v in (utils.FAST_SIGMOID_ENV, kda.VSPLIT_ENV, kda.CHAIN_ENV, kda.OCC_ENV, kda.STAGE_ENV):
        monkeypatch.delenv(v, raising=False)
    return monkeypatch


def _ptx(batch: int, tokens: int) -> str:
    p = kda.plan_for(get_config("kimi-k3", 16), batch, tokens)
    return itf.ptx_text(kda.make_op(p), *kda._fake_args(p))


@pytest.mark.parametrize("batch,tokens", [(64, 8), (1, 1)])  # the one-CTA kernel, the split
def test_fast_sigmoid_ptx(fs_env, batch, tokens):
    off = _ptx(batch, tokens)
    fs_env.setenv(utils.FAST_SIGMOID_ENV, "1")
    on = _ptx(batch, tokens)
    assert "rcp.rn.f32" in off and "rcp.approx" not in off
    assert "rcp.rn.f32" not in on and on.count("rcp.approx") == off.count("rcp.rn.f32")


def test_fast_sigmoid_bad_value(fs_env):
    assert utils.fast_sigmoid_enabled() is False
    fs_env.setenv(utils.FAST_SIGMOID_ENV, "yes")
    with pytest.raises(ValueError, match="DECODESCOPE_FAST_SIGMOID='yes'"):
        utils.fast_sigmoid_enabled()
