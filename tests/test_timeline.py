"""``decodescope timeline`` and :mod:`analysis.timeline` on the committed H200 runs (both paths,
TP16 batch 1, session 27) and a real Kineto trace."""

from __future__ import annotations

import json
from pathlib import Path

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
    assert "A: standard-20261203T154918-db07da, layer 1, step 14 (of 30)" in out
    assert "B: specialized-20261203T154926-8e01fd, layer 1, step 14 (of 30)" in out
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
    for args, msg in (
        (["--layer", "99"], "no kernels of layer 99 (layers 0..2)"),
        (["--step", "999"], "no kernels in step 999 (steps 0..29)"),
    ):
        e = cli("timeline", SPEC, *args)
        lines = [x for x in e.stderr.splitlines() if x.strip()]
        assert e.returncode == 2 and len(lines) == 1, e.stderr
        assert "specialized-20261203T154926-8e01fd" in lines[0] and msg in lines[0]


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
