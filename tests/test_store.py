"""Run folders and results datasets on disk, with real imported runs."""

from __future__ import annotations

import os
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.dataset as ds
import pytest

from decodescope import tracer
from decodescope.analysis import dataset as layout
from decodescope.analysis import metrics, schema
from decodescope.tracer import dataset as tds
from decodescope.tracer.errors import TraceError

TRACES = Path(__file__).parent / "data" / "traces"
HF_QWEN = TRACES / "kineto_h100_qwen1.5-0.5b_hf_eager__TraceLens.json.gz"
VLLM_B200 = TRACES / "kineto_b200_vllm_tp8_rank0_prefill_eager__TraceLens.json.gz"
NSYS_H100 = TRACES / "nsys_h100x2_fastvideo_nvtx_aten__nsys-ai_h100_2gpu_1s.sqlite"


@pytest.fixture(scope="module")
def runs() -> list[schema.Run]:
    out = [tracer.load(p) for p in (HF_QWEN, VLLM_B200, NSYS_H100)]
    return [r.replace(meta=r.meta.replace(backend="other")) for r in out]


def _same_tables(a: schema.Run, b: schema.Run) -> None:
    assert a.meta == b.meta
    for name in ("kernels", "ranges", "memops", "overheads"):
        ta, tb = getattr(a, name), getattr(b, name)
        assert ta.schema == tb.schema == schema.TABLES[name]
        sort = [(c, "ascending") for c in ("start_ns", "end_ns") if c in ta.column_names]
        assert ta.sort_by(sort).to_pylist() == tb.sort_by(sort).to_pylist()


def test_run_folder_roundtrip(tmp_path, runs):
    for i, run in enumerate(runs):
        out = tracer.write_run(run, tmp_path / f"run{i}")
        back = tracer.load(out)  # a run folder loads as written (no second attribution)
        _same_tables(run, back)
        assert sorted(os.listdir(out)) == sorted(f"{t}.parquet" for t in schema.TABLES)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporaries left


def test_run_folder_refuses_overwrite(tmp_path, runs):
    out = tracer.write_run(runs[0], tmp_path / "r")
    with pytest.raises(TraceError, match="already exists"):
        tracer.write_run(runs[1], out)
    tracer.write_run(runs[1], out, overwrite=True)
    assert tracer.load(out).run_id == runs[1].run_id


def test_dataset_append_and_read_back(tmp_path, runs):
    d = tmp_path / "ds"
    tds.append_runs(runs, d)
    assert tds.is_dataset(d)
    assert tds.run_ids(d) == {r.run_id for r in runs}
    back = {r.run_id: r for r in tds.read_runs(d)}
    for run in runs:
        _same_tables(run, back[run.run_id])
    # the layout: one folder per table, Hive partitions, no partition column inside the files
    for name in schema.TABLES:
        files = sorted((d / name).rglob("*.parquet"))
        assert len(files) == len(runs)
        for f in files:
            rel = f.relative_to(d / name).parts
            assert [p.split("=", 1)[0] for p in rel[:-1]] == list(layout.PARTITIONS)
            assert not set(layout.PARTITIONS) & set(pa.parquet.read_schema(f).names)
    # a subset of runs
    one = tds.read_table(d, "kernels", [runs[1].run_id])
    assert one.num_rows == runs[1].kernels.num_rows


def test_dataset_readable_by_duckdb_and_pyarrow_as_is(tmp_path, runs):
    d = tmp_path / "ds"
    tds.append_runs(runs, d)
    con = duckdb.connect()
    got = dict(
        con.sql(
            f"SELECT run_id, count(*) FROM read_parquet('{d}/kernels/**/*.parquet', "
            "hive_partitioning = true) GROUP BY run_id"
        ).fetchall()
    )
    assert got == {r.run_id: r.kernels.num_rows for r in runs}
    gpus = dict(
        con.sql(
            f"SELECT run_id, gpu FROM read_parquet('{d}/runs/**/*.parquet', hive_partitioning = true)"
        ).fetchall()
    )
    assert gpus == {r.run_id: r.meta.gpu for r in runs}  # nulls read back as NULL
    # plain pyarrow with hive partitioning: one schema across runs
    # (pyarrow infers partition types from the values: where a field is null in every run, like
    # preset here, it needs the types given)
    part = ds.partitioning(pa.schema([(k, pa.string()) for k in layout.PARTITIONS]), flavor="hive")
    t = ds.dataset(d / "kernels", format="parquet", partitioning=part).to_table()
    assert t.num_rows == sum(r.kernels.num_rows for r in runs)
    # the per-layer figures agree whichever way the rows came back
    k = tds.read_table(d, "kernels", [runs[0].run_id])
    assert metrics.layer_table(k).to_pylist() == metrics.layer_table(runs[0].kernels).to_pylist()


def test_dataset_partition_values_with_odd_characters(tmp_path, runs):
    run = runs[0].replace(
        meta=runs[0].meta.replace(gpu="GPU/with=odd%chars", preset=None, backend="standard")
    )
    d = tmp_path / "ds"
    tds.append_run(run, d)
    (meta,) = [r.meta for r in tds.read_runs(d)]
    assert (meta.gpu, meta.preset, meta.backend) == ("GPU/with=odd%chars", None, "standard")
    row = duckdb.sql(
        f"SELECT gpu, preset FROM read_parquet('{d}/runs/**/*.parquet', hive_partitioning = true)"
    ).fetchall()
    assert row == [("GPU/with=odd%chars", None)]


def test_dataset_refuses_duplicates_and_cleans_up(tmp_path, runs, monkeypatch):
    d = tmp_path / "ds"
    tds.append_run(runs[0], d)
    with pytest.raises(TraceError, match="already holds run"):
        tds.append_run(runs[0], d)
    tds.append_run(runs[0], d, replace=True)
    assert tds.run_ids(d) == {runs[0].run_id}
    # a failure half-way leaves nothing of that run behind
    real = pa.parquet.write_table
    calls = {"n": 0}

    def failing(table, where, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("disk full")
        return real(table, where, **kw)

    monkeypatch.setattr(tds.pq, "write_table", failing)
    with pytest.raises(OSError):
        tds.append_run(runs[1], d)
    monkeypatch.undo()
    assert tds.run_ids(d) == {runs[0].run_id}
    leftovers = [p for p in d.rglob(f"run_id={runs[1].run_id}")]
    assert leftovers == []
    assert not [p for p in d.rglob(".tmp-*")]


def test_not_a_dataset(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "file.txt").write_text("hello")
    assert not tds.is_dataset(tmp_path / "x")
    with pytest.raises(TraceError, match="not a decodescope dataset"):
        tds.read_table(tmp_path / "x", "kernels")
    with pytest.raises(TraceError, match="not a decodescope dataset"):
        tds.append_run(schema.Run(meta=schema.RunMeta(run_id="r", source="cupti")), tmp_path / "x")


def test_select_baseline():
    rows = [
        {
            "run_id": "a",
            "workload": "w",
            "preset": "p",
            "backend": "standard",
            "batch": 1,
            "tp_shape": 8,
            "gpu": "H200",
        },
        {
            "run_id": "b",
            "workload": "w",
            "preset": "p",
            "backend": "standard",
            "batch": 1,
            "tp_shape": 8,
            "gpu": "H200",
        },
        {
            "run_id": "c",
            "workload": "w",
            "preset": "p",
            "backend": "standard",
            "batch": 64,
            "tp_shape": 8,
            "gpu": "H200",
        },
        {
            "run_id": "d",
            "workload": "w",
            "preset": "p",
            "backend": "specialized",
            "batch": 1,
            "tp_shape": 8,
            "gpu": "H200",
        },
    ]
    meta = schema.RunMeta(
        run_id="b",
        source="cupti",
        workload="w",
        preset="p",
        backend="standard",
        batch=1,
        tp_shape=8,
        gpu="H200",
    )
    assert layout.select_baseline(rows, meta) == ["a"]
    assert layout.encode_value(None) == layout.NULL_PARTITION
    assert layout.decode_value(layout.encode_value("a/b=c%d")) == "a/b=c%d"


def test_dataset_run_reference(tmp_path, runs):
    """``DATASET@RUN_ID`` (or a unique prefix of the id) loads that run of a results dataset
    wherever a run folder or trace is accepted; a bad reference is a one-line error naming the
    dataset."""
    d = tmp_path / "ds"
    tds.append_runs(runs, d)
    for run in runs:
        _same_tables(run, tracer.load(f"{d}@{run.run_id}"))
    rid = runs[1].run_id
    prefix = next(rid[:n] for n in range(1, len(rid)) if
                  sum(r.run_id.startswith(rid[:n]) for r in runs) == 1)  # fmt: skip
    assert tracer.load(f"{d}@{prefix}").run_id == rid
    assert tracer.dataset_ref(f"{d}@{rid}") == (d, rid)
    assert tracer.dataset_ref(d) is None and tracer.dataset_ref(tmp_path / "x@y") is None
    with pytest.raises(TraceError, match=r"no run 'nope' in this dataset \(3 runs\)"):
        tracer.load(f"{d}@nope")
    ids = [r.run_id for r in runs]
    common = max((os.path.commonprefix([a, b]) for a in ids for b in ids if a != b), key=len)
    assert common  # the two Kineto imports' ids share "kineto-"
    n = sum(i.startswith(common) for i in ids)
    with pytest.raises(TraceError, match=f"is ambiguous: {n} runs start with it"):
        tracer.load(f"{d}@{common}")
    with pytest.raises(TraceError, match="no run '' in this dataset"):
        tracer.load(f"{d}@")
    with pytest.raises(TraceError, match="no such file or directory"):
        tracer.load(tmp_path / "missing@run")
