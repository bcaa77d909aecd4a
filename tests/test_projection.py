"""Projection arithmetic (issue 7): exact sums over the layer mix, labelled as projections."""

import math

import pytest

from decodescope.analysis.projection import K3_LAYER_MIX, bytes_floor_us, project_step


def test_step_is_the_layer_mix_sum():
    p = project_step({"kda": 100.0, "mla": 200.0, "dense": 50.0}, batch=1)
    assert p.step_us == pytest.approx(69 * 100 + 24 * 200 + 50)
    assert p.tok_s == pytest.approx(1 / (p.step_us * 1e-6))
    assert p.missing == ()
    assert "projection" in p.label


def test_missing_kind_is_excluded_and_said():
    p = project_step({"kda": 100.0, "mla": 200.0}, batch=8, outside_us=10.0)
    assert p.step_us == pytest.approx(6900 + 4800 + 10)
    assert p.missing == ("dense",)
    assert "dense" in p.label and "not measured" in p.label
    assert p.tok_s == pytest.approx(8 / (p.step_us * 1e-6))


def test_speculative_tokens_per_step():
    plain = project_step({"kda": 1.0, "mla": 1.0, "dense": 1.0}, batch=2)
    spec = project_step({"kda": 1.0, "mla": 1.0, "dense": 1.0}, batch=2, tokens_per_seq=6)
    assert spec.tok_s == pytest.approx(6 * plain.tok_s)


def test_reference_mix_and_floor():
    assert sum(K3_LAYER_MIX.values()) == 94
    # DESIGN.md section 3: 390 MB at 4.22 TB/s is about 93 us
    assert math.isclose(bytes_floor_us(390e6, 4.22), 92.4, rel_tol=0.01)
    with pytest.raises(ValueError):
        project_step({}, batch=1)
    with pytest.raises(ValueError):
        project_step({"kda": 1.0}, batch=0)


def test_measured_dense_layer_is_summed_and_said():
    """A run with layers "dense,kda,mla" has a dense span: the one dense layer is summed and
    the label names every kind it summed; without one the label says it is excluded."""
    with_dense = project_step({"kda": 100.0, "mla": 200.0, "dense": 80.0}, batch=1)
    without = project_step({"kda": 100.0, "mla": 200.0}, batch=1)
    assert with_dense.dense_measured and not without.dense_measured
    assert with_dense.step_us - without.step_us == pytest.approx(80.0)
    assert with_dense.parts["dense"] == pytest.approx(80.0)
    assert "1 dense" in with_dense.label and "not measured" not in with_dense.label
    assert "69 kda + 24 mla" in without.label and "excludes dense" in without.label
