"""The regression-tracking flow as a CI job meets it (export -> query -> check), on the committed
H200 runs (``data/runs/``, ``results/``): setup mismatches refused, damaged datasets named in one
line, exports all or nothing."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from cli_helpers import Result, cli

from decodescope import tracer
from decodescope.tracer import dataset as tds

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


def test_export_replace_moves_a_run_whose_partition_changed(tmp_path):
    """The real toy run exported, then again with --replace after its backend was relabelled:
    the old partition used to stay, leaving two rows of one run id (and doubled kernels under
    DATASET@RUN); now the run is replaced wherever it lay."""
    ds = tmp_path / "ds"
    assert cli("export", TOY_GRAPH, "--to", ds).returncode == 0
    run = tracer.load(TOY_GRAPH)
    relabelled = tracer.write_run(run.replace(meta=run.meta.replace(backend="standard")),
                                  tmp_path / "std")  # fmt: skip
    assert "already holds" in one_line_error(cli("export", relabelled, "--to", ds))
    assert cli("export", relabelled, "--to", ds, "--replace").returncode == 0
    q = json.loads(cli("query", ds, "SELECT run_id, backend FROM runs", "--json").stdout)
    assert q == [{"run_id": run.run_id, "backend": "standard"}]
    (back,) = tds.read_runs(ds)
    assert back.kernels.num_rows == run.kernels.num_rows
    assert not [p for p in ds.iterdir() if p.name.startswith(".")]
    assert not list(ds.rglob("backend=other"))  # the old partition folders are gone


@pytest.mark.skipif(os.name != "posix", reason="NAME_MAX of a POSIX file system")
def test_export_is_all_or_nothing(tmp_path):
    """The real toy runs exported together with a run whose id is too long for a folder name
    (DERIVED, 300 characters): the export used to end in a traceback with the runs before it left
    in the dataset; now one line naming the run, and the dataset is as it was (a new one is not
    made; a replaced run is back)."""
    run = tracer.load(TOY_GRAPH)
    long_id = tracer.write_run(run.replace(meta=run.meta.replace(run_id="r" * 300)),
                               tmp_path / "long")  # fmt: skip
    fresh = tmp_path / "fresh"
    line = one_line_error(cli("export", TOY_EAGER, long_id, "--to", fresh))
    assert f"cannot append run {'r' * 300}" in line and "nothing was exported" in line
    assert not fresh.exists()
    ds = tmp_path / "ds"
    assert cli("export", TOY_EAGER, TOY_GRAPH, "--to", ds).returncode == 0
    before = listing(ds)
    one_line_error(cli("export", TOY_GRAPH, long_id, "--to", ds, "--replace"))
    assert listing(ds) == before
    assert {r.run_id for r in tds.read_runs(ds)} == {
        tracer.load(TOY_EAGER).run_id,
        run.run_id,
    }


def test_a_failed_replace_puts_the_old_run_back(tmp_path, monkeypatch):
    """SYNTHETIC failure (the Parquet writer fails half-way) while replacing the real toy run:
    the run it was replacing used to be deleted first and lost; now it is back as it was."""
    ds = tmp_path / "ds"
    run = tracer.load(TOY_GRAPH)
    tds.append_run(run, ds)
    before = listing(ds)
    real, calls = tds.pq.write_table, {"n": 0}

    def failing(table, where, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("disk full")
        return real(table, where, **kw)

    monkeypatch.setattr(tds.pq, "write_table", failing)
    with pytest.raises(OSError, match="disk full"):
        tds.append_run(run.replace(meta=run.meta.replace(backend="standard")), ds, replace=True)
    monkeypatch.undo()
    assert listing(ds) == before
    (back,) = tds.read_runs(ds)
    assert back.meta.backend == run.meta.backend and back.kernels.num_rows == run.kernels.num_rows
