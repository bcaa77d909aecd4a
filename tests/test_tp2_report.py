"""Two ranks in one run: the merge, the rank-aware metrics, and what report / compare / bench /
the dashboard show for them.

SYNTHETIC: no two-GPU capture is committed yet. The two-rank run here is built from the real
H200 capture data/runs/h200_toy_graph (one rank): rank 1 is a copy of rank 0's kernels shifted
by 3 us, merged with tracer.distributed.merge_runs. So both ranks have the same spans and every
layer's start and end skew is exactly 3 us."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow.compute as pc
import pytest

from decodescope import tracer
from decodescope.analysis import metrics
from decodescope.tracer.distributed import merge_runs

ROOT = Path(__file__).resolve().parents[1]
TOY = ROOT / "data" / "runs" / "h200_toy_graph"
SHIFT_NS = 3000


def _shifted(run, ns):
    k = run.kernels
    for c in ("start_ns", "end_ns"):
        k = k.set_column(k.schema.get_field_index(c), c, pc.add(k[c], ns))
    return run.replace(kernels=k)


@pytest.fixture(scope="module")
def one():
    return tracer.load(TOY)


@pytest.fixture(scope="module")
def two(one):
    return merge_runs([one, _shifted(one, SHIFT_NS)])


@pytest.fixture(scope="module")
def two_dir(two, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "two_rank"
    tracer.write_run(two, out)
    return out


def test_merge_sets_rank_and_keeps_every_row(one, two):
    assert two.kernels.num_rows == 2 * one.kernels.num_rows
    assert two.ranges.num_rows == 2 * one.ranges.num_rows
    assert metrics.ranks_of(two.kernels) == [0, 1]
    assert two.meta.tp_world == 2 and two.meta.run_id == one.meta.run_id
    assert [r["rank"] for r in two.meta.config["ranks"]] == [0, 1]
    # attribution survives: every kernel keeps its layer and op
    assert two.kernels["layer"].null_count == 2 * one.kernels["layer"].null_count


def test_merge_rejects_bad_ranks(one):
    with pytest.raises(ValueError, match="distinct"):
        merge_runs([one, one], ranks=[0, 0])


def test_skew_and_per_rank_spans(one, two):
    sk = metrics.rank_skew(two.kernels)
    assert sk.num_rows == metrics.layer_steps(one.kernels).num_rows  # every (step, layer)
    assert set(sk["ranks"].to_pylist()) == {2}
    assert set(sk["late_rank"].to_pylist()) == {1}
    for m in ("start_skew_us", "end_skew_us"):
        assert all(abs(v - SHIFT_NS / 1e3) < 1e-9 for v in sk[m].to_pylist())
    spans = zip(sk["span_all_us"].to_pylist(), sk["span_rank_max_us"].to_pylist(), strict=True)
    assert all(abs(a - (b + SHIFT_NS / 1e3)) < 1e-9 for a, b in spans)
    rk = metrics.rank_kind_table(two.kernels)
    single = metrics.kind_table(one.kernels)
    for r in (0, 1):
        part = rk.filter(pc.equal(rk["rank"], r)).drop_columns(["rank"])
        assert part.to_pylist() == single.to_pylist()
    # one rank: no skew rows, and the single-rank tables are what they were
    assert metrics.rank_skew(one.kernels).num_rows == 0
    assert metrics.rank_kind_table(one.kernels).drop_columns(["rank"]).equals(single)


def test_report_shows_ranks_and_skew(one, two_dir):
    from test_cli import cli

    r = cli("report", two_dir, "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert {row["rank"] for row in data["kinds"]} == {0, 1}
    assert {row["layer"] for row in data["skew"]} == {0, 1}
    assert all(abs(row["start_skew_us"] - 3.0) < 1e-9 for row in data["skew"])
    r1 = cli("report", TOY, "--json")
    assert "skew" not in json.loads(r1.stdout)  # one rank: the report is as before
    text = cli("report", two_dir).stdout
    assert "skew between ranks per layer" in text and "per layer kind, per rank" in text


def test_compare_one_rank_with_two(two_dir):
    from test_cli import cli

    data = json.loads(cli("compare", TOY, two_dir, "--json").stdout)
    rk = {(row["rank"], row["layer_kind"]): row for row in data["rank_kinds"]}
    assert rk[(0, "kda")]["ratio"] == pytest.approx(1.0)
    assert rk[(1, "kda")]["a_span_us"] is None and rk[(1, "kda")]["b_span_us"] > 0
    assert all(row["a_start_skew_us"] is None for row in data["skew"])
    assert all(abs(row["b_start_skew_us"] - 3.0) < 1e-9 for row in data["skew"])
    text = cli("compare", TOY, two_dir).stdout
    assert "per layer kind and rank" in text and "skew between ranks per layer" in text
    plain = json.loads(cli("compare", TOY, TOY, "--json").stdout)
    assert "skew" not in plain and "rank_kinds" not in plain


def test_bench_rows_of_a_two_rank_run(one, two):
    from decodescope.ui.cmd_bench import kind_rows

    rows = {r["layer_kind"]: r for r in kind_rows(two, "standard", 1, 1)}
    base = {r["layer_kind"]: r for r in kind_rows(one, "standard", 1, 1)}
    for kind, r in rows.items():
        assert r["span_us"] == base[kind]["span_us"] and r["layers"] == base[kind]["layers"]
        assert r["ranks"] == 2 and abs(r["skew_us"] - 3.0) < 1e-9
        assert set(r["rank_span_us"]) == {0, 1}
    assert "skew_us" not in base["kda"]


def test_figure_and_dashboard_show_the_ranks(two, two_dir, monkeypatch):
    from streamlit.testing.v1 import AppTest

    from decodescope.ui import dashboard, figures

    fig = figures.rank_spans(metrics.layer_table(two.kernels), metrics.skew_table(two.kernels))
    names = [t.name for t in fig.data]
    assert names[:2] == ["rank 0", "rank 1"] and "start skew" in names
    monkeypatch.setenv(dashboard.SOURCES_ENV, os.pathsep.join([str(TOY), str(two_dir)]))
    at = AppTest.from_file(str(ROOT / "ui" / "dashboard.py"), default_timeout=120)
    at.run()
    at.session_state["view"] = "Charts"
    at.run()
    assert not at.exception, [str(e.value) for e in at.exception]
    assert any("several ranks" in str(c.value) for c in at.caption)
