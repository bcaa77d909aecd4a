"""Metrics (DESIGN.md section 7): on real traces against figures computed here from the raw JSON,
and on small synthetic tables for exact corners (overlapping intervals, medians over steps)."""

from __future__ import annotations

import collections
import gzip
import json
import math
from pathlib import Path

import pyarrow.compute as pc
import pytest

from decodescope import tracer
from decodescope.analysis import metrics, schema

TRACES = Path(__file__).parent / "data" / "traces"
HF_QWEN = TRACES / "kineto_h100_qwen1.5-0.5b_hf_eager__TraceLens.json.gz"
VLLM_B200 = TRACES / "kineto_b200_vllm_tp8_rank0_prefill_eager__TraceLens.json.gz"


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def _json_layers(path: Path, layer_class: str) -> dict[int, list[tuple[float, float]]]:
    """layer -> kernel intervals (us), straight from the JSON: each kernel's launch lies in which
    ``nn.Module: <layer_class>_N`` event of its thread (the innermost)."""
    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    launches = {
        e["args"]["correlation"]: (e["tid"], e["ts"])
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    prefix = f"nn.Module: {layer_class}_"
    mods = [
        (e["tid"], e["ts"], e["ts"] + e["dur"], int(e["name"][len(prefix) :]))
        for e in events
        if e.get("cat") == "python_function" and str(e.get("name", "")).startswith(prefix)
    ]
    out = collections.defaultdict(list)
    for e in events:
        if e.get("cat") != "kernel":
            continue
        tid, ts = launches.get(e["args"]["correlation"], (None, None))
        inside = [m for m in mods if m[0] == tid and m[1] <= ts <= m[2]]
        if inside:
            layer = max(inside, key=lambda m: m[1])[3]
            out[layer].append((e["ts"], e["ts"] + e["dur"]))
    return out


@pytest.mark.parametrize(
    ("path", "layer_class"), [(HF_QWEN, "Qwen2DecoderLayer"), (VLLM_B200, "TransformerBlock")]
)
def test_layer_steps_match_json(path, layer_class):
    run = tracer.load(path)
    got = {r["layer"]: r for r in metrics.layer_steps(run.kernels).to_pylist()}
    expected = _json_layers(path, layer_class)
    assert set(got) == set(expected)
    for layer, iv in expected.items():
        r = got[layer]
        assert r["kernels"] == len(iv)
        span = max(e for _, e in iv) - min(s for s, _ in iv)
        busy = _union_us(iv)
        ksum = sum(e - s for s, e in iv)
        # the JSON holds microseconds with 3 decimals; the run integer ns: agree to 2 ns per kernel
        tol = 0.002 * len(iv) + 1e-6
        assert r["span_us"] == pytest.approx(span, abs=tol)
        assert r["busy_us"] == pytest.approx(busy, abs=tol)
        assert r["kernel_sum_us"] == pytest.approx(ksum, abs=tol)
        assert r["gaps_us"] == pytest.approx(r["span_us"] - r["busy_us"], abs=1e-9)


def test_kernel_table_totals_match_json():
    run = tracer.load(HF_QWEN)
    with gzip.open(HF_QWEN, "rt") as f:
        kernels = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]
    kt = metrics.kernel_table(run.kernels)
    assert sum(kt["calls"].to_pylist()) == len(kernels)
    assert sum(kt["total_us"].to_pylist()) == pytest.approx(
        sum(e["dur"] for e in kernels), abs=0.002 * len(kernels)
    )
    assert sum(kt["share"].to_pylist()) == pytest.approx(1.0)
    totals = kt["total_us"].to_pylist()
    assert totals == sorted(totals, reverse=True)
    # every kernel row says where it ran
    assert all(ops for ops in kt["ops"].to_pylist())


def test_hf_kind_and_op_tables():
    run = tracer.load(HF_QWEN)
    kt = metrics.kind_table(run.kernels).to_pylist()
    assert len(kt) == 1 and kt[0]["layers"] == 24 and kt[0]["kernels"] == 42
    lt = metrics.layer_table(run.kernels)
    assert lt.num_rows == 24 and set(lt["steps"].to_pylist()) == {1}
    assert kt[0]["span_us"] == pytest.approx(sorted_median(lt["span_us"].to_pylist()))
    ot = metrics.op_table(run.kernels)
    # the ops of a layer add up to its kernels
    per_layer = sum(r["kernels"] for r in ot.to_pylist())
    assert per_layer == 42


def sorted_median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return (xs[(n - 1) // 2] + xs[n // 2]) / 2


# -- synthetic: exact corners (stated: these tables are made up, not a real trace) ----------------


def _synthetic_kernels(rows: list[tuple]) -> schema.Run:
    """SYNTHETIC kernels: (step, layer, kind, block, op, stream, start_ns, end_ns, name)."""
    cols = collections.defaultdict(list)
    for step, layer, kind, block, op, stream, s, e, name in rows:
        cols["rank"].append(0)
        cols["step"].append(step)
        cols["layer"].append(layer)
        cols["layer_kind"].append(kind)
        cols["block"].append(block)
        cols["op"].append(op)
        cols["stream"].append(stream)
        cols["start_ns"].append(s)
        cols["end_ns"].append(e)
        cols["name"].append(name)
        cols["range_path"].append("x")
    return schema.from_pydict(dict(cols), "kernels")


def test_busy_gaps_with_overlap_synthetic():
    # SYNTHETIC: one layer-step, two streams, nested and overlapping and disjoint intervals
    # [0,100) s1; [50,150) s2 overlaps; [20,40) s2 nested; [300,400) s1 after a 150 ns gap
    k = _synthetic_kernels(
        [
            (0, 3, "kda", "attn", "a", 1, 0, 100, "k1"),
            (0, 3, "kda", "attn", "a", 2, 50, 150, "k2"),
            (0, 3, "kda", "attn", "b", 2, 20, 40, "k3"),
            (0, 3, "kda", "moe", "c", 1, 300, 400, "k4"),
            (0, None, None, None, None, 1, 0, 10_000, "outside"),  # no layer: not counted
        ]
    )
    (r,) = metrics.layer_steps(k).to_pylist()
    assert r["kernels"] == 4
    assert r["span_us"] == pytest.approx(0.400)
    assert r["busy_us"] == pytest.approx(0.250)
    assert r["gaps_us"] == pytest.approx(0.150)
    assert r["kernel_sum_us"] == pytest.approx(0.320)


def test_medians_over_steps_synthetic():
    # SYNTHETIC: layer 0 (kda) in 3 steps with 2, 3, 4 kernels of 10 ns back to back;
    # layer 1 (mla) in 2 steps, 1 kernel of 30 / 50 ns
    rows = []
    for step, n in enumerate([2, 3, 4]):
        base = step * 1000
        rows += [
            (step, 0, "kda", "attn", "qkv", 1, base + 10 * i, base + 10 * i + 10, "g")
            for i in range(n)
        ]
    rows += [
        (0, 1, "mla", "attn", "mla_decode", 1, 500, 530, "m"),
        (1, 1, "mla", "attn", "mla_decode", 1, 1500, 1550, "m"),
    ]
    k = _synthetic_kernels(rows)
    lt = {r["layer"]: r for r in metrics.layer_table(k).to_pylist()}
    assert lt[0]["steps"] == 3
    assert (lt[0]["kernels"], lt[0]["kernels_min"], lt[0]["kernels_max"]) == (3, 2, 4)
    assert lt[0]["span_us"] == pytest.approx(0.030)
    assert lt[1]["span_us"] == pytest.approx(0.040)  # median of two: the mean
    assert (lt[1]["span_us_min"], lt[1]["span_us_max"]) == (
        pytest.approx(0.030),
        pytest.approx(0.050),
    )
    kt = {r["layer_kind"]: r for r in metrics.kind_table(k).to_pylist()}
    assert set(kt) == {"kda", "mla"}
    assert kt["kda"]["layers"] == 1 and kt["kda"]["kernels"] == 3
    ot = {r["op"]: r for r in metrics.op_table(k).to_pylist()}
    assert ot["qkv"]["layer_steps"] == 3 and ot["qkv"]["kernels"] == 3
    assert ot["qkv"]["kernel_names"] == ["g"]
    kn = {r["name"]: r for r in metrics.kernel_table(k).to_pylist()}
    assert kn["g"]["calls"] == 9 and kn["g"]["ops"] == ["attn.qkv"]
    assert kn["m"]["median_us"] == pytest.approx(0.040)


def test_empty_and_unattributed_only():
    empty = schema.empty("kernels")
    for f in (
        metrics.layer_steps,
        metrics.layer_table,
        metrics.kind_table,
        metrics.op_table,
        metrics.kernel_table,
    ):
        assert f(empty).num_rows == 0
    k = _synthetic_kernels([(0, None, None, None, None, 1, 0, 10, "x")])  # SYNTHETIC
    assert metrics.layer_table(k).num_rows == 0
    assert metrics.kernel_table(k)["ops"].to_pylist() == [["x"]]


def test_layer_table_nan_free_on_real_run():
    run = tracer.load(VLLM_B200)
    lt = metrics.layer_table(run.kernels)
    for m in metrics.METRICS:
        vals = lt[m].to_pylist()
        assert all(v is not None and not math.isnan(v) for v in vals)
    assert pc.min(lt["gaps_us"]).as_py() >= 0


def test_bytes_floor():
    # SYNTHETIC kernels; the bytes and bandwidth are DESIGN.md section 3's figures for one KDA
    # layer + LatentMoE at TP8, batch 1, BF16 (about 390 MB at 4.22 TB/s: a floor of about 93 us)
    k = _synthetic_kernels([(0, 0, "kda", "attn", "qkv", 1, 0, 130_000, "g")])
    (r,) = metrics.with_floor(metrics.kind_table(k), {"kda": 390_000_000}, 4.22).to_pylist()
    assert r["floor_us"] == pytest.approx(92.4, abs=0.1)
    assert r["efficiency"] == pytest.approx(130 / 92.42, rel=1e-3)
    # one kernel on one stream: the share is the span
    assert r["share_efficiency"] == pytest.approx(r["efficiency"])
    (none,) = metrics.with_floor(metrics.kind_table(k), None, None).to_pylist()
    assert none["floor_us"] is None and none["efficiency"] is None
    assert none["share_efficiency"] is None


def test_share_with_early_start_synthetic():
    # SYNTHETIC: layer 1's first kernel is resident before layer 0 ends (programmatic dependent
    # launch: it starts at 50 and waits), layer 2 starts after layer 1 ends; two steps
    rows = []
    for step in (0, 1):
        b = step * 10_000
        rows += [
            (step, 0, "dense", "attn", "a", 1, b + 0, b + 100, "k0"),
            (step, 1, "kda", "attn", "a", 1, b + 50, b + 150, "k1"),  # waits 50 ns
            (step, 1, "kda", "moe", "b", 1, b + 150, b + 200, "k2"),
            (step, 2, "mla", "attn", "a", 1, b + 210, b + 260, "k3"),
        ]
    ls = {
        (r["step"], r["layer"]): r
        for r in metrics.layer_steps(_synthetic_kernels(rows)).to_pylist()
    }
    for step in (0, 1):
        assert ls[(step, 0)]["share_us"] == pytest.approx(0.100)  # the first layer: its span
        assert ls[(step, 1)]["span_us"] == pytest.approx(0.150)
        assert ls[(step, 1)]["share_us"] == pytest.approx(0.100)  # from layer 0's end at 100
        assert ls[(step, 2)]["share_us"] == pytest.approx(0.050)  # no overlap: the span
    kt = {r["layer_kind"]: r for r in metrics.kind_table(_synthetic_kernels(rows)).to_pylist()}
    assert kt["kda"]["share_us"] == pytest.approx(0.100) and kt["kda"]["span_us"] == pytest.approx(
        0.150
    )


def test_op_share_synthetic():
    # SYNTHETIC: one step of one layer. Op "a" runs 0-100; op "b" is resident from 20 (PDL
    # wait) and ends at 160; op "r" runs on a second stream 110-140, hidden inside b; op "c"
    # starts at 170 after a 10 ns gap and ends at 200.
    rows = [
        (0, 1, "kda", "attn", "a", 1, 0, 100, "ka"),
        (0, 1, "kda", "attn", "b", 1, 20, 160, "kb"),
        (0, 1, "kda", "moe", "r", 2, 110, 140, "kr"),
        (0, 1, "kda", "moe", "c", 1, 170, 200, "kc"),
    ]
    ot = {r["op"]: r for r in metrics.op_table(_synthetic_kernels(rows)).to_pylist()}
    assert ot["a"]["share_us"] == pytest.approx(0.100)
    assert ot["b"]["span_us"] == pytest.approx(0.140)
    # 0-100: a ends first; 100-110 and 140-160: b alone; 110-140: r ends before b
    assert ot["b"]["share_us"] == pytest.approx(0.030)
    assert ot["r"]["share_us"] == pytest.approx(0.030)
    assert ot["c"]["share_us"] == pytest.approx(0.030)  # the gap before it is nobody's
    assert sum(r["share_us"] for r in ot.values()) == pytest.approx(0.190)  # the busy union


def test_share_on_h200_bench_runs():
    """Real H200 bench runs (results/, commit 38188ca, TP8 batch 1, dense + KDA + MLA layers):
    the specialized layers' first kernels start under PDL before the previous layer ends, so
    their share of the step is below their span; the standard path's layers do not overlap.
    Within a step the shares add up to the step's first-start-to-last-end time less the idle
    gaps between layers (counted in no layer), while the spans count each overlap twice."""
    from decodescope.tracer.dataset import read_runs

    results = Path(__file__).parent.parent / "results"
    spec, std = read_runs(
        results, ["specialized-20261130T223524-dc2419", "standard-20261130T223518-fb6748"]
    )
    if spec.meta.backend != "specialized":
        spec, std = std, spec
    for run, overlaps in ((spec, True), (std, False)):
        ls = metrics.layer_steps(run.kernels).to_pylist()
        by_step = collections.defaultdict(list)
        for r in ls:
            by_step[r["step"]].append(r)
        assert len(by_step) >= 20
        k = run.kernels
        for step, rs in by_step.items():
            sel = k.filter(pc.and_(pc.equal(k["step"], step), pc.is_valid(k["layer"])))
            total = (pc.max(sel["end_ns"]).as_py() - pc.min(sel["start_ns"]).as_py()) / 1e3
            idle = total - sum(r["share_us"] for r in rs)
            assert -1e-6 < idle < 3.0, (step, idle)
            if overlaps:
                assert sum(r["span_us"] for r in rs) > total + 10
        kda = next(
            r for r in metrics.kind_table(run.kernels).to_pylist() if r["layer_kind"] == "kda"
        )
        if overlaps:
            assert kda["share_us"] < kda["span_us"] - 10  # H200: 151.5 vs 176.3 us
        else:
            assert kda["share_us"] == pytest.approx(kda["span_us"], abs=1.0)
