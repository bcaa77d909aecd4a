"""Records an importer does not take are counted and said: a kernel that ends before it starts
is dropped from a Kineto trace and from an Nsight Systems export alike (it would count as a
negative busy time), kept as a ``skipped_events`` row with its reason; ``import`` names the
count and the reasons on stderr, ``report`` lists each reason in its overheads table.

The bad records are made in real traces (the H100 Qwen Kineto trace, the GTX 1060 nsys export):
a real trace carries none, which the last test checks on every one of them."""

from __future__ import annotations

import gzip
import json
import shutil
import sqlite3
from pathlib import Path

import pyarrow.compute as pc
import pytest
from cli_helpers import cli

from decodescope import tracer

TRACES = Path(__file__).parent / "data" / "traces"
HF_QWEN = TRACES / "kineto_h100_qwen1.5-0.5b_hf_eager__TraceLens.json.gz"
NSYS = TRACES / "nsys_gtx1060_schema2.9.1_nvtx_nested__extrap_profile16.sqlite"
REASON = "kernel: ends before it starts (negative duration)"


@pytest.fixture
def kineto_backwards(tmp_path: Path) -> Path:
    """The Qwen trace with two kernels of negative duration."""
    trace = json.loads(gzip.decompress(HF_QWEN.read_bytes()))
    kernels = [e for e in trace["traceEvents"] if e.get("cat") == "kernel"]
    for e in kernels[:2]:
        e["dur"] = -5
    p = tmp_path / "backwards.json"
    p.write_text(json.dumps(trace))
    return p


@pytest.fixture
def nsys_backwards(tmp_path: Path) -> Path:
    """The GTX 1060 export with one kernel ending 5 ns before it starts."""
    p = tmp_path / "backwards.sqlite"
    shutil.copy(NSYS, p)
    con = sqlite3.connect(p)
    (rowid,) = con.execute("SELECT rowid FROM CUPTI_ACTIVITY_KIND_KERNEL LIMIT 1").fetchone()
    con.execute('UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET "end" = start - 5 WHERE rowid = ?', (rowid,))
    con.commit()
    con.close()
    return p


def _skipped(run: tracer.Run) -> dict[str, int]:
    return {r["detail"]: r["count"] for r in run.overheads.to_pylist()
            if r["kind"] == "skipped_events"}  # fmt: skip


@pytest.mark.parametrize(("which", "kernels", "dropped"), [("kineto", 1465, 2), ("nsys", 12, 1)])
def test_a_kernel_ending_before_it_starts_is_dropped_and_counted(
    which: str, kernels: int, dropped: int, request: pytest.FixtureRequest
) -> None:
    path = request.getfixturevalue(f"{which}_backwards")
    run = tracer.load(path)
    k = run.kernels
    assert k.num_rows == kernels - dropped
    assert int(pc.sum(pc.less(k["end_ns"], k["start_ns"])).as_py() or 0) == 0
    assert _skipped(run) == {REASON: dropped}
    assert run.meta.dropped_records == dropped


def test_import_says_what_it_did_not_import(kineto_backwards: Path, tmp_path: Path) -> None:
    """One note on stderr with the count and the reason; the run is written (exit 0)."""
    out = tmp_path / "run"
    p = cli("import", kineto_backwards, "--out", out)
    assert p.returncode == 0, p.stderr
    assert "1463 kernels" in p.stdout
    note = " ".join(p.stderr.split())
    assert f"2 record(s) of {kineto_backwards} not imported (2 {REASON})" in note
    assert f"decodescope report {out}" in note


def test_report_lists_each_reason(tmp_path: Path) -> None:
    """A trace with kernels of a bad timestamp and an unknown category: the overheads table
    (and its JSON) give one row per reason, not just "skipped_events 8"."""
    trace = json.loads(gzip.decompress(HF_QWEN.read_bytes()))
    kernels = [e for e in trace["traceEvents"] if e.get("cat") == "kernel"]
    for e in kernels[:3]:
        e["ts"] = "abc"
    trace["traceEvents"].append(
        {"ph": "X", "cat": "weird_cat", "name": "x", "ts": 1, "dur": 1, "pid": 0, "tid": 0}
    )
    src = tmp_path / "mixed.json"
    src.write_text(json.dumps(trace))
    p = cli("report", src)
    assert p.returncode == 0, p.stderr
    rows = [" ".join(ln.replace("│", " ").split()) for ln in p.stdout.splitlines()]
    assert "skipped_events kernel: bad ts or dur 1 3" in rows
    assert "unknown_category events of category 'weird_cat' not imported 1 1" in rows
    js = json.loads(cli("report", src, "--json").stdout)
    assert {"kind": "skipped_events", "detail": "kernel: bad ts or dur", "records": 1,
            "count": 3} in js["run"]["overheads"]  # fmt: skip


def test_real_traces_import_without_a_note(tmp_path: Path) -> None:
    """Every real trace imports whole: no record skipped, no note."""
    traces = sorted(TRACES.glob("*.json.gz")) + sorted(TRACES.glob("*.sqlite"))
    assert len(traces) == 8
    for i, t in enumerate(traces):
        p = cli("import", t, "--out", tmp_path / str(i))
        assert p.returncode == 0 and "not imported" not in p.stderr, (t.name, p.stderr)
        assert REASON not in _skipped(tracer.load(t)), t.name
