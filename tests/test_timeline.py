"""``decodescope timeline`` and :mod:`analysis.timeline` on the committed H200 runs (both paths,
TP16 batch 1, session 27) and a real Kineto trace."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pytest
from cli_helpers import cli

from decodescope import tracer
from decodescope.analysis import metrics
from decodescope.analysis import timeline as tl

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
STD = f"{RESULTS}@standard-20261203T154918-db07da"
SPEC = f"{RESULTS}@specialized-20261203T154926-8e01fd"
HF_QWEN = (
    ROOT / "tests" / "data" / "traces" / "kineto_h100_qwen1.5-0.5b_hf_eager__TraceLens.json.gz"
)


@pytest.fixture(scope="module")
def spec():
    return tracer.load(SPEC)


def test_short_names():
    """CuTe DSL kernels as module and class; C++ ones without arguments or template arguments;
    long names cut with an ellipsis."""
    cute = ("kernel_cutlass_kernel_decodescopekernelsspecializedexperts_t1W13T1_object_at__"
            "tensorptrf32_gmem_align16_o_1524852481_tensorptrbf16")  # fmt: skip
    assert tl.short_name(cute) == "experts_t1W13T1"
    assert tl.short_name("void fused_moe_kernel<bf16, 64>(int const*, float*)") == (
        "fused_moe_kernel<>"
    )
    assert tl.short_name("vllm::moe::grouped_topk_fused_kernel") == (
        "vllm::moe::grouped_topk_fused_kernel"
    )
    long = "x" * 100
    assert len(tl.short_name(long)) == tl.NAME_MAX and tl.short_name(long).endswith("…")


def test_layer_timeline_matches_the_layer_metrics(spec):
    """The KDA layer of the specialized step at its median step: the 9 kernels in start order,
    the first gap null, the span the one ``metrics.layer_steps`` measures for that step, busy +
    idle = span; under PDL most kernels start before the ones before them end (negative gaps),
    and the W13T1 kernel is there by its short name."""
    k = spec.kernels
    step = tl.median_step(k, 1)
    assert step == tl.steps_of(k, 1)[(len(tl.steps_of(k, 1)) - 1) // 2]
    t = tl.layer_timeline(k, 1, step)
    assert t.num_rows == 9 and t["gap_us"][0].as_py() is None
    starts = t["start_us"].to_pylist()
    assert starts == sorted(starts) and starts[0] == 0
    assert "experts_t1W13T1" in t["kernel"].to_pylist()
    m = tl.summary(t)
    ls = metrics.layer_steps(k)
    row = ls.filter(pc.and_(pc.equal(ls["layer"], 1), pc.equal(ls["step"], step))).to_pylist()[0]
    assert m["span_us"] == pytest.approx(row["span_us"], abs=1e-3)
    assert m["busy_us"] + m["idle_us"] == pytest.approx(m["span_us"])
    assert 0 <= m["idle_us"] < m["span_us"] and m["overlap_us"] > 0
    assert sum(g < 0 for g in t["gap_us"].drop_null().to_pylist()) >= 5
    from decodescope.ui.cmd_timeline import bars as text_bars

    bars = text_bars(t, 20)
    assert len(bars) == 9 and all(len(b) == 20 for b in bars) and bars[0].startswith("█")


def test_cli_timeline_both_paths():
    """A (standard) above B (specialized), same layer, each at its median step: both tables,
    each with its summary line; the JSON carries the same rows and sums."""
    p = cli("timeline", STD, SPEC, "--layer", "1")
    assert p.returncode == 0, p.stderr
    out = " ".join(p.stdout.split())
    assert "A: standard-20261203T154918-db07da, layer 1, step 14 (#15 of 30 steps)" in out
    assert "B: specialized-20261203T154926-8e01fd, layer 1, step 14 (#15 of 30 steps)" in out
    assert "29 kernels: span 161.1 us" in out and "9 kernels: span 92.8 us" in out
    assert "fused_moe_kernel" in out and "experts_t1W13T1" in out
    js = json.loads(cli("timeline", STD, SPEC, "--layer", "1", "--json").stdout)
    assert [s["label"] for s in js] == ["A", "B"]
    assert [len(s["kernels"]) for s in js] == [29, 9]
    assert js[1]["summary"]["span_us"] == pytest.approx(92.8, abs=0.05)


def test_cli_timeline_of_a_trace_and_errors():
    """A Kineto trace: its first layer by default; a layer or a step the run lacks is a
    one-line error naming the run and what it has."""
    p = cli("timeline", HF_QWEN)
    assert p.returncode == 0, p.stderr
    assert "42 kernels: span" in " ".join(p.stdout.split())
    # the trace's one step is its ProfilerStep#6: the title says which of its steps that is
    assert "layer 0, step 6 (#1 of 1 step)" in p.stdout
    for args, msg in (
        (["--layer", "99"], "no kernels of layer 99 (layers 0..2)"),
        (["--step", "999"], "no kernels in step 999 (steps 0..29)"),
    ):
        e = cli("timeline", SPEC, *args)
        lines = [x for x in e.stderr.splitlines() if x.strip()]
        assert e.returncode == 2 and len(lines) == 1, e.stderr
        assert "specialized-20261203T154926-8e01fd" in lines[0] and msg in lines[0]


def test_cli_timeline_step_among_the_steps_of_a_kineto_trace():
    """The A100 trace's whole step at its median: the trace's step number (ProfilerStep#551)
    beside its place among the six steps, not "step 551 (of 6)"."""
    a100 = (
        ROOT
        / "tests"
        / "data"
        / "traces"
        / ("kineto_a100_torchcompile_cudagraph__HTA_negative_queue.json.gz")
    )
    p = cli("timeline", a100, "--limit", "3")
    assert p.returncode == 0, p.stderr
    assert "the whole step, step 551 (#3 of 6 steps)" in p.stdout
    e = cli("timeline", a100, "--step", "3")
    assert e.returncode == 2 and "no kernels in step 3 (steps " in e.stderr


def test_cli_timeline_of_a_two_gpu_trace():
    """An Nsight Systems capture of two H100s: one GPU's timeline (the first rank unless
    ``--rank``), its 1721 kernels summed though the table shows ``--limit`` of them; a rank
    the run lacks is a one-line error."""
    nsys = (
        ROOT
        / "tests"
        / "data"
        / "traces"
        / "nsys_h100x2_fastvideo_nvtx_aten__nsys-ai_h100_2gpu_1s.sqlite"
    )
    p = cli("timeline", nsys, "--limit", "5")
    assert p.returncode == 0, p.stderr
    out = " ".join(p.stdout.split())
    assert "rank 0 (of 2)" in out and "1716 more rows not shown" in out
    assert "1721 kernels: span" in out
    js = json.loads(cli("timeline", nsys, "--rank", "1", "--json").stdout)
    assert js[0]["rank"] == 1 and js[0]["summary"]["kernels"] == len(js[0]["kernels"]) > 0
    e = cli("timeline", nsys, "--rank", "5")
    assert e.returncode == 2 and "no rank 5 (ranks [0, 1])" in e.stderr


def test_first_ending_shares_corners(monkeypatch):
    """A small synthetic case for the exact corners (not a trace): a PDL-style chain (each
    interval resident before the one before it ends), a bubble, an interval inside another, a
    zero-length one and two with the same end (the lower index owns the tie). The heap sweep
    (over ``_DENSE_MAX`` intervals) gives the matrix's shares on 3,000 random intervals."""
    start = np.array([0, 5, 8, 30, 32, 34, 40, 40])
    end = np.array([10, 20, 25, 50, 36, 34, 50, 45])
    share = metrics.first_ending_shares(start, end)
    # 0-10 the first; 10-20 the second; 20-25 the third; 25-30 a bubble; 30-32 the fourth;
    # 32-36 the one inside it; 36-40 the fourth; 40-45 the last (ends first); 45-50 the fourth
    # and the seventh tie at 50: the fourth (lower index)
    assert share.tolist() == [10, 10, 5, 11, 4, 0, 0, 5]
    assert share.sum() == 45  # the union: 0-25 and 30-50
    rng = np.random.default_rng(0)
    s = rng.integers(0, 100_000, 3000)
    e = s + rng.integers(0, 500, 3000)
    sweep = metrics.first_ending_shares(s, e)
    monkeypatch.setattr(metrics, "_DENSE_MAX", 10_000)
    assert np.array_equal(sweep, metrics.first_ending_shares(s, e))
    assert metrics.first_ending_shares(np.array([]), np.array([])).size == 0


def test_kernel_shares_add_up_to_the_layer_share(spec):
    """The KDA layer of the specialized step (its first kernel resident ~5 us before the dense
    layer before it ends): each kernel's share from that end on; the shares sum to the layer
    share ``metrics.layer_steps`` measures for the step (no bubbles in it), the first kernel's
    share is its time after the previous layer's end, and every later kernel of the PDL chain
    adds its end minus the end before it."""
    k = spec.kernels
    step = tl.median_step(k, 1)
    t = tl.layer_timeline(k, 1, step)
    m = tl.summary(t)
    ls = metrics.layer_steps(k)
    row = ls.filter(pc.and_(pc.equal(ls["layer"], 1), pc.equal(ls["step"], step))).to_pylist()[0]
    assert m["idle_us"] == pytest.approx(0, abs=1e-6)
    assert m["shares_us"] == pytest.approx(row["share_us"], abs=1e-3)
    assert row["share_us"] < row["span_us"] - 1  # resident early: the share is shorter
    ends = t["end_us"].to_pylist()
    shares = t["share_us"].to_pylist()
    prev = tl.previous_layer_end(k, 1, step)
    t0 = int(pc.min(tl.select(k, 1, step)["start_ns"]).as_py())
    assert shares[0] == pytest.approx(ends[0] - (prev - t0) / 1e3, abs=1e-3)
    for i in range(1, len(ends)):
        assert shares[i] == pytest.approx(max(0.0, ends[i] - max(ends[:i])), abs=1e-3)
    assert tl.previous_layer_end(k, 0, step) is None  # the step's first layer


def test_cli_timeline_prints_the_shares():
    p = cli("timeline", SPEC, "--layer", "2")
    assert p.returncode == 0, p.stderr
    out = " ".join(p.stdout.split())
    assert "share us" in out and ", shares " in out
    js = json.loads(cli("timeline", SPEC, "--layer", "2", "--json").stdout)
    rows = js[0]["kernels"]
    assert all("share_us" in r for r in rows)
    assert js[0]["summary"]["shares_us"] == pytest.approx(sum(r["share_us"] for r in rows))
