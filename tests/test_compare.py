"""Comparison and regression check on pairs of real runs, plus derived tables where a known
answer is needed (times scaled by a factor: stated where used)."""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from decodescope import tracer
from decodescope.analysis import compare, regress, schema

TRACES = Path(__file__).parent / "data" / "traces"
HF_QWEN = TRACES / "kineto_h100_qwen1.5-0.5b_hf_eager__TraceLens.json.gz"
VLLM_B200 = TRACES / "kineto_b200_vllm_tp8_rank0_prefill_eager__TraceLens.json.gz"
RESNET = TRACES / "kineto_v100_resnet50_2021_legacy__kineto_tb_plugin.pt.trace.json.gz"


@pytest.fixture(scope="module")
def hf() -> schema.Run:
    return tracer.load(HF_QWEN)


@pytest.fixture(scope="module")
def vllm() -> schema.Run:
    return tracer.load(VLLM_B200)


def scaled(run: schema.Run, factor: float) -> schema.Run:
    """DERIVED from a real run: every kernel's start and end moved so that all durations and
    distances on the GPU timeline are multiplied by ``factor`` (a run ``factor`` times slower)."""
    k = run.kernels
    s = np.asarray(k["start_ns"].to_pylist(), dtype=np.int64)
    e = np.asarray(k["end_ns"].to_pylist(), dtype=np.int64)
    t0 = s.min()
    s2 = t0 + np.round((s - t0) * factor).astype(np.int64)
    e2 = t0 + np.round((e - t0) * factor).astype(np.int64)
    k = k.set_column(k.schema.get_field_index("start_ns"), "start_ns", pa.array(s2))
    k = k.set_column(k.schema.get_field_index("end_ns"), "end_ns", pa.array(e2))
    return run.replace(kernels=k, meta=run.meta.replace(run_id=run.run_id + f"-x{factor}"))


def test_same_run_twice(hf):
    again = tracer.load(HF_QWEN)  # imported twice: the same figures
    kinds = compare.compare_kinds(hf.kernels, again.kernels).to_pylist()
    assert len(kinds) == 1
    (k,) = kinds
    assert k["ratio"] == pytest.approx(1.0)
    assert k["kernels_delta"] == 0 and k["span_us_delta"] == 0
    layers = compare.compare_layers(hf.kernels, again.kernels)
    assert layers.num_rows == 24
    assert set(layers["ratio"].to_pylist()) == {1.0}
    assert compare.only_one_side(hf.kernels, again.kernels).num_rows == 0
    assert compare.verdict(hf.kernels, again.kernels).startswith("B is as fast as A per layer")
    ops = compare.compare_ops(hf.kernels, again.kernels)
    assert ops.num_rows > 0 and all(d == 0 for d in ops["kernels_delta"].to_pylist())


def test_two_different_real_runs(hf, vllm):
    kinds = compare.compare_kinds(hf.kernels, vllm.kernels).to_pylist()
    (k,) = kinds
    assert (k["a_layers"], k["b_layers"]) == (24, 36)
    assert (k["a_kernels"], k["b_kernels"], k["kernels_delta"]) == (42, 21, -21)
    assert k["ratio"] == pytest.approx(k["a_span_us"] / k["b_span_us"])
    layers = compare.compare_layers(hf.kernels, vllm.kernels).to_pylist()
    assert len(layers) == 36
    only_b = [r for r in layers if r["a_span_us"] is None]
    assert [r["layer"] for r in only_b] == list(range(24, 36))
    assert all(r["b_span_us"] is not None and r["ratio"] is None for r in only_b)
    # kernels on one side: exactly the set differences of the kernel names
    names_a = set(hf.kernels["name"].to_pylist())
    names_b = set(vllm.kernels["name"].to_pylist())
    one = compare.only_one_side(hf.kernels, vllm.kernels).to_pylist()
    assert {r["name"] for r in one if r["side"] == "a"} == names_a - names_b
    assert {r["name"] for r in one if r["side"] == "b"} == names_b - names_a
    calls_a = collections.Counter(hf.kernels["name"].to_pylist())
    assert all(r["calls"] == calls_a[r["name"]] for r in one if r["side"] == "a")
    v = compare.verdict(hf.kernels, vllm.kernels)
    assert "42 -> 21 kernels" in v


def test_scaled_run_gives_the_ratio(hf):
    slow = scaled(hf, 2.0)  # DERIVED: HF run with every GPU time doubled
    (k,) = compare.compare_kinds(slow.kernels, hf.kernels).to_pylist()
    assert k["ratio"] == pytest.approx(2.0, rel=1e-4)
    assert compare.verdicts(compare.compare_kinds(slow.kernels, hf.kernels))[0].startswith(
        "B is 2.00x faster per layer: 42 -> 42 kernels"
    )
    assert compare.verdicts(compare.compare_kinds(hf.kernels, slow.kernels))[0].startswith(
        "B is 2.00x slower per layer"
    )


def test_layers_without_names_compare_to_nothing():
    run = tracer.load(RESNET)  # no ranges at all: nothing per layer, kernels still compared
    assert compare.compare_kinds(run.kernels, run.kernels).num_rows == 0
    assert compare.verdict(run.kernels, run.kernels).startswith("no layers")


# -- the reference figures and fused ops (SYNTHETIC tables: not a real trace) --------------------


def _layer(kind: str, ops: dict[str, int], total_us: float, step: int = 0, layer: int = 0):
    """SYNTHETIC: one layer-step whose ops launch the given kernel counts back to back, spanning
    ``total_us`` in all."""
    n = sum(ops.values())
    dur = int(total_us * 1000 / n)
    rows = collections.defaultdict(list)
    t = step * 10_000_000
    i = 0
    for op, count in ops.items():
        for _ in range(count):
            rows["rank"].append(0)
            rows["step"].append(step)
            rows["layer"].append(layer)
            rows["layer_kind"].append(kind)
            rows["block"].append("attn")
            rows["op"].append(op)
            rows["name"].append(f"{op}_kernel")
            rows["start_ns"].append(t + i * dur)
            rows["end_ns"].append(t + (i + 1) * dur if i < n - 1 else t + int(total_us * 1000))
            rows["range_path"].append(f"step/layer.{layer}:{kind}/layer.{layer}.attn.{op}")
            i += 1
    return schema.from_pydict(dict(rows), "kernels")


def test_reference_verdict_and_fused_coverage():
    a = _layer(
        "kda",
        {"qkv_proj": 5, "kda_recurrence": 6, "o_proj": 2, "allreduce": 1, "residual_norm": 9},
        130,
    )
    b = _layer("kda", {"qkv_proj": 5, "kda_recurrence": 4, "o_proj+allreduce+residual_norm": 4}, 69)
    (line,) = compare.verdicts(compare.compare_kinds(a, b))
    assert line == "B is 1.88x faster per KDA layer: 23 -> 13 kernels, 130 -> 69 us"
    (f,) = compare.fused_coverage(a, b).to_pylist()
    assert f["b_op"] == "o_proj+allreduce+residual_norm"
    assert f["covers"] == ["o_proj", "allreduce", "residual_norm"] and f["missing"] == []
    assert f["a_kernels"] == 12 and f["b_kernels"] == 4
    ops = {r["op"]: r for r in compare.compare_ops(a, b).to_pylist()}
    assert ops["o_proj"]["b_kernels"] is None and ops["o_proj"]["a_kernels"] == 2
    assert ops["o_proj+allreduce+residual_norm"]["a_kernels"] is None


# -- regression check ---------------------------------------------------------------------------


def test_check_same_run_is_ok(hf):
    again = tracer.load(HF_QWEN)
    res = regress.check(again, hf, max_regression_pct=1.0)
    assert res.ok and res.reasons == []
    assert res.table.to_pylist()[0]["status"] == "ok"


def test_check_scaled_run_regresses(hf):
    slow = scaled(hf, 1.10)  # DERIVED: 10% slower everywhere
    res = regress.check(slow, hf, max_regression_pct=5.0)
    assert not res.ok
    assert len(res.reasons) == 1 and "span" in res.reasons[0] and "+10.0%" in res.reasons[0]
    assert regress.check(slow, hf, max_regression_pct=15.0).ok
    # faster is never a regression
    assert regress.check(scaled(hf, 0.5), hf, max_regression_pct=0.0).ok


def test_check_against_several_baselines_takes_the_median(hf):
    # DERIVED baselines: 1.0x, 1.2x and 3.0x the real run: the median is the 1.2x one
    bases = [hf, scaled(hf, 1.2), scaled(hf, 3.0)]
    res = regress.check(scaled(hf, 1.25), bases, max_regression_pct=5.0)
    assert res.ok, res.reasons
    row = res.table.to_pylist()[0]
    assert row["baseline_runs"] == 3
    assert row["baseline_span_us"] == pytest.approx(
        1.2 * compare.compare_kinds(hf.kernels, hf.kernels)["a_span_us"][0].as_py(), rel=1e-4
    )
    assert not regress.check(scaled(hf, 1.4), bases, max_regression_pct=5.0).ok


def test_check_kernel_count_and_missing_kind(hf, vllm):
    # vLLM layers launch 21 kernels, HF layers 42: against vLLM as the baseline, HF regresses on
    # kernels; with the kernel threshold raised it regresses on span only if slower
    res = regress.check(hf, vllm, max_regression_pct=10.0)
    assert not res.ok and any("kernels: 42 vs baseline 21" in r for r in res.reasons)
    res2 = regress.check(hf, vllm, max_regression_pct=10.0, max_kernel_increase_pct=150)
    assert all("kernels" not in r for r in res2.reasons)
    # a run without layers against a baseline with layers: the layers went missing
    resnet = tracer.load(RESNET)
    res3 = regress.check(resnet, hf, max_regression_pct=10.0)
    assert not res3.ok and "missing from the run" in res3.reasons[0]
    with pytest.raises(ValueError):
        regress.check(hf, hf, max_regression_pct=-1)


def test_knob_ab_on_real_h200_runs():
    """A knob A/B from the committed H200 results (session 18, r6, TP8 batch 1, same call: the
    default against ``DECODESCOPE_MLA_SPLIT_EARLYABS=1``): ``compare`` names the knob that
    differs, and where the layers overlap under programmatic dependent launch the verdict gives
    the share beside the span (the MLA layer: span 126 -> 125 us, share 113 -> 112)."""
    from decodescope.ui.cmd_compare import compare_data

    results = Path(__file__).resolve().parent.parent / "results"
    a = tracer.load(f"{results}@specialized-20261202T071635")
    b = tracer.load(f"{results}@specialized-20261202T071558")
    data = compare_data(a, b)
    assert data["knobs_differ"] == [
        "knobs that differ: A DECODESCOPE_MLA_SPLIT_EARLYABS unset",
        "                  B DECODESCOPE_MLA_SPLIT_EARLYABS=1",
    ]
    mla = [v for v in data["verdict"] if "MLA layer" in v][0]
    assert mla.endswith("by share 113 -> 112 us (1.01x faster)"), mla
    kinds = {r["layer_kind"]: r for r in data["kinds"].to_pylist()}
    assert kinds["mla"]["share_us_delta"] < -0.8 and kinds["mla"]["span_us_delta"] > -0.8
    # the dense layer has no overlap to speak of: span only
    assert "by share" not in [v for v in data["verdict"] if "dense" in v][0]
    assert compare_data(a, a)["knobs_differ"] == []


def test_chunked_verify_step_and_shape_lines_on_real_h200_runs():
    """The first specialized runs of the verify step of 32 sequences x 8 tokens (session 19, r2,
    TP8, 256 tokens: the kernels take 64, so each layer ran in 4 chunks and read its weights 4
    times): ``compare`` says so for the chunked side, and warns where A and B ran different step
    shapes (the standard run of 64 x 8 against it); bench and the README table say it too."""
    from decodescope.ui.cmd_bench import chunk_lines as bench_chunks
    from decodescope.ui.cmd_compare import compare_data
    from decodescope.ui.cmd_report import chunk_note, run_summary

    results = Path(__file__).resolve().parent.parent / "results"
    spec = tracer.load(f"{results}@specialized-20261202T100146-ea1686")  # TP8 32x8
    std = tracer.load(f"{results}@standard-20261202T100136")  # TP8 32x8, same call
    std64 = tracer.load(f"{results}@standard-20261202T100215")  # TP8 64x8
    one = tracer.load(f"{results}@specialized-20261202T100041")  # TP8 32x1: one chunk
    note = "4 chunks of 8 sequences (256 tokens per step): launches and weight reads x4"
    assert chunk_note(spec.meta) == note and run_summary(spec)["chunks"] == note
    assert chunk_note(std.meta) is None and chunk_note(one.meta) is None
    data = compare_data(std, spec)
    assert data["chunked"] == [f"B ran in {note}"] and data["shapes_differ"] == []
    # the chunked run's layers hold every chunk's launches: 40 per KDA layer, 4 x 10
    kinds = {r["layer_kind"]: r for r in data["kinds"].to_pylist()}
    assert kinds["kda"]["b_kernels"] == 40
    assert compare_data(std64, spec)["shapes_differ"] == [
        "different step shapes (ratios compare different work): A batch 64; B batch 32"
    ]
    assert compare_data(one, spec)["shapes_differ"] == [
        "different step shapes (ratios compare different work): A tokens_per_seq 1; "
        "B tokens_per_seq 8"
    ]
    assert bench_chunks([std, spec, one]) == [f"specialized 32x8: ran in {note}"]


def test_chunk_note_without_a_record():
    """Synthetic metas (the exact corners): no workload config (an imported trace), one chunk,
    and a malformed record give no note."""
    from types import SimpleNamespace

    from decodescope.ui.cmd_report import chunk_note

    def meta(cfg):
        return SimpleNamespace(config=cfg, tokens_per_seq=8)

    assert chunk_note(meta({})) is None
    assert chunk_note(meta({"workload": {"chunks": {"sequences": 8, "chunks": 1}}})) is None
    assert chunk_note(meta({"workload": {"chunks": {"chunks": "x"}}})) is None
    assert chunk_note(meta({"workload": {"chunks": {"sequences": 8, "chunks": 8}}})) == (
        "8 chunks of 8 sequences (512 tokens per step): launches and weight reads x8"
    )
    once = {"workload": {"chunks": {"sequences": 8, "chunks": 4, "experts": "once"}}}
    assert chunk_note(meta(once)) == (
        "4 chunks of 8 sequences (256 tokens per step): attention and MoE front/back launches "
        "and their weight reads x4, the experts once over all tokens"
    )
    wide = {"workload": {"chunks": {"sequences": 8, "chunks": 4, "experts": "once",
                                    "token_ops": "once"}}}  # fmt: skip
    assert chunk_note(meta(wide)) == (
        "4 chunks of 8 sequences (256 tokens per step): the decode kernels x4; the projections, "
        "the MoE front/back and the experts once over all tokens"
    )
    wide["workload"]["chunks"]["dense"] = "once"  # session 22: a dense layer's MLP too
    assert "the MoE front/back, the dense MLP and the experts once" in chunk_note(meta(wide))
    wide["workload"]["chunks"]["decode"] = "once"  # DECODESCOPE_CHUNK_DECODE=once
    assert chunk_note(meta(wide)) == (
        "one pass over the step's 256 tokens: every kernel once over all of them, none per "
        "sequence chunk (the decode kernels over all 32 sequences; the projections, the MoE "
        "front/back, the dense MLP, the experts)"
    )


def test_fused_coverage_where_both_sides_run_the_same_fused_op():
    """Session 19's TP8 64 x 8 pair: the standard path's verify step runs the KDA decode as one
    op named like the specialized one (``conv1d+kda_recurrence+gated_norm``); the fused-coverage
    table finds it on A under that name instead of reporting its three parts missing. The
    verdict says in words which way the share points (it may disagree with the span)."""
    results = Path(__file__).resolve().parent.parent / "results"
    a = tracer.load(f"{results}@standard-20261202T100215")
    b = tracer.load(f"{results}@specialized-20261202T100222")
    rows = [r for r in compare.fused_coverage(a.kernels, b.kernels).to_pylist()
            if r["layer_kind"] == "kda" and r["b_op"] == "conv1d+kda_recurrence+gated_norm"]  # fmt: skip
    assert len(rows) == 1 and rows[0]["missing"] == [] and rows[0]["a_kernels"] == 1
    assert rows[0]["covers"] == ["conv1d+kda_recurrence+gated_norm"]
    tp2a = tracer.load(f"{results}@standard-tp2-20261130T232229")
    tp2b = tracer.load(f"{results}@specialized-tp2-20261130T232237")
    v = {x.split(" per ")[1].split(":")[0]: x for x in compare.verdicts(compare.compare_kinds(
        tp2a.kernels, tp2b.kernels))}  # fmt: skip
    assert v["KDA layer"].startswith("B is 1.03x slower") and v["KDA layer"].endswith(
        "by share 413 -> 382 us (1.08x faster)"
    )
    assert v["MLA layer"].endswith("by share 400 -> 424 us (1.06x slower)")


def test_compare_names_different_gpus():
    """Two real traces of different GPUs (H100 Qwen HF eager, B200 vLLM prefill): the comparison
    says the ratios compare different hardware."""
    from decodescope.ui.cmd_compare import compare_data

    traces = Path(__file__).resolve().parent / "data" / "traces"
    a = tracer.load(traces / "kineto_h100_qwen1.5-0.5b_hf_eager__TraceLens.json.gz")
    b = tracer.load(traces / "kineto_b200_vllm_tp8_rank0_prefill_eager__TraceLens.json.gz")
    lines = compare_data(a, b)["shapes_differ"]
    assert any(
        x.startswith("different GPUs (ratios compare different hardware): A ") for x in lines
    )
    assert a.meta.gpu in lines[-1] and b.meta.gpu in lines[-1]
    assert compare_data(a, a)["shapes_differ"] == []
