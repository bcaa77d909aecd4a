"""The committed H200 results dataset (results/, written by `decodescope bench` on the H200):
the bench table, the projection and `decodescope check` against it, on the real runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from decodescope.analysis.metrics import kind_table
from decodescope.analysis.projection import K3_LAYER_MIX
from decodescope.tracer import write_run
from decodescope.tracer.dataset import read_runs
from decodescope.ui import cmd_bench

RESULTS = Path(__file__).resolve().parent.parent / "results"


@pytest.fixture(scope="module")
def runs():
    rs = read_runs(RESULTS)
    assert rs, "no runs in results/"
    return rs


def _kinds(run):
    return set(kind_table(run.kernels)["layer_kind"].to_pylist())


def _newest(runs, backend, tp, batch, tp_world=1, dense=None):
    """The newest one-token run of a setup; ``dense``: only runs with (True) or without (False)
    a measured dense layer 0 (the runs before the dense layer was benched have none)."""
    c = [
        r
        for r in runs
        if (r.meta.backend, r.meta.tp_shape, r.meta.batch) == (backend, tp, batch)
        and (r.meta.tokens_per_seq or 1) == 1
        and (r.meta.tp_world or 1) == tp_world
        and (dense is None or ("dense" in _kinds(r)) == dense)
    ]
    return max(c, key=lambda r: str(r.meta.created_at))


def test_every_run_is_a_real_h200_capture_with_both_layer_kinds(runs):
    for r in runs:
        m = r.meta
        assert m.source == "cupti" and m.gpu == "NVIDIA H200" and m.graph_mode == "graph"
        assert m.backend in ("standard", "specialized") and m.preset == "kimi-k3"
        assert m.tp_world in (1, 2) and m.tp_shape in (8, 16)
        assert m.git_commit and m.layer_bytes and set(m.layer_bytes) >= {"kda", "mla"}
        kt = kind_table(r.kernels)
        kinds = set(kt["layer_kind"].to_pylist())
        assert kinds in ({"kda", "mla"}, {"dense", "kda", "mla"})
        assert kinds <= set(m.layer_bytes)
        ranks = set(pc.unique(pc.fill_null(r.kernels["rank"], 0)).to_pylist())
        assert ranks == set(range(m.tp_world))  # one capture per GPU, merged
        assert min(kt["steps"].to_pylist()) >= 20  # medians over at least 20 replays


def test_bench_rows_and_projection_are_the_layer_mix_sum(runs):
    # a run of the layers "dense,kda,mla": the measured dense layer 0 is summed once
    new = _newest(runs, "standard", 8, 1, dense=True)
    rows = cmd_bench.kind_rows(new, "standard", 1, 1)
    spans = {r["layer_kind"]: r["span_us"] for r in rows}
    (p,) = cmd_bench.projections(rows, 6.0)
    assert p["step_us"] == pytest.approx(
        sum(K3_LAYER_MIX[k] * spans[k] for k in ("dense", "kda", "mla"))
    )
    assert p["dense_layer"] == "measured"
    # an earlier run of the layers "kda,mla"
    std = _newest(runs, "standard", 8, 1, dense=False)
    rows = cmd_bench.kind_rows(std, "standard", 1, 1)
    spans = {r["layer_kind"]: r["span_us"] for r in rows}
    (p,) = cmd_bench.projections(rows, 6.0)
    assert p["step_us"] == pytest.approx(
        K3_LAYER_MIX["kda"] * spans["kda"] + K3_LAYER_MIX["mla"] * spans["mla"]
    )
    assert p["tok_s"] == pytest.approx(1 / (p["step_us"] * 1e-6))
    assert "dense" in p["label"] and "projection" in p["label"]
    # that run captured layers "kda,mla": the dense layer 0 is excluded, and said
    assert p["dense_layer"] == "excluded (not measured)"
    assert "excludes dense: not measured" in p["label"]
    for r in rows:
        if r["copy_bw_tbs"]:
            assert r["floor_us"] == pytest.approx(
                r["layer_bytes"] / (r["copy_bw_tbs"] * 1e12) * 1e6
            )


def test_share_efficiency_is_share_over_floor(runs):
    # the newest specialized TP8 batch-1 run: its first kernel waits early under PDL, so its
    # share of the step is below its span and so is share x floor against span x floor
    run = _newest(runs, "specialized", 8, 1, dense=True)
    rows = {r["layer_kind"]: r for r in cmd_bench.kind_rows(run, "specialized", 1, 1)}
    for r in rows.values():
        assert r["share_efficiency"] == pytest.approx(r["share_us"] / r["floor_us"])
        assert r["share_efficiency"] <= r["efficiency"] + 1e-9
    assert rows["kda"]["share_efficiency"] < rows["kda"]["efficiency"]


def test_specialized_path_launches_fewer_kernels(runs):
    for tp in (8, 16):
        for batch in (1, 8, 32, 64):
            std = kind_table(_newest(runs, "standard", tp, batch).kernels).to_pylist()
            spec = kind_table(_newest(runs, "specialized", tp, batch).kernels).to_pylist()
            s = {r["layer_kind"]: r["kernels"] for r in std}
            p = {r["layer_kind"]: r["kernels"] for r in spec}
            assert p["kda"] < s["kda"] and p["mla"] < s["mla"]


def _check(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "decodescope", "check", str(run_dir), "--baseline", str(RESULTS),
         "--max-regression", "5", *extra],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_check_against_the_dataset(runs, tmp_path):
    # the dataset never serves a run as its own baseline: check it under a new run id, as a
    # repeat capture that measured exactly the same would come
    orig = _newest(runs, "standard", 8, 1)
    run = orig.replace(meta=orig.meta.replace(run_id=orig.run_id + "-repeat"))
    same = write_run(run, tmp_path / "same")
    p = _check(same)
    assert p.returncode == 0, p.stdout + p.stderr
    # a derived run (stated): the same kernels, every duration 1.5x longer, starts spread so that
    # each layer's span grows too
    k = run.kernels
    start = pc.subtract(k["start_ns"], pc.min(k["start_ns"]))
    dur = pc.subtract(k["end_ns"], k["start_ns"])
    s2 = pc.add(pc.min(k["start_ns"]), pc.cast(pc.floor(pc.multiply(start, 1.5)), pa.int64()))
    e2 = pc.add(s2, pc.cast(pc.floor(pc.multiply(dur, 1.5)), pa.int64()))
    k2 = k.set_column(k.schema.get_field_index("start_ns"), "start_ns", s2)
    k2 = k2.set_column(k2.schema.get_field_index("end_ns"), "end_ns", e2)
    slow = write_run(run.replace(kernels=k2), tmp_path / "slow")
    p = _check(slow)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "regress" in (p.stdout + p.stderr).lower()


def test_baseline_matches_tokens_per_seq(runs):
    # the verify step (1+7 tokens per sequence) is never the baseline of a 1-token step
    import dataclasses

    from decodescope.analysis.dataset import select_baseline

    rows = [dataclasses.asdict(r.meta) for r in runs]
    one = _newest(runs, "standard", 8, 1)
    ids = select_baseline(rows, one.meta)
    assert ids, "no other run of the same setup"
    by_id = {r["run_id"]: r for r in rows}
    assert all(by_id[i]["tokens_per_seq"] == one.meta.tokens_per_seq for i in ids)


def test_bench_asks_for_the_dense_layer_and_says_when_a_run_lacks_it(runs, tmp_path, monkeypatch):
    """`decodescope bench` on a CPU, its capture replaced by the committed real runs: both
    backends are asked for layers "dense,kda,mla" (layer 0 dense first); the runs served here
    (earlier ones, of layers "kda,mla") hold no dense layer, so the projection says the dense
    layer is excluded, not measured."""
    import contextlib
    import io
    import json

    import decodescope.tracer.capture as cap
    from decodescope.ui import cli as cli_mod

    asked = []

    def fake_capture(spec, out, timeout, echo):
        asked.append(spec)
        o = spec["opts"]
        run = _newest(runs, spec["workload"], o["tp_shape"], o["batch"], dense=False)
        write_run(run, out)
        return cap.CaptureResult(run=run, out=out, ok=True, message=None, returncode=0)

    monkeypatch.setattr(cap, "run_capture", fake_capture)
    monkeypatch.setenv("DECODESCOPE_SKIP_GPU_CHECK", "1")  # the stand-in starts no child
    cli_mod.console.width = 250
    js = tmp_path / "new" / "bench.json"  # a folder that does not exist yet: bench makes it
    buf = io.StringIO()
    args = ["bench", "--batch", "1", "--json", str(js), "--runs-dir", str(tmp_path / "runs")]
    with (
        contextlib.redirect_stdout(buf),
        contextlib.redirect_stderr(io.StringIO()),
        contextlib.suppress(SystemExit),
    ):
        cli_mod.main(args)
    assert [s["workload"] for s in asked] == ["standard", "specialized"]
    assert all(s["opts"]["layers"] == "dense,kda,mla" for s in asked)
    payload = json.loads(js.read_text())
    assert {r["layer_kind"] for r in payload["layers"]} == {"kda", "mla"}
    assert {p["dense_layer"] for p in payload["projections"]} == {"excluded (not measured)"}
    assert "dense layer 0: excluded (not measured)" in buf.getvalue()


def test_bench_names_where_the_standard_ops_came_from(runs):
    # every committed standard run used vLLM's compiled ops, and bench says so per source
    for r in runs:
        if r.meta.backend != "standard":
            continue
        line = cmd_bench.impl_line(r)
        assert line is not None and "vllm" in line and "WITHOUT" not in line, r.run_id
    # a real H200 run of s9/r1 whose machine had no vLLM staged: the bench line says so
    # (kept in the GPU logs, not in results/)
    logs = RESULTS.parent / "notes" / "gpu-logs" / "s9" / "r1" / "x1" / "results"
    (std,) = [r for r in read_runs(logs) if r.meta.backend == "standard" and r.meta.batch == 64]
    line = cmd_bench.impl_line(std)
    assert "WITHOUT vLLM's compiled ops" in line and "No module named 'vllm'" in line
    (spec,) = [r for r in read_runs(logs) if r.meta.backend == "specialized" and r.meta.batch == 64]
    assert cmd_bench.impl_line(spec) == f"specialized ops of {spec.run_id}: 13 cute"
    from decodescope.ui.cmd_report import run_summary

    assert run_summary(spec)["ops"] == "13 cute"
    assert "WITHOUT vLLM" in run_summary(std)["ops"]


def test_op_shares_add_up_to_the_layer_share_on_pdl_runs(runs):
    """The newest specialized TP8 batch-1 run (PDL between every kernel: each kernel's recorded
    duration includes its wait for the previous one): per layer kind, the ops' share_us add up
    to the layer's share_us (within the error of summing medians), while their spans add up to
    far more; on the standard run (no PDL) an op's share never exceeds its span."""
    from decodescope.analysis.metrics import op_table

    spec = _newest(runs, "specialized", 8, 1)
    ops = op_table(spec.kernels).to_pylist()
    layer_share = {r["layer_kind"]: r["share_us"] for r in kind_table(spec.kernels).to_pylist()}
    for kind, share in layer_share.items():
        mine = [r for r in ops if r["layer_kind"] == kind]
        assert sum(r["share_us"] for r in mine) == pytest.approx(share, rel=0.02)
        assert sum(r["span_us"] for r in mine) > 1.2 * share  # the PDL waits, counted per op
    std = _newest(runs, "standard", 8, 1)
    for r in op_table(std.kernels).to_pylist():
        assert 0 <= r["share_us"] <= r["span_us"] + 1e-6


def _query(capsys, *args: str) -> tuple[int, str, str]:
    """``decodescope query results ARGS`` in this process: (exit code, stdout, stderr)."""
    from decodescope.ui.cli import console, main

    console.width = 200
    code = 0
    try:
        main(["query", str(RESULTS), *args])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_query_csv_writes_nested_columns_as_json(runs, capsys):
    import csv
    import io
    import json

    code, out, err = _query(capsys, "SELECT run_id, layer_bytes FROM runs ORDER BY run_id", "--csv")
    assert code == 0, err
    rows = list(csv.DictReader(io.StringIO(out)))
    assert len(rows) == len(runs)  # one CSV row per run: the MAP column stays in its cell
    by_id = {r.run_id: r.meta.layer_bytes for r in runs}
    for row in rows:
        assert json.loads(row["layer_bytes"]) == by_id[row["run_id"]]
    code, out, err = _query(capsys, "SELECT * FROM runs", "--csv")
    assert code == 0 and "Traceback" not in err, err
    assert len(list(csv.DictReader(io.StringIO(out)))) == len(runs)
    sql = "SELECT [1, 2] AS l, {'a': 'x,\"y', 'b': [NULL]} AS s, NULL::INT[] AS n, 'z'::BLOB AS b"
    code, out, err = _query(capsys, sql, "--csv")
    assert code == 0, err
    (row,) = list(csv.DictReader(io.StringIO(out)))
    assert json.loads(row["l"]) == [1, 2] and json.loads(row["s"]) == {"a": 'x,"y', "b": [None]}
    assert row["n"] == "" and row["b"] == "z"


def test_query_table_header_is_the_column_name(capsys):
    sql = "SELECT run_id, count(*), 1 AS a, 2 AS a FROM kernels GROUP BY run_id LIMIT 1"
    code, out, err = _query(capsys, sql)
    assert code == 0, err
    header = next(ln for ln in out.splitlines() if "run_id" in ln)
    assert [c.strip() for c in header.strip("┃│ ").split("┃")] == [
        "run_id",
        "count_star()",
        "a",
        "a",
    ]


def test_query_is_read_only(tmp_path, capsys):
    inside = RESULTS / "decodescope-test-copy.csv"
    try:
        for sql in (
            f"COPY (SELECT 1) TO '{tmp_path / 'x.csv'}'",
            f"COPY (SELECT 1) TO '{inside}'",
            f"SELECT 1; COPY (SELECT 1) TO '{inside}'",
            f"EXPLAIN ANALYZE COPY (SELECT 1) TO '{inside}'",
            f"EXPLAIN /* */ ANALYZE COPY (SELECT 1) TO '{inside}'",
            f"ATTACH '{tmp_path / 'x.db'}'",
            "CREATE TABLE t AS SELECT 1",
            "INSTALL httpfs",
            "SET enable_external_access = true",
            f"SELECT * FROM read_text('{__file__}')",
        ):
            code, out, err = _query(capsys, sql)
            lines = [ln for ln in err.splitlines() if ln.strip()]
            assert code == 2 and len(lines) == 1 and "Traceback" not in err, (sql, err)
            assert "read-only" in lines[0] or "disabled by configuration" in lines[0], (sql, err)
        assert not inside.exists() and list(tmp_path.iterdir()) == []
    finally:
        inside.unlink(missing_ok=True)
    for sql in (
        "DESCRIBE runs",
        "SHOW TABLES",
        "SUMMARIZE SELECT batch FROM runs",
        "WITH k AS (SELECT * FROM kernels) SELECT count(*) FROM k",
        "EXPLAIN SELECT count(*) FROM ranges",
        "EXPLAIN ANALYZE SELECT count(*) FROM memops",
        "FROM overheads LIMIT 1",
    ):
        code, out, err = _query(capsys, sql, "--json")
        assert code == 0, (sql, err)
