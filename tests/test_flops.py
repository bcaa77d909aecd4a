"""The compute floors beside the bytes floors (:mod:`decodescope.kernels.flops`, the GEMM rate
recorded beside a run's copy bandwidth, ``decodescope report``'s and ``scripts/op_floors.py``'s
op tables).

The FLOP counts are checked by hand at the kimi-k3 shapes, and against the ops of the real H200
runs in ``results/``: each op's FLOPs add up to the layer's, for the standard and the
specialized layers. Those runs predate the GEMM rate. The tests that need one set it on a real
run's metadata (700 TFLOP/s, a synthetic rate: the kernels and shares are the run's own).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from cli_helpers import cli

from decodescope import tracer
from decodescope.analysis import metrics
from decodescope.analysis.schema import RunMeta
from decodescope.kernels import flops as F
from decodescope.kernels.config import get_config
from decodescope.ui.op_floors import op_floors

# the newest TP8 64x8 runs (ae03bef, session 36's part 47)
SPEC = "results@specialized-20261204T182339-6e2c05"
STD = "results@standard-20261204T182332-6d8a10"


def test_hand_counts_kimi_k3_tp8():
    """The parts at TP8, 64 sequences of 1 + 7 tokens (512 rows), by hand."""
    cfg = get_config("kimi-k3", 8)
    H, L = cfg.hidden, cfg.expert_dim
    assert (H, L) == (7168, 3584)
    mla = F.layer_flops_breakdown(cfg, "mla", 64, 8)
    assert mla["latent_down_up"] == 2 * (2 * 512 * L * H)  # the back's 26.3 GFLOP, twice
    assert round(mla["latent_down_up"] / 2 / 1e9, 1) == 26.3
    assert mla["routed_experts"] == 2 * 512 * 16 * 3 * cfg.expert_inter * L
    assert mla["fused_qkv_a"] == 2 * 512 * 2112 * H and mla["g_proj"] == 2 * 512 * 1536 * H
    # each sequence's 8 new rows see the 1024 cached keys and 1..8 of the new ones
    keys = 8 * 1024 + 36
    assert mla["kv_cache_read"] == 64 * 12 * keys * (2 * 576 + 2 * 512)
    assert mla["w_uk_uv"] == 512 * 12 * 2 * (2 * 128 * 512)
    kda = F.layer_flops_breakdown(cfg, "kda", 64, 8)
    assert "kda_state_rw" not in kda and "conv_state_rw" not in kda  # vector work: no floor
    assert kda["in_proj"] == 2 * 512 * cfg.kda_in_proj_out * H
    dense = F.layer_flops_breakdown(cfg, "dense", 1, 1)
    assert dense["dense_mlp"] == 2 * 3 * cfg.dense_inter * H and "router" not in dense
    assert F.layer_flops(cfg, "kda", 1, 1) * 512 == F.layer_flops(cfg, "kda", 64, 8)
    assert F.compute_floor_us(26.3e9, 700.0) == pytest.approx(37.571, abs=1e-3)


@pytest.mark.parametrize("run_id", [SPEC, STD])
def test_ops_add_up_to_the_layer(run_id):
    """Every op name of a real run (the standard path's own ops, the specialized path's fused
    ones) gets its FLOPs from the layer's parts, once: the ops sum to the layer."""
    run = tracer.load(run_id)
    cfg = get_config("kimi-k3", 8)
    ops = metrics.op_table(run.kernels)
    for kind in ("dense", "kda", "mla"):
        names = [r["op"] for r in ops.to_pylist() if r["layer_kind"] == kind]
        parts = F.layer_flops_breakdown(cfg, kind, 64, 8)
        per_op = F.op_flops(parts, names)
        assert sum(per_op.values()) == pytest.approx(sum(parts.values()), rel=1e-9), kind


def _with_rate(run_id: str, rate: float = 700.0):
    run = tracer.load(run_id)
    return dataclasses.replace(run, meta=run.meta.replace(gemm_tflops=rate))


def test_op_floors_with_a_gemm_rate():
    """With a GEMM rate on the run, each op's FLOPs, compute floor, the larger floor and which
    one bounds it; the back's up-projection over 512 rows is bound by compute, the experts by
    bytes, the KDA recurrence has no compute floor of its own (bytes)."""
    run = _with_rate(SPEC)
    t, why = op_floors(run, metrics.op_table(run.kernels))
    assert why is None
    rows = {(r["layer_kind"], r["op"]): r for r in t.to_pylist()}
    back = rows[("mla", "latent_norm+latent_up+add")]
    assert back["flops"] == 2 * 512 * 3584 * 7168
    assert back["compute_floor_us"] == pytest.approx(back["flops"] / 700e6)
    assert back["bound"] == "compute" and back["roof_floor_us"] == back["compute_floor_us"]
    exp = rows[("kda", "grouped_topk+align+routed_experts+shared_experts+topk_sum")]
    assert exp["bound"] == "bytes" and exp["roof_floor_us"] == exp["op_floor_us"]
    rec = rows[("kda", "conv1d+kda_recurrence+gated_norm")]
    assert rec["flops"] == 0 and rec["bound"] == "bytes"
    norm = rows[("kda", "residual_norm")]  # its norm weight's bytes, no FLOPs
    assert norm["flops"] == 0 and norm["bound"] == "bytes"
    plain, _ = op_floors(tracer.load(SPEC), metrics.op_table(run.kernels))
    assert "compute_floor_us" not in plain.column_names  # no rate, no compute columns


def test_report_shows_compute_floors(tmp_path):
    """``decodescope report``: a run with its GEMM rate gets the compute floor and bound
    columns (and ``gemm_tflops`` in the summary, JSON too); one without says why they are
    missing."""
    from decodescope.tracer.store import write_run
    from decodescope.ui import cmd_report

    run = _with_rate(SPEC, 750.0)
    data = cmd_report.report_data(run, 5)
    assert data["run"]["gemm_tflops"] == 750.0
    assert {"compute_floor_us", "bound"} <= set(data["ops"].column_names)
    folder = write_run(run, tmp_path / "run")
    res = cli("report", folder, width=250)
    assert res.returncode == 0, res.stderr
    assert "compute floor us" in res.stdout and "750 TFLOP/s" in res.stdout
    js = cli("report", folder, "--json")
    assert js.returncode == 0, js.stderr
    assert json.loads(js.stdout)["run"]["gemm_tflops"] == 750.0
    res = cli("report", SPEC, width=250)
    assert res.returncode == 0 and "recorded no GEMM rate" in res.stdout


def test_run_meta_keeps_the_rate(tmp_path):
    """The runs table's ``gemm_tflops`` column round-trips; runs written before it load with
    None (a missing nullable column)."""
    m = RunMeta(run_id="x", source="cupti", gemm_tflops=712.5)
    assert RunMeta.from_table(m.to_table()).gemm_tflops == 712.5
    old = m.to_table().drop_columns(["gemm_tflops"])
    from decodescope.analysis.schema import conform

    assert RunMeta.from_table(conform(old, "runs")).gemm_tflops is None
    assert tracer.load(SPEC).meta.gemm_tflops is None


def test_gemm_rate_needs_a_gpu():
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the GPU test measures it")
    from decodescope.kernels.bandwidth import gemm_tflops

    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        gemm_tflops()


@pytest.mark.gpu
def test_gemm_rate_on_the_gpu():
    """On the H200: a rate between the copy-bound and the datasheet's dense BF16 figure."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from decodescope.kernels.bandwidth import gemm_tflops

    r = gemm_tflops(4096, 10)
    print(f"gemm_tflops: {r:.1f}")
    assert 50 < r < 1100


def test_report_kinds_get_the_roof_floor():
    """Per layer kind: the ops' larger floors summed (``roof_floor_us``) and share / roof, with a
    GEMM rate (synthetic, on the real run); at 512 rows the dense layer's roof is above its
    bytes floor (its GEMMs are bound by compute), and no kind's roof is below its bytes floor.
    Without a rate the columns are absent."""
    from decodescope.ui import cmd_report

    kinds = cmd_report.report_data(_with_rate(SPEC), 3)["kinds"]
    rows = {r["layer_kind"]: r for r in kinds.to_pylist()}
    for r in rows.values():
        assert r["roof_floor_us"] >= r["floor_us"] - 1e-6
        assert r["share_roof"] == pytest.approx(r["share_us"] / r["roof_floor_us"])
    assert rows["dense"]["roof_floor_us"] > 2 * rows["dense"]["floor_us"]
    plain = cmd_report.report_data(tracer.load(SPEC), 3)["kinds"]
    assert "roof_floor_us" not in plain.column_names
    res = cli("report", SPEC, width=250)
    assert "roof floor us" not in res.stdout


def test_bench_rows_carry_the_gemm_rate():
    """``decodescope bench``'s per-kind rows (its JSON) carry the run's GEMM rate beside its copy
    bandwidth: None for the committed runs, the rate where the run recorded one."""
    from decodescope.ui.cmd_bench import kind_rows

    rows = kind_rows(tracer.load(SPEC), "specialized", 64, 8)
    assert rows and all(r["gemm_tflops"] is None and r["copy_bw_tbs"] for r in rows)
    rows = kind_rows(_with_rate(SPEC, 733.0), "specialized", 64, 8)
    assert {r["gemm_tflops"] for r in rows} == {733.0}
