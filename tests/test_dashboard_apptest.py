"""The dashboard's page logic under Streamlit's AppTest (no browser): the default view, choosing
runs, and bad input shown as a message in the page, never as an exception."""

from __future__ import annotations

import io
import os
import zipfile
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from decodescope import tracer
from decodescope.tracer.errors import TraceError
from decodescope.ui import dashboard

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "ui" / "dashboard.py"
DEFAULT = ROOT / "ui" / "data" / "default"
H100 = DEFAULT / "h100_hf_qwen1.5-0.5b_eager"
B200 = DEFAULT / "b200_vllm_gpt-oss_tp8_prefill"
TRACES = ROOT / "tests" / "data" / "traces"
NSYS_2GPU = TRACES / "nsys_h100x2_fastvideo_nvtx_aten__nsys-ai_h100_2gpu_1s.sqlite"


def run_app(monkeypatch, *sources: Path | str) -> AppTest:
    monkeypatch.setenv(dashboard.SOURCES_ENV, os.pathsep.join(str(s) for s in sources))
    at = AppTest.from_file(str(APP), default_timeout=120)
    at.run()
    return at


def texts(elements) -> list[str]:
    return [str(e.value) for e in elements]


def no_exception(at: AppTest) -> None:
    assert not at.exception, texts(at.exception)
    assert not [e for e in texts(at.error) if "did not expect" in e], texts(at.error)


def open_view(at: AppTest, view: str) -> AppTest:
    """Open one tab (tabs are lazy: only the open one runs)."""
    at.session_state["view"] = view
    return at.run()


def test_default_view_renders_the_h200_results(monkeypatch):
    at = run_app(monkeypatch)  # no sources: DEFAULT_DATA, the committed H200 results dataset
    assert dashboard.DEFAULT_DATA == (dashboard.RESULTS_DATA,)
    no_exception(at)
    assert not at.error, texts(at.error)
    # the headline per layer kind: standard (A) vs specialized (B) of one setup
    heads = texts(at.subheader)
    assert any(h.startswith("KDA layer: ") and " vs " in h for h in heads), heads
    assert any(h.startswith("MLA layer: ") and " vs " in h for h in heads), heads
    assert any(m.startswith("**Verdict:** B is") for m in texts(at.markdown))
    assert [t.label for t in at.tabs] == list(dashboard.VIEWS)
    kinds = at.dataframe[0].value
    assert {"a_kernels", "b_kernels", "kernels_delta", "ratio"} <= set(kinds.columns)
    # the newest runs also measured the dense layer 0
    assert set(kinds["layer_kind"]) in ({"kda", "mla"}, {"dense", "kda", "mla"})
    # each op against the floor of its own bytes, both runs (ours: they recorded their bytes)
    ops = next(d.value for d in at.dataframe if "share_over_floor_us" in d.value.columns)
    assert set(ops["run"]) == {"A", "B"} and ops["op_floor_us"].notna().all()


def test_bundled_traces_render_side_by_side(monkeypatch):
    at = run_app(monkeypatch, dashboard.BUNDLED_TRACES)
    no_exception(at)
    assert not at.error, texts(at.error)
    heads = texts(at.subheader)
    assert heads and heads[0].startswith("Layer: ") and " vs " in heads[0]
    assert any(m.startswith("**Verdict:** B is 1.29x faster") for m in texts(at.markdown))
    assert len(at.dataframe) >= 2
    layers = at.dataframe[1].value
    assert {"a_span_us", "b_span_us", "a_busy_us", "a_gaps_us", "a_kernel_sum_us"} <= set(
        layers.columns
    )
    assert len(layers) == 36  # the layers 0..35 of gpt-oss, 0..23 of Qwen1.5-0.5B beside them


@pytest.mark.parametrize("view", dashboard.VIEWS[1:])
def test_every_view_renders(monkeypatch, view):
    at = run_app(monkeypatch)
    open_view(at, view)
    no_exception(at)
    assert not at.error, texts(at.error)
    if view in ("Charts", "Timeline", "History"):
        assert at.get("plotly_chart"), f"{view}: no chart"
    if view in ("Kernels", "Run metadata", "History"):
        assert at.dataframe, f"{view}: no table"
    assert at.get("download_button"), f"{view}: no downloads"


def test_choosing_runs_changes_the_comparison(monkeypatch):
    at = run_app(monkeypatch, H100, B200)
    no_exception(at)
    a = at.sidebar.selectbox(key="run-a")
    b = at.sidebar.selectbox(key="run-b")
    assert (a.value, b.value) == (0, 1)
    first = texts(at.subheader)[0]
    assert first.startswith("Layer: 42 kernels")  # A: HF Qwen on the H100
    b.set_value(0).run()
    no_exception(at)
    assert any("same run" in t for t in texts(at.info))
    assert texts(at.subheader)[0].startswith("Layer: 42 kernels /")
    assert " vs " not in texts(at.subheader)[0]
    at.sidebar.selectbox(key="run-a").set_value(1).run()
    no_exception(at)
    assert texts(at.subheader)[0].startswith("Layer: 21 kernels")  # A: vLLM gpt-oss on B200


def test_timeline_and_kernel_search(monkeypatch):
    at = run_app(monkeypatch, H100, B200)
    open_view(at, "Timeline")
    at.selectbox(key="tl-layer").set_value(5).run()
    no_exception(at)
    assert at.get("plotly_chart")
    # the bars' sums, one caption per side (analysis.timeline, as `decodescope timeline`)
    sums = [t for t in texts(at.caption) if " kernels, span " in t and "idle" in t]
    assert len(sums) == 2 and all(" us, busy " in t and ", shares " in t for t in sums), sums
    open_view(at, "Kernels")
    at.text_input(key="k-search").set_value("gemm").run()
    no_exception(at)
    caption = next(t for t in texts(at.caption) if "kernel names" in t)
    shown, total = int(caption.split()[0]), int(caption.split()[2])
    assert 0 < shown < total


def test_a_file_that_is_not_a_trace_is_a_message(monkeypatch, tmp_path):
    bad = tmp_path / "notes.txt"
    bad.write_text("this is not a trace\n")
    at = run_app(monkeypatch, bad, H100)
    no_exception(at)
    errors = texts(at.error)
    assert any(str(bad) in e and "unrecognised format" in e for e in errors), errors
    assert texts(at.subheader)  # the good run still renders


def test_a_broken_trace_is_a_message(monkeypatch, tmp_path):
    # a real Kineto trace cut in half
    data = (TRACES / "kineto_h100_qwen1.5-0.5b_hf_eager__TraceLens.json.gz").read_bytes()
    cut = tmp_path / "cut.json"
    import gzip

    cut.write_bytes(gzip.decompress(data)[:100_000])
    at = run_app(monkeypatch, cut)
    no_exception(at)
    assert any(str(cut) in e for e in texts(at.error)), texts(at.error)
    assert any("No run to show" in w for w in texts(at.warning))


def test_an_empty_dataset_is_a_message(monkeypatch, tmp_path):
    empty = tmp_path / "results"
    empty.mkdir()
    at = run_app(monkeypatch, empty)
    no_exception(at)
    assert any("empty dataset" in e for e in texts(at.error)), texts(at.error)
    assert any("No run to show" in w for w in texts(at.warning))


def test_runs_with_different_presets_are_a_warning(monkeypatch, tmp_path):
    a = tracer.read_run(H100)
    b = tracer.read_run(B200)
    tracer.write_run(
        a.replace(meta=a.meta.replace(preset="kimi-k3", backend="standard")), tmp_path / "a"
    )
    tracer.write_run(
        b.replace(meta=b.meta.replace(preset="tiny", backend="specialized")), tmp_path / "b"
    )
    at = run_app(monkeypatch, tmp_path)  # a folder of run folders
    no_exception(at)
    warnings = texts(at.warning)
    assert any("different presets (kimi-k3 vs tiny)" in w for w in warnings), warnings


def test_a_two_rank_trace_offers_a_rank_and_the_whole_step(monkeypatch):
    at = run_app(monkeypatch, NSYS_2GPU)
    no_exception(at)
    assert at.sidebar.selectbox(key="rank").options == ["0", "1"]
    # no layer ranges: the timeline offers the whole step
    open_view(at, "Timeline")
    assert at.selectbox(key="tl-layer").options == [dashboard.WHOLE_STEP]
    at.sidebar.selectbox(key="rank").set_value(1).run()
    no_exception(at)


def test_upload_of_a_zipped_run_folder_and_of_junk(tmp_path, monkeypatch):
    monkeypatch.setattr(dashboard, "UPLOAD_DIR", tmp_path / "uploads")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for f in H100.iterdir():
            z.write(f, f"myrun/{f.name}")
    path = dashboard.save_upload("myrun.zip", buf.getvalue())
    run, err = dashboard.try_load(dashboard.Entry("upload", path))
    assert err is None and run.kernels.num_rows == tracer.read_run(H100).kernels.num_rows
    junk = dashboard.save_upload("junk.json", b"\x00\x01 definitely not json")
    run, err = dashboard.try_load(dashboard.Entry(dashboard.UPLOADED + "junk.json", junk))
    assert run is None and err.startswith("junk.json (uploaded): unrecognised format")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("readme.txt", "no run here")
    with pytest.raises(TraceError, match="no decodescope run folder"):
        dashboard.save_upload("empty.zip", buf.getvalue())


def test_a_results_dataset_shows_history_with_baseline_and_regression(monkeypatch, tmp_path):
    # three real runs appended to a results dataset under one setup: the H100 run twice (the
    # baseline and a later equal run) and, relabelled into the same setup, the B200 run, whose
    # layer span is 29% longer: the history must mark it as the regression
    from datetime import UTC, datetime

    from decodescope.tracer import dataset

    h100 = tracer.read_run(H100)
    b200 = tracer.read_run(B200)
    same = dict(
        workload="decode-layer", preset="kimi-k3", backend="standard", gpu="H200",
        batch=1, tokens_per_seq=1, tp_shape=8, tp_world=1,
    )  # fmt: skip
    for i, (run, rid) in enumerate(((h100, "base"), (b200, "slower"), (h100, "equal"))):
        meta = run.meta.replace(
            run_id=rid,
            created_at=datetime(2026, 11, 1 + i, tzinfo=UTC),
            git_commit=f"c{i}",
            **same,
        )
        dataset.append_run(run.replace(meta=meta), tmp_path / "results")
    at = run_app(monkeypatch, tmp_path / "results")
    no_exception(at)
    assert at.sidebar.selectbox(key="run-a").options[0].startswith("0: standard")
    open_view(at, "History")
    no_exception(at)
    assert at.selectbox(key="h-base").value == "base"
    fig = at.get("plotly_chart")[0].proto.spec
    assert '"regression"' in fig and '"baseline"' in fig
    assert not at.error, texts(at.error)  # a regression is a finding, not a page error
    warnings = texts(at.warning)
    assert any("1 run(s) regressed" in w for w in warnings), warnings
    assert any("`slower`" in m for m in texts(at.markdown)), texts(at.markdown)
    # judged by share (one stream, no early starts: share = span here): the same finding
    assert at.selectbox(key="h-check").value == "span"
    at.selectbox(key="h-check").set_value("share").run()
    no_exception(at)
    assert any("1 run(s) regressed" in w for w in texts(at.warning)), texts(at.warning)
    assert any("share (us)" in m for m in texts(at.markdown)), texts(at.markdown)


def test_the_command_passes_its_sources_and_port(capsys):
    from decodescope.ui.cli import main

    main(["dashboard", str(H100), str(NSYS_2GPU), "--port", "8599", "--print-command"])
    out = capsys.readouterr().out
    assert f"{dashboard.SOURCES_ENV}='{H100}{os.pathsep}{NSYS_2GPU}'" in out
    assert "--server.port 8599" in out and str(APP) in out


def test_the_command_rejects_a_missing_source(capsys, tmp_path):
    from decodescope.ui.cli import main

    with pytest.raises(SystemExit) as e:
        main(["dashboard", str(tmp_path / "nope")])
    assert e.value.code == 2
    assert "no such file or directory" in capsys.readouterr().err


def test_the_default_pair_is_standard_vs_specialized_of_one_setup():
    h100 = tracer.read_run(H100)

    def run(backend, batch):
        return h100.replace(meta=h100.meta.replace(backend=backend, batch=batch, preset="kimi-k3"))

    runs = [run("specialized", 1), run("standard", 64), run("specialized", 64), run("other", 1)]
    assert dashboard.default_pair(runs) == (1, 2)
    assert dashboard.default_pair([run("other", 1), run("other", 1)]) == (0, 1)
    # of several pairs, batch 1 (the reference's per-layer figure) comes first
    pairs = [run("standard", 1), run("specialized", 1), run("standard", 64), run("specialized", 64)]
    assert dashboard.default_pair(pairs) == (0, 1)
    assert dashboard.default_pair([run("other", 1)]) == (0, 0)
    # a later specialized run captured with kernel knobs (an A/B run) is not the default B
    knob = run("specialized", 1)
    knob = knob.replace(meta=knob.meta.replace(config_json='{"knobs": {"DECODESCOPE_X": "1"}}'))
    assert dashboard.default_pair([*pairs, knob]) == (0, 1)
    assert dashboard.default_pair([run("standard", 1), knob]) == (0, 1)  # none of the defaults
    # no standard run: A is the first run, B another specialized run (a knob A/B), never A again
    assert dashboard.default_pair([run("specialized", 1), knob]) == (0, 1)
    assert dashboard.default_pair([knob, run("specialized", 1)]) == (0, 1)


REAL_TRACES = sorted(p.name for p in TRACES.iterdir() if p.name.startswith(("kineto_", "nsys_")))


@pytest.mark.slow
@pytest.mark.parametrize("trace", REAL_TRACES)
def test_every_real_trace_renders_in_every_view(monkeypatch, trace):
    at = run_app(monkeypatch, TRACES / trace)
    for view in dashboard.VIEWS:
        open_view(at, view)
        no_exception(at)
        assert not at.error, (view, texts(at.error))
    assert texts(at.subheader)


def test_runs_that_measured_bytes_and_bandwidth_show_the_floor(monkeypatch, tmp_path):
    # the real H100 run, with the two figures a capture of ours records (DESIGN.md section 7)
    a = tracer.read_run(H100)
    meta = a.meta.replace(layer_bytes={"layer": 844_000_000}, copy_bw_tbs=4.22)
    tracer.write_run(a.replace(meta=meta), tmp_path / "a")
    at = run_app(monkeypatch, tmp_path / "a", B200)
    no_exception(at)
    assert any(m.startswith("**Bytes floor**") for m in texts(at.markdown))
    floor = at.dataframe[-1].value
    row = floor[floor["run"] == "A"].iloc[0]
    assert row["floor_us"] == pytest.approx(200.0)  # 844 MB at 4.22 TB/s
    assert row["efficiency"] == pytest.approx(row["span_us"] / 200.0)
    assert list(floor["run"]) == ["A"]  # B measured neither


def test_a_dataset_folder_is_walked_once_per_page_run(monkeypatch, tmp_path):
    """The caches' stamp of a dataset (the newest Parquet file) is asked for once per run of
    it: the folder is walked once within ``STAMP_TTL_S``, again after it (a page of the 346
    committed runs took 60 s walking it for each), and a new file moves the stamp then."""
    ds = tmp_path / "ds"
    (ds / "runs" / "run_id=a").mkdir(parents=True)
    (ds / "runs" / "run_id=a" / "part-0.parquet").write_bytes(b"x")
    walks = []
    real = Path.rglob

    def counting(self, pattern):
        walks.append(str(self))
        return real(self, pattern)

    monkeypatch.setattr(Path, "rglob", counting)
    clock = [100.0]
    monkeypatch.setattr(dashboard.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(dashboard, "_FOLDER_STAMPS", {})
    first = dashboard._stamp(f"{ds}#a")
    assert [dashboard._stamp(f"{ds}#{r}") for r in "abc"] == [first] * 3
    assert walks == [str(ds)]
    new = ds / "runs" / "run_id=b"
    new.mkdir()
    (new / "part-0.parquet").write_bytes(b"y")
    os.utime(new / "part-0.parquet", (first + 10, first + 10))
    clock[0] += dashboard.STAMP_TTL_S + 0.1
    assert dashboard._stamp(f"{ds}#b") == first + 10 and len(walks) == 2


def test_a_knob_ab_names_the_knob(monkeypatch, tmp_path):
    """Two committed H200 runs of one call that differ by a kernel knob (session 18, TP8 batch 1:
    the default against ``DECODESCOPE_MLA_SPLIT_EARLYABS=1``): the page says which knob differs,
    and the verdict gives the layers' share beside their span."""
    from decodescope import tracer
    from decodescope.tracer.store import write_run

    dirs = []
    for name, rid in (("default", "specialized-20261202T071635"),
                      ("earlyabs", "specialized-20261202T071558")):  # fmt: skip
        dirs.append(write_run(tracer.load(f"{dashboard.RESULTS_DATA}@{rid}"), tmp_path / name))
    at = run_app(monkeypatch, *dirs)
    no_exception(at)
    caption = " ".join(texts(at.caption))
    assert "DECODESCOPE_MLA_SPLIT_EARLYABS unset" in caption
    assert "DECODESCOPE_MLA_SPLIT_EARLYABS=1" in caption
    assert any("MLA layer" in m and "by share 113 -> 112 us" in m for m in texts(at.markdown))


def test_a_chunked_pair_and_other_shapes_say_so(monkeypatch, tmp_path):
    """Session 19's TP8 runs (one call): the standard 32 x 8 verify step against the specialized
    one, which ran in 4 chunks of 64 tokens: the page says the chunking; and the specialized
    32 x 1 step against the standard 32 x 8 one: the page warns that the two ran different
    step shapes."""
    from decodescope import tracer
    from decodescope.tracer.store import write_run

    def folder(name, rid):
        return write_run(tracer.load(f"{dashboard.RESULTS_DATA}@{rid}"), tmp_path / name)

    std = folder("std", "standard-20261202T100136")
    spec = folder("spec", "specialized-20261202T100146")
    at = run_app(monkeypatch, std, spec)
    no_exception(at)
    assert "B ran in 4 chunks of 8 sequences (256 tokens per step)" in " ".join(texts(at.caption))
    assert not at.warning
    at = run_app(monkeypatch, std, folder("one", "specialized-20261202T100041"))
    no_exception(at)
    assert any("different step shapes" in w and "tokens_per_seq 8" in w for w in texts(at.warning))


def test_dataset_run_sources_and_labels(monkeypatch):
    """``dashboard results@RUN_ID`` opens that one run of the committed dataset (as every command
    takes it); an unknown id is one line on the page; run labels carry the setup that tells the
    dataset's runs apart (TP shape, batch, tokens per sequence)."""
    ref = f"{dashboard.RESULTS_DATA}@specialized-20261202T094447"
    entries, problems = dashboard.expand(ref)
    assert problems == [] and len(entries) == 1
    assert entries[0].path.endswith("#specialized-20261202T094447-f05766")
    none, why = dashboard.expand(f"{dashboard.RESULTS_DATA}@nope")
    assert none == [] and "no run 'nope' in this dataset" in why[0]
    at = run_app(monkeypatch, ref, f"{dashboard.RESULTS_DATA}@standard-20261202T094440")
    no_exception(at)
    run = tracer.load(ref)
    assert dashboard.run_label(run).startswith(
        "specialized · kimi-k3 · TP8 · batch 1 · NVIDIA H200"
    )
    v8 = tracer.load(f"{dashboard.RESULTS_DATA}@specialized-20261202T100146")
    assert "· batch 32x8 ·" in dashboard.run_label(v8)


def test_dashboard_port_is_checked_before_the_server_starts():
    """A port out of range is refused by the option; a port in use is one line before anything
    is printed or started (synthetic: a socket of this test holds the port)."""
    import socket

    from decodescope.ui.cli import UsageError
    from decodescope.ui.cmd_dashboard import _check_port

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(UsageError, match=f"--port {port}: cannot listen on 127.0.0.1:{port}"):
            _check_port("127.0.0.1", port)
    from decodescope.ui.cli import main

    with pytest.raises(SystemExit) as e:
        main(["dashboard", "--port", "99999", "--print-command"])
    assert e.value.code == 2


def test_charts_of_a_trace_without_layers_say_why(monkeypatch):
    """The nsys RTX 3080 trace (real kernels, no layer ranges): the Charts view says there is
    nothing per layer to draw and points to the Kernels and Timeline views, no empty axes."""
    trace = Path(__file__).resolve().parent / "data" / "traces"
    at = run_app(monkeypatch, trace / "nsys_rtx3080_tiny_full_schema3.24__nsys-ai_mock.sqlite")
    open_view(at, "Charts")
    no_exception(at)
    assert any("no per-layer or per-op charts" in t for t in texts(at.info))
    assert not at.get("plotly_chart")


def test_history_draws_one_setup_at_a_time_in_run_order(monkeypatch):
    """The committed H200 dataset holds runs of many setups (TP8/TP16, batch 1-64, 1 or 8 tokens
    per sequence): the history draws those of one setup (A's by default), the setups offered in
    numeric order, and says how many runs it left out; along commits, the commits are in the
    order of the runs (they were sorted as text: a line jumping between batch 1 and batch 64
    runs, commits in hash order)."""
    import json

    at = run_app(monkeypatch)
    open_view(at, "History")
    no_exception(at)
    assert not at.error, texts(at.error)
    setup = at.selectbox(key="h-setup")
    assert setup.value == ("kimi-k3", "NVIDIA H200", 8, 1, 1, 1)  # A's: TP8 batch 1
    labels = setup.options
    tp8 = [o for o in labels if "· TP8 · batch" in o and "tp_world" not in o]
    assert tp8[:4] == [f"kimi-k3 · NVIDIA H200 · TP8 · batch {b}" for b in (1, 8, 32, 64)], tp8
    assert labels.index(tp8[0]) < labels.index("kimi-k3 · NVIDIA H200 · TP16 · batch 1")
    total = len(dashboard.expand(str(dashboard.RESULTS_DATA))[0])
    note = next(t for t in texts(at.caption) if "are of this setup" in t)
    shown = int(note.split()[0])
    assert f"of the {total} runs" in note and f"other {total - shown} (other setups)" in note
    points = at.dataframe[-1].value
    assert set(points["setup"]) == {"kimi-k3 · NVIDIA H200 · TP8 · batch 1"}
    assert points["run_id"].nunique() == shown
    at.selectbox(key="h-x").set_value("git_commit").run()
    no_exception(at)
    spec = json.loads(at.get("plotly_chart")[0].proto.spec)
    runs = sorted(
        (tracer.load(f"{dashboard.RESULTS_DATA}@{r}") for r in set(points["run_id"])),
        key=lambda r: str(r.meta.created_at),
    )
    commits = list(dict.fromkeys(r.meta.git_commit or "" for r in runs))
    assert spec["layout"]["xaxis"]["categoryarray"] == commits
    assert spec["layout"]["xaxis"]["title"]["text"] == "git commit (in run order)"
    # another setup: its runs only
    at.selectbox(key="h-setup").set_value(("kimi-k3", "NVIDIA H200", 16, 1, 64, 1)).run()
    no_exception(at)
    assert set(at.dataframe[-1].value["setup"]) == {"kimi-k3 · NVIDIA H200 · TP16 · batch 64"}


def test_history_of_a_dataset_with_a_run_without_layers(monkeypatch, tmp_path):
    """A results dataset of real imported traces where one run has no layer ranges (the nsys
    RTX 3080 export, relabelled into the H100 run's setup): the history leaves it out and says
    so (the page showed 'ArrowInvalid: Schema at index 2 was different')."""
    from datetime import UTC, datetime

    from decodescope.tracer import dataset

    h100 = tracer.read_run(H100)
    nsys = tracer.load(TRACES / "nsys_rtx3080_tiny_full_schema3.24__nsys-ai_mock.sqlite")
    for i, (run, rid) in enumerate(((h100, "first"), (nsys, "nolayers"), (h100, "again"))):
        meta = run.meta.replace(
            run_id=rid, created_at=datetime(2026, 11, 1 + i, tzinfo=UTC), gpu=h100.meta.gpu,
            preset=None, batch=None, tokens_per_seq=None, tp_shape=None, tp_world=None,
        )  # fmt: skip
        dataset.append_run(run.replace(meta=meta), tmp_path / "results")
    at = run_app(monkeypatch, tmp_path / "results")
    open_view(at, "History")
    no_exception(at)
    assert not at.error, texts(at.error)
    assert any("1 run(s) of this setup are left out" in t and "nolayers" in t
               for t in texts(at.caption)), texts(at.caption)  # fmt: skip
    assert set(at.dataframe[-1].value["run_id"]) == {"first", "again"}
    assert at.get("plotly_chart")


def _spec(at: AppTest, i: int = 0) -> dict:
    import json

    return json.loads(at.get("plotly_chart")[i].proto.spec)


def _axis_titles(spec: dict) -> dict[str, str | None]:
    lay = spec["layout"]
    return {k: (v.get("title") or {}).get("text") for k, v in lay.items() if "axis" in k}


def test_chart_legends_name_the_paths_and_axes_carry_units(monkeypatch):
    """The default view (committed H200 runs, standard vs specialized): every chart's legend
    says which path each side is ("A: standard", "B: specialized", not a bare A / B) and every
    value axis is titled with its unit."""
    at = run_app(monkeypatch)
    open_view(at, "Charts")
    no_exception(at)
    bars, ops = _spec(at, 0), _spec(at, 1)
    assert {t["name"] for t in bars["data"]} == {"A: standard", "B: specialized"}
    assert _axis_titles(bars) == {
        "xaxis": None,  # shared with the row below, which carries the title
        "yaxis": "kernels",
        "xaxis2": "layer (kind, index)",
        "yaxis2": "span (us)",
    }
    assert _axis_titles(ops) == {"xaxis": "layer kind · run", "yaxis": "share of the step (us)"}
    sides = {t["x"][1][0] for t in ops["data"]}  # (layer kind, run) categories
    assert sides == {"A: standard", "B: specialized"}
    open_view(at, "Timeline")
    no_exception(at)
    tl = _spec(at)
    assert [t["name"] for t in tl["data"]] == ["A: standard", "B: specialized"]
    assert _axis_titles(tl) == {
        "xaxis": "us from the layer's first kernel start",
        "yaxis": "run · CUDA stream",
    }


def test_a_side_without_layers_is_said_in_charts_and_timeline(monkeypatch):
    """A: the real H100 Kineto trace (24 layers); B: the real nsys RTX 3080 export (no layer
    ranges). The charts and the timeline draw A alone and say that B is left out and why; the bundled H100 run names its workload, its backend being "other"
    (before, B was silently missing)."""
    rtx = TRACES / "nsys_rtx3080_tiny_full_schema3.24__nsys-ai_mock.sqlite"
    at = run_app(monkeypatch, H100, rtx)
    open_view(at, "Charts")
    no_exception(at)
    assert any(t.startswith("B: nsys has no kernel attributed to a layer: it is left out")
               for t in texts(at.info)), texts(at.info)  # fmt: skip
    assert {t["name"] for t in _spec(at)["data"]} == {"A: hf-qwen1.5-0.5b-chat eager"}
    open_view(at, "Timeline")
    no_exception(at)
    assert any(t.startswith("B: nsys: no kernel in layer 0 in no step") for t in texts(at.info))
    assert [t["name"] for t in _spec(at)["data"]] == ["A: hf-qwen1.5-0.5b-chat eager"]


def test_a_folder_that_is_not_a_run_says_what_it_is(monkeypatch, tmp_path):
    """A folder that holds no run is one line naming it and what it is: not a run folder
    (it said 'empty dataset' for any folder), a folder of traces (name them one by one), a
    dataset whose runs/ holds no partition; the good source beside them still renders."""
    import shutil

    other = tmp_path / "notes"
    other.mkdir()
    shutil.copy(TRACES / "README.md", other / "README.md")
    traces = tmp_path / "traces"
    traces.mkdir()
    shutil.copy(TRACES / "nsys_rtx3080_tiny_full_schema3.24__nsys-ai_mock.sqlite", traces)
    empty_ds = tmp_path / "ds"
    (empty_ds / "runs").mkdir(parents=True)
    at = run_app(monkeypatch, other, traces, empty_ds, H100)
    no_exception(at)
    errors = texts(at.error)
    assert errors == [
        f"{other}: not a decodescope run folder or results dataset (no runs.parquet, no runs/ "
        "partitions, no run folders in it)",
        f"{traces}: not a run folder or results dataset: name its traces one by one (it holds "
        "1 .json / .json.gz / .sqlite file(s))",
        f"{empty_ds}: empty dataset: it holds no runs (no partitions under runs/)",
    ], errors
    assert texts(at.subheader)  # the good run still renders


def test_timeline_opens_on_the_median_step_with_the_cli_sums(monkeypatch):
    """The default pair's Timeline opens where `decodescope timeline` does (the layer's median
    step, step 14 of 30; it opened on step 0, whose span differs) and its sums are the CLI's
    (analysis.timeline)."""
    from decodescope.analysis import timeline as tl

    at = run_app(monkeypatch)
    open_view(at, "Timeline")
    no_exception(at)
    a = tracer.load(f"{dashboard.RESULTS_DATA}@standard-20261204T031349")
    step = tl.median_step(a.kernels, 0)
    assert at.selectbox(key="tl-step").value == step == 14
    want = tl.summary(tl.layer_timeline(a.kernels, 0, step))
    cap = next(t for t in texts(at.caption) if t.startswith("A: standard: "))
    assert f"{want['kernels']} kernels, span {want['span_us']:.1f} us" in cap, cap


def test_op_floors_show_compute_floors_where_the_run_measured_a_gemm_rate(monkeypatch, tmp_path):
    """The per-op floor table: a run with its GEMM rate (set here on the real TP8 64x8 H200
    run, 700 TFLOP/s: a synthetic rate, the run's kernels are its own) gets each op's FLOPs,
    compute floor and bound; the standard run beside it, which recorded none, the same columns
    empty; the caption names the rate."""
    spec = tracer.load("results@specialized-20261204T182339-6e2c05")
    spec = spec.replace(meta=spec.meta.replace(gemm_tflops=700.0))
    tracer.write_run(spec, tmp_path / "spec")
    tracer.write_run(tracer.load("results@standard-20261204T182332-6d8a10"), tmp_path / "std")
    at = run_app(monkeypatch, tmp_path / "std", tmp_path / "spec")  # "Side by side" opens first
    no_exception(at)
    tables = [d.value for d in at.dataframe if "compute_floor_us" in d.value.columns]
    assert tables, "no op-floor table with compute floors"
    t = tables[-1]
    b = t[t["run"] == "B"]
    back = b[(b["layer_kind"] == "mla") & (b["op"] == "latent_norm+latent_up+add")].iloc[0]
    assert back["bound"] == "compute"
    assert back["compute_floor_us"] == pytest.approx(2 * 512 * 3584 * 7168 / 700e6)
    assert t[t["run"] == "A"]["compute_floor_us"].isna().all()
    assert any("700 TFLOP/s" in c for c in texts(at.caption))
