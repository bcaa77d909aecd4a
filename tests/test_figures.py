"""The dashboard's figure functions (ui/figures.py) on real runs: the bundled default runs (real
Kineto traces from an H100 and a B200, imported) and a real nsys export of two H100s."""

from __future__ import annotations

import io
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from decodescope import tracer
from decodescope.analysis import compare, metrics
from decodescope.ui import figures

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "ui" / "data" / "default"
H100 = DEFAULT / "h100_hf_qwen1.5-0.5b_eager"
B200 = DEFAULT / "b200_vllm_gpt-oss_tp8_prefill"
NSYS_2GPU = ROOT / "tests/data/traces/nsys_h100x2_fastvideo_nvtx_aten__nsys-ai_h100_2gpu_1s.sqlite"


@pytest.fixture(scope="module")
def runs():
    return tracer.load(H100), tracer.load(B200)


def _bars(fig) -> list:
    return [t for t in fig.data if t.type == "bar"]


def test_headline_reads_like_the_reference_figure(runs):
    a, b = runs
    lines = figures.headline(metrics.kind_table(a.kernels), metrics.kind_table(b.kernels))
    # HF Qwen1.5-0.5B on the H100: 42 kernels a layer; vLLM gpt-oss on the B200: 21
    assert len(lines) == 1
    assert lines[0].startswith("Layer: 42 kernels / ")
    assert " us vs 21 / " in lines[0]
    assert lines[0].endswith("x)")


def test_headline_names_kda_and_mla_layers():
    kinds = pa.table(
        {"layer_kind": ["kda", "mla"], "kernels": [23.0, 26.0], "span_us": [130.2, 150.0]}
    )
    spec = pa.table({"layer_kind": ["kda"], "kernels": [13.0], "span_us": [69.4]})
    lines = figures.headline(kinds, spec)
    assert lines[0] == "KDA layer: 23 kernels / 130 us vs 13 / 69 us (1.88x)"
    assert lines[1] == "MLA layer: 26 kernels / 150 us vs none in B"
    assert figures.headline(spec) == ["KDA layer: 13 kernels / 69 us"]


def test_layer_bars_put_a_beside_b_for_every_layer(runs):
    a, b = runs
    fig = figures.layer_bars(
        metrics.layer_table(a.kernels), metrics.layer_table(b.kernels), ("HF", "vLLM")
    )
    bars = _bars(fig)
    # two metrics (kernels, span) x two sides
    assert [t.name for t in bars] == ["HF", "vLLM", "HF", "vLLM"]
    assert len(bars[0].y) == 24 and len(bars[1].y) == 36  # Qwen1.5-0.5B: 24 layers; gpt-oss: 36
    assert set(bars[0].y) == {42.0}
    # x is (layer kind, layer): the bars are grouped by kind
    kinds, layers = bars[1].x
    assert set(kinds) == {"layer"} and list(layers[:3]) == ["0", "1", "2"]
    # the span row carries min/max error bars from layer_table
    assert bars[2].error_y.array is not None
    assert fig.layout.barmode == "group"


def test_op_stack_sums_each_side_to_its_op_table(runs):
    a, b = runs
    oa, ob = metrics.op_table(a.kernels), metrics.op_table(b.kernels)
    fig = figures.op_stack(oa, ob, ("HF", "vLLM"), metric="kernels")
    bars = _bars(fig)
    assert fig.layout.barmode == "stack"
    per_side = {"HF": 0.0, "vLLM": 0.0}
    for t in bars:
        per_side[t.x[1][0]] += t.y[0]
    assert per_side["HF"] == pytest.approx(pc.sum(oa["kernels"]).as_py())
    assert per_side["vLLM"] == pytest.approx(pc.sum(ob["kernels"]).as_py())


def test_op_stack_marks_a_fused_op_and_what_it_swallowed(runs):
    # B's run with its two attention GEMM ops named as one fused op, the way the specialized
    # path names a fused kernel's range (DESIGN.md section 6)
    a, _ = runs
    oa = metrics.op_table(a.kernels)
    ob = metrics.op_table(a.kernels)
    fused = pc.if_else(pc.equal(ob["op"], "Linear"), pa.scalar("Linear+Qwen2Attention"), ob["op"])
    ob = ob.set_column(ob.schema.get_field_index("op"), "op", fused)
    cov = pa.table({"b_op": ["Linear+Qwen2Attention"], "covers": [["Linear", "Qwen2Attention"]]})
    fig = figures.op_stack(oa, ob, coverage=cov)
    hatched = [t for t in _bars(fig) if t.marker.pattern.shape == "/"]
    assert hatched and all("covers Linear, Qwen2Attention" in t.hovertemplate for t in hatched)
    # the fused op keeps the colour of its first op
    plain = next(t for t in _bars(fig) if t.name == "attn.Linear")
    assert hatched[0].marker.color == plain.marker.color


def test_timeline_of_one_layer_shares_the_time_axis(runs):
    a, b = runs

    def step_of(run, layer):
        return pc.min(run.kernels.filter(pc.equal(run.kernels["layer"], layer))["step"]).as_py()

    fig = figures.timeline(a.kernels, b.kernels, layer=3, step=step_of(a, 3), step_b=step_of(b, 3))
    bars = _bars(fig)
    assert [t.name for t in bars] == ["A", "B"]
    assert len(bars[1].x) == 21  # gpt-oss layer 3 on the B200
    assert min(bars[1].base) == 0.0
    ta = bars[0]
    assert len(ta.x) == 42  # every kernel of layer 3 in the HF run
    assert min(ta.base) == 0.0  # relative to the layer's first kernel start
    assert all(d > 0 for d in ta.x)
    # hover shows name, grid, block, registers and duration
    for field in ("grid", "block", "registers", "duration"):
        assert field in ta.hovertemplate
    name, op, grid, block, regs, dur, _ = ta.customdata[0]
    assert name and grid.startswith("(") and block.startswith("(") and regs != "-"
    assert float(dur) == pytest.approx(ta.x[0], abs=0.01)


def test_timeline_without_a_layer_draws_the_whole_step():
    run = tracer.load(NSYS_2GPU)  # aten NVTX ranges only: no layer is attributed
    assert run.kernels["layer"].null_count == run.kernels.num_rows
    k = run.kernels.filter(pc.equal(run.kernels["rank"], 0))
    fig = figures.timeline(k, None, layer=None, step=pc.min(k["step"]).as_py())
    assert len(_bars(fig)[0].x) == k.filter(pc.equal(k["step"], pc.min(k["step"]))).num_rows
    empty = figures.layer_bars(metrics.layer_table(k), None)
    assert "no layers" in empty.layout.annotations[0].text


def test_history_marks_baseline_and_regressions(runs):
    a, b = runs
    rows = []
    for i, run in enumerate((a, b, a)):
        kt = metrics.kind_table(run.kernels).to_pylist()[0]
        rows.append(
            {
                "run_id": f"r{i}",
                "created_at": f"2026-11-{10 + i}",
                "git_commit": f"c{i}",
                "backend": "standard",
                "layer_kind": kt["layer_kind"],
                "span_us": kt["span_us"],
            }
        )
    fig = figures.history(pa.Table.from_pylist(rows), "span_us", baseline="r0", regressions=["r1"])
    names = [t.name for t in fig.data]
    assert names == ["standard · layer", "baseline", "regression"]
    assert list(fig.data[2].x) == ["2026-11-11"]
    assert fig.layout.shapes  # the baseline's level as a dotted line


def test_side_by_side_tables_download_as_csv_and_parquet(runs):
    a, b = runs
    layers = compare.compare_layers(a.kernels, b.kernels)
    csv = figures.table_bytes(layers, "csv").decode()
    assert csv.splitlines()[0].startswith("rank,layer,layer_kind")
    assert len(csv.splitlines()) == layers.num_rows + 1
    back = pq.read_table(io.BytesIO(figures.table_bytes(layers, "parquet")))
    assert back.num_rows == layers.num_rows and back.column_names == layers.column_names


def test_chart_exports_to_html(runs):
    a, b = runs
    html = figures.to_html(figures.layer_bars(metrics.layer_table(a.kernels), None))
    assert "<html>" in html[:100] and "plotly" in html and len(html) > 1_000_000  # js inlined


@pytest.mark.browser
def test_chart_exports_to_png_through_kaleido(runs):
    # kaleido drives the system Chromium headless (scripts/install_browser.sh installs it);
    # kaleido is not yet a declared dependency: skipped, with this reason, where it is missing
    pytest.importorskip("kaleido", reason="kaleido (PNG export) is not installed")
    a, b = runs
    png = figures.to_png(
        figures.layer_bars(metrics.layer_table(a.kernels), metrics.layer_table(b.kernels)),
        width=800,
    )
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
