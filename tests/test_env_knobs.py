"""The environment knobs' shared parser (:mod:`.env_knobs`) and the knobs read through it
(:mod:`.moe_grouped`'s modes and stages, :mod:`.grouped_w2_tile`'s ``TileKnobs``,
:mod:`.skinny_gemm`'s load mode): defaults, values, and a bad value a one-line ``ValueError``
that names the variable. CPU only."""

from __future__ import annotations

import pytest

from decodescope.kernels.specialized import env_knobs as knob
from decodescope.kernels.specialized import grouped_w2_tile as gt
from decodescope.kernels.specialized import moe_grouped as mg
from decodescope.kernels.specialized import skinny_gemm as sg

VAR = "DECODESCOPE_TEST_KNOB"


def _one_line_error(fn, var: str) -> str:
    with pytest.raises(ValueError) as ei:
        fn()
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith(f"{var}=")
    return msg


def test_read_defaults(monkeypatch):
    monkeypatch.delenv(VAR, raising=False)
    assert knob.read(VAR, ("a", "b")) is None
    assert knob.read(VAR, ("a", "b"), "b") == "b"
    assert knob.read(VAR, (1, 2, 3), "2") == 2
    monkeypatch.setenv(VAR, "")  # set but empty: as unset
    assert knob.read(VAR, ("a", "b"), "a") == "a"
    monkeypatch.setenv(VAR, "3")
    assert knob.read(VAR, (1, 2, 3)) == 3 and isinstance(knob.read(VAR, (1, 2, 3)), int)


@pytest.mark.parametrize(
    "allowed,bad,want",
    [
        (("a", "b"), "c", "expected one of ('a', 'b')"),
        (("a", "b"), "A", "expected one of ('a', 'b')"),  # case matters
        (tuple(range(1, 9)), "9", "expected 1..8"),
        (tuple(range(1, 9)), "-1", "expected 1..8"),  # not digits
        (tuple(range(1, 9)), " 2", "expected 1..8"),
        (tuple(range(1, 9)), "two", "expected 1..8"),
        ((0, 32, 64), "48", "expected one of (0, 32, 64)"),  # not a range
    ],
)
def test_bad_value(monkeypatch, allowed, bad, want):
    monkeypatch.setenv(VAR, bad)
    msg = _one_line_error(lambda: knob.read(VAR, allowed), VAR)
    assert msg == f"{VAR}={bad!r}: {want}"


def test_knobs_through_it(monkeypatch):
    for var in ("DECODESCOPE_MOE_GROUPED_W13", "DECODESCOPE_MOE_GROUPED_W2",
                "DECODESCOPE_MOE_W2_STAGES", "DECODESCOPE_MOE_GROUPED_ROUTE", sg.LOAD_ENV):  # fmt: skip
        monkeypatch.delenv(var, raising=False)
    assert mg.w13_mode() == mg.W13_TILE and mg.w2_stages() == mg.W2_RING_STAGES
    assert mg.route_mode() == "thresh" and sg.load_mode() == "regs"
    monkeypatch.setenv("DECODESCOPE_MOE_W2_STAGES", "5")
    assert mg.w2_stages() == 5
    monkeypatch.setenv("DECODESCOPE_MOE_W2_STAGES", "0")
    assert _one_line_error(mg.w2_stages, "DECODESCOPE_MOE_W2_STAGES").endswith("expected 1..8")
    monkeypatch.setenv("DECODESCOPE_MOE_GROUPED_W2", "regs")
    assert mg.w2_mode(8) == "regs"
    monkeypatch.setenv("DECODESCOPE_MOE_GROUPED_W2", "tiles")
    _one_line_error(lambda: mg.w2_mode(8), "DECODESCOPE_MOE_GROUPED_W2")
    monkeypatch.setenv("DECODESCOPE_MOE_GROUPED_W13", "w16")
    _one_line_error(mg.w13_mode, "DECODESCOPE_MOE_GROUPED_W13")
    # the route knob: set but empty stays an error (it has always been)
    monkeypatch.setenv("DECODESCOPE_MOE_GROUPED_ROUTE", "")
    _one_line_error(mg.route_mode, "DECODESCOPE_MOE_GROUPED_ROUTE")
    monkeypatch.setenv(sg.LOAD_ENV, "auto")
    assert sg.load_mode() == "auto"
    monkeypatch.setenv(sg.LOAD_ENV, "tma")
    _one_line_error(sg.load_mode, sg.LOAD_ENV)


def test_tile_knobs_first_bad_named(monkeypatch):
    for var, _ in gt._ENV.values():
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("DECODESCOPE_MOE_W2T_CAP", "513")
    monkeypatch.setenv("DECODESCOPE_MOE_W2T_SNJ", "3")
    # _ENV's order: cap before snj
    msg = _one_line_error(gt.knobs, "DECODESCOPE_MOE_W2T_CAP")
    assert msg.endswith("expected 1..512")
    monkeypatch.setenv("DECODESCOPE_MOE_W2T_CAP", "64")
    assert _one_line_error(gt.knobs, "DECODESCOPE_MOE_W2T_SNJ").endswith("one of (1, 2, 4)")
    monkeypatch.setenv("DECODESCOPE_MOE_W2T_SNJ", "2")
    assert gt.knobs() == gt.TileKnobs(cap=64, snj=2)
