"""Tables on a terminal of 120 columns (``ui/render.py``'s :class:`Fitted`): every number whole,
on one line, never cut to "…" or folded over two lines; names keep room; where a table cannot
fit, its columns split over tables that repeat the key columns. On the committed H200 runs and
a real Kineto trace; the formatting of whole microseconds on a real Kineto trace too."""

from __future__ import annotations

import json
import re
from pathlib import Path

from cli_helpers import cli
from rich.console import Console
from rich.table import Table

from decodescope.ui.render import Fitted, fit_tables, fmt

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
STD = f"{RESULTS}@standard-20261203T154918-db07da"
SPEC = f"{RESULTS}@specialized-20261203T154926-8e01fd"
TRACES = ROOT / "tests" / "data" / "traces"
B200 = TRACES / "kineto_b200_vllm_tp8_rank0_prefill_eager__TraceLens.json.gz"
WIDTH = 120


def _lines(text: str) -> list[str]:
    return [ln.rstrip() for ln in text.splitlines()]


def _cells(text: str) -> list[str]:
    """Every table cell's text, one per row line."""
    return [c.strip() for ln in _lines(text) if ln.startswith("│") for c in ln.split("│")[1:-1]]


def _assert_fits(text: str) -> None:
    """Every table line within the width (a line of prose wraps on the terminal by itself)."""
    lines = _lines(text)
    too_wide = [ln for ln in lines if ln[:1] in set("┏┃┡│└") and len(ln) > WIDTH]
    assert not too_wide, too_wide[:2]
    assert not any("…" in ln for ln in lines), [ln for ln in lines if "…" in ln][:2]


def test_compare_at_120_columns_keeps_every_number_whole():
    """``compare`` of the TP16 batch-1 pair: each figure of the per-layer-kind table (19 columns,
    about 210 wide) is a whole cell; the table splits in two, each part keeping the kind column
    and a metric's A, B and delta columns together."""
    p = cli("compare", STD, SPEC, width=WIDTH)
    assert p.returncode == 0, p.stderr
    _assert_fits(p.stdout)
    cells = set(_cells(p.stdout))
    data = json.loads(cli("compare", STD, SPEC, "--json").stdout)
    cols = ["a_span_us", "b_span_us", "span_us_delta", "a_share_us", "b_busy_us",
            "gaps_us_delta", "ratio"]  # fmt: skip
    for row in data["kinds"]:
        for c in cols:
            assert fmt(row[c], c) in cells, (row["layer_kind"], c, fmt(row[c], c))
    assert "per layer kind (ratio = A span / B span: speedup of B) (continued)" in p.stdout
    heads = [ln for ln in _lines(p.stdout) if ln.startswith("┃")]
    assert any("A busy us" in h and "B busy us" in h and "Δ busy us" in h for h in heads)


def test_demo_at_120_columns_cuts_no_number():
    """``demo`` (``make demo``): the reference-style tables printed to 120 columns, no "1,07…"."""
    p = cli("demo", width=WIDTH)
    assert p.returncode == 0, p.stderr
    _assert_fits(p.stdout)
    cells = _cells(p.stdout)
    assert "1,072.8" in cells and "2,644.6" in cells
    assert all(not re.fullmatch(r"[\d.,]+[.,]", c) for c in cells)  # no number folded after a dot


def test_report_at_120_columns_keeps_op_names_whole():
    """``report``: the op column gets room before the numbers' headers (a fused op's name reads
    on one line instead of folding into eleven-character pieces)."""
    p = cli("report", SPEC, width=WIDTH)
    assert p.returncode == 0, p.stderr
    _assert_fits(p.stdout)
    assert "conv1d+kda_recurrence+gated_norm" in _cells(p.stdout)


def test_timeline_at_120_columns_draws_whole_bars():
    """``timeline``: the text bar is never folded; by default it takes what the terminal leaves
    (here fewer than 40 characters), each bar on its kernel's first row line."""
    p = cli("timeline", STD, SPEC, "--layer", "1", width=WIDTH)
    assert p.returncode == 0, p.stderr
    _assert_fits(p.stdout)
    bars = [c for c in _cells(p.stdout) if c and set(c) <= {"·", "█"}]
    assert len(bars) >= 20
    assert len({len(b) for b in bars}) == 1 and 10 <= len(bars[0]) < 40
    wide = cli("timeline", STD, "--layer", "1", "--width", "40")  # asked for: kept
    assert any(len(c) == 40 for c in _cells(wide.stdout) if c and set(c) <= {"·", "█"})


def test_a_table_that_fits_is_printed_as_it_is():
    """Synthetic (the exact corner: a table narrower than the console is the same object)."""
    t = Table("kind", "span us")
    t.add_row("kda", "161.0")
    console = Console(width=WIDTH)
    assert fit_tables(t, WIDTH, console) == [t]
    with console.capture() as cap:
        console.print(Fitted(t))
    assert "161.0" in cap.get()


def test_report_of_a_kineto_trace_at_120_columns():
    """``report`` of vLLM's B200 trace: the kernel table's long CUTLASS names fold, its figures
    and short names stay whole."""
    p = cli("report", B200, width=WIDTH)
    assert p.returncode == 0, p.stderr
    _assert_fits(p.stdout)
    cells = _cells(p.stdout)
    assert "multimem_all_reduce_kernel" in cells and "fused_add_rms_norm_kernel" in cells
    assert "19.5%" in cells


def test_whole_microseconds_keep_their_decimals():
    """A Kineto trace has whole microseconds: a figure of 292 us reads "292.0" beside "305.7",
    not "292"; counts stay whole, waves keep two decimals."""
    assert fmt(292.0, "kernel_sum_us") == "292.0"
    assert fmt(0.0, "b_gaps_us") == "0.00"
    assert fmt(21.0, "kernels") == "21"
    assert fmt(1.0, "waves") == "1.00"
    p = cli("report", B200, width=WIDTH)
    assert p.returncode == 0, p.stderr
    _assert_fits(p.stdout)
    kernels_rows = [ln for ln in _lines(p.stdout) if ln.startswith("│ multimem_all_reduce_kernel")]
    assert kernels_rows and "2119.5" in kernels_rows[0]
    # no microsecond cell of the per-layer table is a bare integer
    layer_rows = [ln for ln in _lines(p.stdout) if re.match(r"│\s+0 │\s+\d+ │ layer", ln)]
    assert len(layer_rows) == 36
    for ln in layer_rows:
        us = [c.strip() for c in ln.split("│")[6:-1]]
        assert all("." in c for c in us), ln
