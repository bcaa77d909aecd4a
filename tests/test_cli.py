"""The command line end to end on real traces: import, report, compare, export, query, check."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from cli_helpers import Result, cli

from decodescope import tracer

TRACES = Path(__file__).parent / "data" / "traces"
HF_QWEN = TRACES / "kineto_h100_qwen1.5-0.5b_hf_eager__TraceLens.json.gz"
VLLM_B200 = TRACES / "kineto_b200_vllm_tp8_rank0_prefill_eager__TraceLens.json.gz"


def one_line_error(p: Result) -> str:
    assert p.returncode == 2, p.stderr
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, p.stderr
    assert "Traceback" not in p.stderr
    return lines[0]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("cli")
    p = cli("import", HF_QWEN, "--out", d / "hf", "--backend", "standard", "--workload", "qwen-hf")
    assert p.returncode == 0, p.stderr
    assert "1465 kernels" in p.stdout and "1008 in a layer" in p.stdout
    p = cli("import", VLLM_B200, "--out", d / "vllm")
    assert p.returncode == 0, p.stderr
    return d


def slow_copy(src: Path, out: Path, factor: float, run_id: str) -> Path:
    """DERIVED from a real run: GPU times multiplied by ``factor`` (a slower run), same setup."""
    run = tracer.load(src)
    k = run.kernels
    s = np.asarray(k["start_ns"].to_pylist(), dtype=np.int64)
    e = np.asarray(k["end_ns"].to_pylist(), dtype=np.int64)
    t0 = s.min()
    k = k.set_column(
        k.schema.get_field_index("start_ns"),
        "start_ns",
        pa.array(t0 + ((s - t0) * factor).astype(np.int64)),
    )
    k = k.set_column(
        k.schema.get_field_index("end_ns"),
        "end_ns",
        pa.array(t0 + ((e - t0) * factor).astype(np.int64)),
    )
    k = k.set_column(k.schema.get_field_index("run_id"), "run_id", pa.array([run_id] * k.num_rows))
    return tracer.write_run(run.replace(kernels=k, meta=run.meta.replace(run_id=run_id)), out)


def test_report_json(work):
    p = cli("report", work / "hf", "--json", "--top", "3")
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    assert data["run"]["kernels"] == 1465 and data["run"]["backend"] == "standard"
    assert data["run"]["dropped_records"] == 0
    (kind,) = data["kinds"]
    assert (kind["layers"], kind["kernels"]) == (24, 42)
    assert len(data["layers"]) == 24 and len(data["kernels"]) == 3
    # the trace itself reports the same figures as its imported run folder
    direct = json.loads(cli("report", HF_QWEN, "--json", "--top", "3").stdout)
    assert direct["layers"] == data["layers"] and direct["kinds"] == data["kinds"]


def test_report_tables(work):
    p = cli("report", work / "vllm", "--top", "5")
    assert p.returncode == 0, p.stderr
    for title in ("per layer kind", "per layer", "per op", "top 5 kernels", "overheads"):
        assert title in p.stdout
    assert "FusedMoE" in p.stdout


def test_report_trace_without_layers():
    p = cli("report", TRACES / "nsys_rtx3080_tiny_full_schema3.24__nsys-ai_mock.sqlite")
    assert p.returncode == 0, p.stderr
    assert "no kernel is attributed to a layer" in p.stdout
    assert "top 15 kernels" in p.stdout


def test_compare(work):
    p = cli("compare", work / "hf", work / "vllm", "--json")
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    assert data["verdict"][0].startswith("B is") and "42 -> 21 kernels" in data["verdict"][0]
    assert len(data["layers"]) == 36
    assert {r["side"] for r in data["only_one_side"]} == {"a", "b"}
    text = cli("compare", work / "hf", work / "vllm")
    assert text.returncode == 0
    assert "42 -> 21 kernels" in text.stdout and "kernels present on one side only" in text.stdout


def test_compare_dataset_runs(work, tmp_path):
    """``DATASET@RUN_ID`` on the command line: the same comparison as of the run folders; a
    bad id is a one-line error naming the dataset."""
    ds = tmp_path / "ds"
    assert cli("export", work / "hf", work / "vllm", "--to", ds).returncode == 0
    a, b = tracer.load(work / "hf").run_id, tracer.load(work / "vllm").run_id
    p = cli("compare", f"{ds}@{a}", f"{ds}@{b[:10]}", "--json")
    assert p.returncode == 0, p.stderr
    want = json.loads(cli("compare", work / "hf", work / "vllm", "--json").stdout)
    assert json.loads(p.stdout)["verdict"] == want["verdict"]
    line = one_line_error(cli("report", f"{ds}@nope"))
    assert str(ds) in line and "no run 'nope'" in line


def test_import_errors_leave_nothing(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"traceEvents": [')
    line = one_line_error(cli("import", bad, "--out", tmp_path / "out"))
    assert str(bad) in line
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json"]
    line = one_line_error(cli("import", tmp_path / "missing.json", "--out", tmp_path / "out"))
    assert "no such file" in line
    (tmp_path / "exists").mkdir()
    one_line_error(cli("import", HF_QWEN, "--out", tmp_path / "exists"))


def test_export_and_query(work, tmp_path):
    ds = tmp_path / "ds"
    p = cli("export", work / "hf", work / "vllm", "--to", ds)
    assert p.returncode == 0, p.stderr
    q = cli(
        "query",
        ds,
        "SELECT run_id, count(*) AS n FROM kernels GROUP BY run_id ORDER BY n",
        "--json",
    )
    assert q.returncode == 0, q.stderr
    assert [r["n"] for r in json.loads(q.stdout)] == [768, 1465]
    q = cli("query", ds, "SELECT gpu, backend, workload FROM runs ORDER BY gpu", "--json")
    assert json.loads(q.stdout) == [
        {"gpu": "NVIDIA B200", "backend": None, "workload": None},
        {"gpu": "NVIDIA H100 80GB HBM3", "backend": "standard", "workload": "qwen-hf"},
    ]
    for view in ("ranges", "memops", "overheads"):
        assert cli("query", ds, f"SELECT count(*) FROM {view}").returncode == 0
    c = cli("query", ds, "SELECT run_id, count(*) AS n FROM kernels GROUP BY 1 ORDER BY n", "--csv")
    assert c.returncode == 0, c.stderr
    rows = list(csv.DictReader(io.StringIO(c.stdout)))
    assert [int(r["n"]) for r in rows] == [768, 1465]
    assert "pick one" in one_line_error(cli("query", ds, "SELECT 1", "--csv", "--json"))
    table = cli(
        "query", ds, "SELECT layer, count(*) AS n FROM kernels WHERE layer = 3 GROUP BY layer"
    )
    assert table.returncode == 0 and "63" in table.stdout  # 42 + 21 kernels in layer 3
    assert "query failed" in one_line_error(cli("query", ds, "SELECT nope FROM kernels"))
    assert "already holds" in one_line_error(cli("export", work / "hf", "--to", ds))
    assert "not a decodescope dataset" in one_line_error(cli("query", work / "hf", "SELECT 1"))


def test_check_against_run(work, tmp_path):
    ok = cli("check", work / "hf", "--baseline", HF_QWEN, "--max-regression", "1")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "ok" in ok.stdout
    slow = slow_copy(work / "hf", tmp_path / "slow", 1.25, "hf-slow")  # DERIVED: 25% slower
    bad = cli("check", slow, "--baseline", work / "hf", "--max-regression", "10")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "regression" in bad.stdout and "+25.0%" in bad.stdout
    assert cli("check", slow, "--baseline", work / "hf", "--max-regression", "30").returncode == 0
    js = cli("check", slow, "--baseline", work / "hf", "--max-regression", "10", "--json")
    assert js.returncode == 1
    data = json.loads(js.stdout)
    assert data["ok"] is False and data["reasons"] and data["table"][0]["status"] == "regression"


def test_check_names_differing_kernel_knobs(work, tmp_path):
    """A run captured with kernel knobs (config_json["knobs"], written by the capture) checked
    against a run without: the check still decides on the figures, and says the knobs differ."""
    run = tracer.load(work / "hf")
    cfg = {**run.meta.config, "knobs": {"DECODESCOPE_DENSE_TILE": "0"}}
    meta = run.meta.replace(run_id="hf-knobs", config_json=json.dumps(cfg))
    knobbed = tracer.write_run(run.replace(meta=meta), tmp_path / "knobs")
    p = cli("check", knobbed, "--baseline", work / "hf", "--max-regression", "1")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "kernel knobs differ (DECODESCOPE_DENSE_TILE: run 0, baseline unset)" in p.stdout
    js = json.loads(cli("check", work / "hf", "--baseline", work / "hf", "--max-regression", "1",
                        "--json").stdout)  # fmt: skip
    assert js["knobs_note"] is None
    rep = json.loads(cli("report", knobbed, "--json", "--top", "1").stdout)
    assert rep["run"]["knobs"] == "DECODESCOPE_DENSE_TILE=0"


def test_check_says_when_the_baseline_ran_another_step_shape():
    """The committed H200 runs of session 19 (TP8, same call): the 32 x 8 verify step against the
    32 x 1 step as its baseline is refused (one line naming the field; exit 2, not a
    "regression"); with --allow-setup-mismatch the check decides on the figures (a regression: 4
    chunks of launches) and says the two ran different step shapes."""
    results = Path(__file__).resolve().parent.parent / "results"
    run, base = f"{results}@specialized-20261202T100146", f"{results}@specialized-20261202T100041"
    line = one_line_error(cli("check", run, "--baseline", base, "--max-regression", "5"))
    assert "ran another setup" in line and "tokens_per_seq: run 8, baseline 1" in line
    allow = ["--allow-setup-mismatch"]
    p = cli("check", run, "--baseline", base, "--max-regression", "5", *allow)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "note: different step shapes (ratios compare different work): run tokens_per_seq 8; " \
        "baseline tokens_per_seq 1" in " ".join(p.stdout.split())  # fmt: skip
    js = json.loads(
        cli("check", run, "--baseline", base, "--max-regression", "5", "--json", *allow).stdout
    )
    assert js["shape_note"].endswith("run tokens_per_seq 8; baseline tokens_per_seq 1")
    assert js["setup_notes"] == [js["shape_note"]]
    same = cli("check", run, "--baseline", run, "--max-regression", "5", "--json").stdout
    assert json.loads(same)["shape_note"] is None and json.loads(same)["setup_notes"] == []


def test_check_against_dataset(work, tmp_path):
    ds = tmp_path / "ds"
    # the same real trace imported twice under two run ids: two baseline rows of one setup
    for rid in ("base-1", "base-2"):
        out = tmp_path / rid
        p = cli(
            "import",
            HF_QWEN,
            "--out",
            out,
            "--run-id",
            rid,
            "--backend",
            "standard",
            "--workload",
            "qwen-hf",
        )
        assert p.returncode == 0, p.stderr
        assert cli("export", out, "--to", ds).returncode == 0
    same = cli("check", tmp_path / "base-1", "--baseline", ds, "--max-regression", "1")
    assert same.returncode == 0, same.stdout + same.stderr
    assert "1 run(s)" in same.stdout  # itself is never its own baseline
    slow = slow_copy(tmp_path / "base-1", tmp_path / "slow", 1.2, "slow")  # DERIVED: 20% slower
    bad = cli("check", slow, "--baseline", ds, "--max-regression", "5")
    assert bad.returncode == 1 and "2 run(s)" in bad.stdout
    # a run of another setup has no baseline there
    line = one_line_error(cli("check", work / "vllm", "--baseline", ds, "--max-regression", "5"))
    assert "no baseline run" in line and "itself" not in line
    # a dataset that holds only the run itself: the error says why that is no baseline
    alone = tmp_path / "alone"
    assert cli("export", tmp_path / "base-1", "--to", alone).returncode == 0
    line = one_line_error(cli("check", tmp_path / "base-1", "--baseline", alone,
                              "--max-regression", "5"))  # fmt: skip
    assert "no baseline run" in line and "it holds run base-1 itself" in line


def test_scheme_option(work, tmp_path):
    f = tmp_path / "scheme.toml"
    f.write_text('extends = "default"\ndefault_kind = "decoder"\n')
    p = cli("report", work / "hf", "--json", "--scheme", f)
    assert p.returncode == 0, p.stderr
    assert [k["layer_kind"] for k in json.loads(p.stdout)["kinds"]] == ["decoder"]
    (f.parent / "bad.toml").write_text("x = [")
    assert "not valid TOML" in one_line_error(
        cli("report", work / "hf", "--scheme", f.parent / "bad.toml")
    )


@pytest.mark.parametrize(
    "args",
    [("report", "results", "--run", "x"), ("nosuch",), ("report",), ("compare", "a")],
    ids=["unknown-option", "unknown-command", "missing-argument", "missing-second-argument"],
)
def test_usage_errors_are_one_line(args):
    """click's usage errors (raised from typer's vendored copy of click) get one line and exit 2."""
    line = one_line_error(cli(*args))
    assert line.startswith("error: ") and "--help" in line


def test_check_against_the_results_dataset_takes_runs_of_the_same_kernel_knobs():
    """``check RUN --baseline results/`` on the committed H200 runs: a run of the default kernels
    is checked against the dataset's runs of the defaults only (its knob A/Bs measured other
    kernels), a knob run (session 18, ``DECODESCOPE_MLA_SPLIT_EARLYABS=1``) against the runs of
    the defaults, with the one knob that differs named."""
    results = Path(__file__).resolve().parent.parent / "results"
    default = json.loads(cli("check", f"{results}@specialized-20261202T094447", "--baseline",
                             results, "--max-regression", "50", "--json").stdout)  # fmt: skip
    assert "run(s) of the default kernels" in default["baseline"], default["baseline"]
    assert default["knobs_note"] is None
    knob = json.loads(cli("check", f"{results}@specialized-20261202T071558", "--baseline",
                          results, "--max-regression", "50", "--json").stdout)  # fmt: skip
    assert "run(s) of the default kernels" in knob["baseline"]
    assert knob["knobs_note"] == (
        "kernel knobs differ (DECODESCOPE_MLA_SPLIT_EARLYABS: run 1, baseline unset)"
    )


def test_check_by_share():
    """The committed H200 runs of the TP16 batch-1 specialized step before and after session 27's
    W13T1 default (e2fb8c8): the MLA layer's span grew 11.5% (its first kernel now overlaps the
    KDA layer before it) while its share of the step fell 1.2%. ``--metric span`` (the default)
    fails and says so in a note; ``--metric share`` passes; ``both`` fails; a bad value is a
    one-line usage error."""
    results = Path(__file__).resolve().parent.parent / "results"
    run = f"{results}@specialized-20261203T154926-8e01fd"
    base = ["--baseline", f"{results}@specialized-20261203T131727-6b708c", "--max-regression", "5"]
    span = cli("check", run, *base)
    assert span.returncode == 1, span.stdout + span.stderr
    flat = " ".join(span.stdout.split())
    assert "MLA layer span (us): 103.89 vs baseline 93.18 (+11.5%, limit +5%)" in flat
    assert "note: MLA layer: span +11.5% but share -1.2% (90.5 -> 89.4 us)" in flat
    share = cli("check", run, *base, "--metric", "share", "--json")
    assert share.returncode == 0, share.stdout + share.stderr
    js = json.loads(share.stdout)
    assert js["ok"] and js["share_notes"] == [] and "run_share_us" in js["table"][0]
    both = json.loads(cli("check", run, *base, "--metric", "both", "--json").stdout)
    assert not both["ok"] and [r for r in both["reasons"] if "span" in r]
    assert "--metric 'x'" in one_line_error(cli("check", run, *base, "--metric", "x"))


def test_check_and_demo_refuse_what_they_cannot_show(tmp_path):
    """A trace whose kernels no layer range covers (the nsys RTX 3080 mock: kernels, no NVTX
    layers) has nothing to check: one line, exit 2, not a "regression"; ``demo --results`` of a
    path that is no dataset, and of a dataset of imported traces only (no bench pair): one line,
    exit 2."""
    trace = TRACES / "nsys_rtx3080_tiny_full_schema3.24__nsys-ai_mock.sqlite"
    p = cli("check", trace, "--baseline", trace, "--max-regression", "5")
    assert p.returncode == 2 and "no per-layer figures" in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    p = cli("demo", "--results", tmp_path / "nowhere")
    assert p.returncode == 2 and "nowhere: does not exist" in p.stderr
    run = tmp_path / "hf"
    assert cli("import", HF_QWEN, "--out", run).returncode == 0
    assert cli("export", run, "--to", tmp_path / "ds").returncode == 0
    p = cli("demo", "--results", tmp_path / "ds")
    assert p.returncode == 2 and "no runs of `decodescope bench`" in p.stderr


def test_report_of_a_dataset_names_the_run_syntax_and_shows_the_run_record():
    """``report results`` (a dataset, not a run): one line that says how to name a run; a run's
    report carries its commit, copy bandwidth, time and notes (session 19's TP8 batch-1 run)."""
    results = Path(__file__).resolve().parent.parent / "results"
    p = cli("report", results)
    assert p.returncode == 2 and f"name one as {results}@RUN_ID" in p.stderr
    rep = json.loads(cli("report", f"{results}@specialized-20261202T094447", "--json", "--top",
                         "1").stdout)["run"]  # fmt: skip
    assert rep["git_commit"].startswith("385c2e3") and 3.5 < rep["copy_bw_tbs"] < 5
    assert rep["created_at"].startswith("2026-12-02 09:44") and "tp_world 1" in rep["notes"]


def test_kernels_without_a_launch_record_are_said(work):
    """Kernels whose launch record is not in the trace cannot be placed in a CPU range: import
    and report say how many, and the count matches a scan of the trace itself (the Qwen trace's
    GPU side starts before its CPU side: 436 kernels; the H100 x2 nsys export: 1810)."""
    import gzip
    import sqlite3

    trace = json.loads(gzip.decompress(HF_QWEN.read_bytes()))["traceEvents"]
    launched = {e["args"]["correlation"] for e in trace
                if e.get("cat") in ("cuda_runtime", "cuda_driver")}  # fmt: skip
    orphans = sum(1 for e in trace
                  if e.get("cat") == "kernel" and e["args"]["correlation"] not in launched)  # fmt: skip
    assert orphans == 436
    data = json.loads(cli("report", work / "hf", "--json", "--top", "1").stdout)
    assert data["run"]["kernels_without_launch"] == orphans
    p = cli("import", HF_QWEN, "--out", work / "hf_again")
    assert f"{orphans} without a launch record" in p.stdout

    nsys = TRACES / "nsys_h100x2_fastvideo_nvtx_aten__nsys-ai_h100_2gpu_1s.sqlite"
    con = sqlite3.connect(f"file:{nsys}?mode=ro", uri=True)
    ((orphans,),) = con.execute(
        """SELECT count(*) FROM CUPTI_ACTIVITY_KIND_KERNEL k WHERE NOT EXISTS (
               SELECT 1 FROM CUPTI_ACTIVITY_KIND_RUNTIME r WHERE r.correlationId = k.correlationId
               AND r.globalTid >> 24 = k.globalPid >> 24)"""
    ).fetchall()
    con.close()
    assert orphans == 1810
    data = json.loads(cli("report", nsys, "--json", "--top", "1").stdout)
    assert data["run"]["kernels_without_launch"] == orphans
    # every kernel of the vLLM trace has its launch: nothing to say
    vllm = json.loads(cli("report", work / "vllm", "--json", "--top", "1").stdout)
    assert vllm["run"]["kernels_without_launch"] is None
