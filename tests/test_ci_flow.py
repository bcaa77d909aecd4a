"""The regression-tracking flow as a CI job meets it (export -> query -> check), on the committed
H200 runs (``data/runs/``, ``results/``): setup mismatches refused, damaged datasets named in one
line, exports all or nothing."""

from __future__ import annotations

from pathlib import Path

from cli_helpers import Result, cli

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
TOY_EAGER = ROOT / "data" / "runs" / "h200_toy_eager"
TOY_GRAPH = ROOT / "data" / "runs" / "h200_toy_graph"
SPEC = f"{RESULTS}@specialized-20261204T182135-c142af"  # TP8 batch 1, 8 tokens per sequence
STD = f"{RESULTS}@standard-20261130T142546-9b7df6"  # TP8 batch 1, 1 token per sequence


def one_line_error(p: Result) -> str:
    assert p.returncode == 2, p.stdout + p.stderr
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, p.stderr
    assert "Traceback" not in p.stderr
    return lines[0]


def listing(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*")) if d.exists() else []


def test_query_names_a_corrupt_parquet_file(tmp_path):
    """A real results run exported to a fresh dataset, then one of its files truncated: ``query``
    used to end in DuckDB's traceback; now one line naming the file."""
    ds = tmp_path / "ds"
    assert cli("export", SPEC, "--to", ds).returncode == 0
    assert cli("query", ds, "SELECT count(*) FROM kernels").returncode == 0
    (f,) = (ds / "kernels").rglob("*.parquet")
    f.write_bytes(f.read_bytes()[:1000])
    line = one_line_error(cli("query", ds, "SELECT count(*) FROM runs"))
    assert str(f) in line and "not a readable Parquet file" in line
    f.write_bytes(b"")
    assert str(f) in one_line_error(cli("query", ds, "SELECT 1"))
