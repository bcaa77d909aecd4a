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


def test_check_refuses_a_baseline_run_of_another_backend():
    """A specialized run against a standard run (real H200 runs): that was checked silently (the
    specialized path is faster, so "ok"); now it is refused in one line naming each field that
    differs, exit 2. ``--allow-setup-mismatch`` compares anyway and says so in the notes."""
    line = one_line_error(cli("check", SPEC, "--baseline", STD, "--max-regression", "5"))
    assert "ran another setup" in line and "backend: run specialized, baseline standard" in line
    assert "tokens_per_seq: run 8, baseline 1" in line and "--allow-setup-mismatch" in line
    p = cli("check", SPEC, "--baseline", STD, "--max-regression", "5", "--json",
            "--allow-setup-mismatch")  # fmt: skip
    assert p.returncode == 1, p.stdout + p.stderr
    notes = json.loads(p.stdout)["setup_notes"]
    assert any("tokens_per_seq" in n for n in notes)
    assert any(n.startswith("different setups") and "backend: run specialized" in n for n in notes)


def test_check_json_keeps_every_setup_note(tmp_path):
    """DERIVED from the real toy graph run: the same kernels recorded as another GPU and batch.
    With --allow-setup-mismatch the JSON used to carry the first note only (the GPU line was
    dropped); ``setup_notes`` holds both, as the text output does."""
    run = tracer.load(TOY_GRAPH)
    other = tracer.write_run(
        run.replace(meta=run.meta.replace(run_id="toy-h100", gpu="NVIDIA H100", batch=8)),
        tmp_path / "other",
    )
    line = one_line_error(cli("check", TOY_GRAPH, "--baseline", other, "--max-regression", "5"))
    assert "batch: run 1, baseline 8" in line
    assert "gpu: run NVIDIA H200, baseline NVIDIA H100" in line
    p = cli("check", TOY_GRAPH, "--baseline", other, "--max-regression", "5", "--json",
            "--allow-setup-mismatch")  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    notes = json.loads(p.stdout)["setup_notes"]
    assert len(notes) == 2 and notes[0].startswith("different step shapes")
    assert notes[1].startswith("different GPUs")
    text = cli("check", TOY_GRAPH, "--baseline", other, "--max-regression", "5",
               "--allow-setup-mismatch").stdout  # fmt: skip
    assert "different GPUs" in text and "different step shapes" in text


def test_an_eager_run_is_no_baseline_of_a_graph_run(tmp_path):
    """The real toy runs (H200, same workload and shapes, eager vs CUDA graph: layer spans 5x
    apart): the eager run in a dataset served as the graph run's baseline (a 80% "speed-up",
    ok); graph_mode is now part of the setup, so the dataset has no baseline for it and the eager
    run alone is refused."""
    ds = tmp_path / "ds"
    assert cli("export", TOY_EAGER, "--to", ds).returncode == 0
    line = one_line_error(cli("check", TOY_GRAPH, "--baseline", ds, "--max-regression", "5"))
    assert "no baseline run" in line and "graph_mode=graph" in line
    line = one_line_error(cli("check", TOY_GRAPH, "--baseline", TOY_EAGER, "--max-regression", "5"))
    assert "graph_mode: run graph, baseline eager" in line
    # a graph run of the same setup in the dataset is its baseline
    g2 = tracer.load(TOY_GRAPH)
    g2 = tracer.write_run(g2.replace(meta=g2.meta.replace(run_id="toy-graph-2")), tmp_path / "g2")
    assert cli("export", g2, "--to", ds).returncode == 0
    p = cli("check", TOY_GRAPH, "--baseline", ds, "--max-regression", "0")
    assert p.returncode == 0, p.stdout + p.stderr


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


def test_check_names_a_baseline_run_without_kernels(tmp_path):
    """DERIVED: two copies of the real toy graph run in a dataset, one of them with its kernels
    partition deleted. The check used to take the other alone while saying "2 run(s)"; now one
    line naming the run."""
    ds = tmp_path / "ds"
    run = tracer.load(TOY_GRAPH)
    for rid in ("g-1", "g-2"):
        tds.append_run(run.replace(meta=run.meta.replace(run_id=rid)), ds)
    (part,) = [p for p in (ds / "kernels").rglob("run_id=g-2")]
    for f in part.iterdir():
        f.unlink()
    part.rmdir()
    line = one_line_error(cli("check", TOY_GRAPH, "--baseline", ds, "--max-regression", "5"))
    assert "baseline run g-2 has no kernel rows" in line


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


def test_compare_says_when_one_side_ran_eager():
    """The real toy runs, eager (A) vs CUDA graph (B): ``compare`` reported "B is 5.24x faster"
    with no word of the graph modes; it now says so, in the tables and in the JSON."""
    p = cli("compare", TOY_EAGER, TOY_GRAPH)
    assert p.returncode == 0, p.stderr
    assert "different graph modes (ratios include launch overhead): A eager; B graph" in p.stdout
    js = json.loads(cli("compare", TOY_EAGER, TOY_GRAPH, "--json").stdout)
    assert any("graph modes" in ln for ln in js["shapes_differ"])
    assert json.loads(cli("compare", TOY_GRAPH, TOY_GRAPH, "--json").stdout)["shapes_differ"] == []


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


def test_check_refuses_partial_runs(tmp_path):
    """DERIVED: the real toy graph run marked partial (as a capture that crashed or hung is
    written). It used to be checked (and pass) as the run or as its baseline; now a partial run
    is refused in one line, and a dataset's partial runs are left out of its baseline, said."""
    run = tracer.load(TOY_GRAPH)
    part = tracer.write_run(run.replace(meta=run.meta.replace(run_id="toy-partial", partial=True)),
                            tmp_path / "partial")  # fmt: skip
    line = one_line_error(cli("check", part, "--baseline", TOY_GRAPH, "--max-regression", "5"))
    assert "run toy-partial is partial" in line
    line = one_line_error(cli("check", TOY_GRAPH, "--baseline", part, "--max-regression", "5"))
    assert "baseline run toy-partial is partial" in line
    ds = tmp_path / "ds"
    assert cli("export", part, "--to", ds).returncode == 0
    line = one_line_error(cli("check", TOY_GRAPH, "--baseline", ds, "--max-regression", "5"))
    assert "no baseline run" in line and "1 partial run(s) of that setup left out" in line
    other = tracer.write_run(run.replace(meta=run.meta.replace(run_id="toy-2")), tmp_path / "t2")
    assert cli("export", other, "--to", ds).returncode == 0
    p = cli("check", TOY_GRAPH, "--baseline", ds, "--max-regression", "5", "--json")
    assert p.returncode == 0, p.stdout + p.stderr
    assert json.loads(p.stdout)["baseline"].endswith("1 partial run(s) of the setup left out")


def test_check_last_takes_the_newest_runs_of_the_setup():
    """``--last N`` against the real results dataset: the TP8 batch-1 (1+7 tokens) specialized
    run is checked against the N newest other runs of its setup only (the whole history by
    default); the baseline line says how many of how many. ``--last`` with one baseline run is
    a one-line error."""
    p = cli("check", SPEC, "--baseline", str(RESULTS), "--max-regression", "50", "--json")
    assert p.returncode in (0, 1), p.stdout + p.stderr
    everything = json.loads(p.stdout)["baseline"]
    n_all = int(everything.split("(", 1)[1].split(" run(s)", 1)[0])
    assert n_all > 2
    p = cli("check", SPEC, "--baseline", str(RESULTS), "--max-regression", "50", "--json",
            "--last", "2")  # fmt: skip
    assert p.returncode in (0, 1), p.stdout + p.stderr
    origin = json.loads(p.stdout)["baseline"]
    assert (
        origin.startswith(f"dataset {RESULTS} (2 run(s) ") and f"the 2 newest of {n_all}" in origin
    )
    p = cli("check", SPEC, "--baseline", str(RESULTS), "--max-regression", "50", "--json",
            "--last", str(n_all + 5))  # fmt: skip
    assert json.loads(p.stdout)["baseline"] == everything  # more than there are: all of them
    line = one_line_error(cli("check", SPEC, "--baseline", STD, "--max-regression", "5",
                              "--last", "2"))  # fmt: skip
    assert "--last chooses among a dataset's runs" in line
