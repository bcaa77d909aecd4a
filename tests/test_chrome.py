"""Chrome-trace export: valid JSON that Perfetto's importer accepts without dropping slices."""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from pathlib import Path

import pytest

from decodescope.analysis.schema import RunMeta
from decodescope.tracer import cupti_records as cr
from decodescope.tracer.chrome import chrome_trace, write_chrome_trace
from decodescope.tracer.errors import TraceError

TRACES = Path(__file__).parent / "data" / "traces"


def _graph_run():
    from test_capture_cpu import _graph_raw

    return cr.assemble(_graph_raw(replays=3), RunMeta(run_id="g", source="cupti"))


def assert_valid(doc):
    """What the JSON importer needs: numbers where numbers go, and slices that nest per track."""
    json.loads(json.dumps(doc))  # plain JSON, no NaN
    tracks = defaultdict(list)
    for e in doc["traceEvents"]:
        assert e["ph"] in ("X", "M")
        assert isinstance(e["pid"], int)
        if e["ph"] == "X":
            assert isinstance(e["tid"], int) and isinstance(e["name"], str)
            assert e["dur"] >= 0 and e["ts"] == e["ts"]  # not NaN
            tracks[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    for spans in tracks.values():
        stack = []
        for s, e in sorted(spans, key=lambda t: (t[0], -t[1])):
            while stack and stack[-1] <= s:
                stack.pop()
            assert not stack or e <= stack[-1] + 1e-9, "slices on one track must nest"
            stack.append(e)
    return tracks


def test_graph_run_tracks_and_projection(tmp_path):
    run = _graph_run()
    doc = chrome_trace(run)
    tracks = assert_valid(doc)
    ev = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert sum(e["cat"] == "kernel" for e in ev) == run.kernels.num_rows
    assert sum(e["cat"] == "range" for e in ev) == run.ranges.num_rows
    gpu = [e for e in ev if e["cat"] == "gpu_range"]
    # per replay: step, 2 layers, 4 ops projected onto the GPU
    assert len(gpu) == 3 * 7
    layer0 = [e for e in gpu if e["name"] == "layer.0:kda"]
    assert [e["args"]["kernels"] for e in layer0] == [2, 2, 2]
    names = {
        e["args"]["name"]
        for e in doc["traceEvents"]
        if e["ph"] == "M" and e["name"] == "process_name"
    }
    assert names == {"CPU", "GPU 0"}
    assert len(tracks) >= 3
    n = write_chrome_trace(run, tmp_path / "t.json.gz")
    assert n == len(ev)
    assert (
        json.loads(gzip.decompress((tmp_path / "t.json.gz").read_bytes()))["otherData"]["run_id"]
        == "g"
    )


@pytest.mark.parametrize("name", ["kineto_h100_qwen1.5-0.5b_hf_eager__TraceLens.json.gz"])
def test_real_imported_trace_exports(tmp_path, name):
    from decodescope.tracer import load

    path = TRACES / name
    if not path.exists():
        pytest.fail(f"bundled trace {name} is missing")
    run = load(path)
    doc = chrome_trace(run)
    assert_valid(doc)
    kernels = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == "kernel"]
    assert len(kernels) == run.kernels.num_rows > 0
    assert any(e["cat"] == "gpu_range" for e in doc["traceEvents"] if e["ph"] == "X")


def test_cli_perfetto(tmp_path):
    from decodescope.tracer import write_run
    from decodescope.ui.cli import main

    write_run(_graph_run(), tmp_path / "run")
    main(["perfetto", str(tmp_path / "run"), "--out", str(tmp_path / "trace.json")])
    assert_valid(json.loads((tmp_path / "trace.json").read_text()))


def test_cli_perfetto_shows_progress_on_a_terminal(tmp_path, monkeypatch):
    """Reading a trace and writing its JSON take seconds on a large trace: on a terminal
    ``perfetto`` shows what it is doing on stderr, as ``import`` and ``report`` do (the B200
    Kineto trace; a console forced to be a terminal stands in for one)."""
    import io

    from rich.console import Console

    from decodescope.ui.cli import main

    buf = io.StringIO()
    term = Console(file=buf, force_terminal=True, width=120)
    monkeypatch.setattr("decodescope.ui.cmd_import.err_console", term)
    monkeypatch.setattr("decodescope.ui.cmd_perfetto.err_console", term)
    trace = TRACES / "kineto_b200_vllm_tp8_rank0_prefill_eager__TraceLens.json.gz"
    out = tmp_path / "trace.json"
    main(["perfetto", str(trace), "--out", str(out)])
    assert f"reading {trace}" in buf.getvalue() and f"writing {out}" in buf.getvalue()
    assert_valid(json.loads(out.read_text()))


def _perfetto_fails(out: Path, capsys) -> str:
    """``decodescope perfetto RUN --out out`` with a bad ``out``: exit 2, one line, no traceback."""
    from decodescope.ui.cli import main

    with pytest.raises(SystemExit) as info:
        main(["perfetto", str(TRACES / "kineto_h100_qwen1.5-0.5b_hf_eager__TraceLens.json.gz"),
              "--out", str(out)])  # fmt: skip
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert info.value.code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert str(out) in lines[0]
    return lines[0]


def test_cli_perfetto_bad_out_leaves_nothing(tmp_path, capsys, monkeypatch):
    (tmp_path / "folder").mkdir()
    assert "is a folder" in _perfetto_fails(tmp_path / "folder", capsys)
    (tmp_path / "file").write_text("x")
    line = _perfetto_fails(tmp_path / "file" / "sub" / "t.json", capsys)
    assert f"{tmp_path / 'file'} is a file" in line
    assert "cannot write" in _perfetto_fails(Path("/proc/decodescope-t.json"), capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "folder"]
    assert list((tmp_path / "folder").iterdir()) == []

    # a write that fails half way (disk full): no temporary file, no folder made for it
    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("decodescope.tracer.chrome.os.replace", full)
    assert "No space left" in _perfetto_fails(tmp_path / "new" / "deeper" / "t.json.gz", capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "folder"]
    with pytest.raises(TraceError, match="No space left"):
        write_chrome_trace(_graph_run(), tmp_path / "folder" / "t.json")
    assert list((tmp_path / "folder").iterdir()) == []


def test_write_chrome_trace_makes_missing_folders(tmp_path):
    out = tmp_path / "a" / "b" / "t.json"
    assert write_chrome_trace(_graph_run(), out) > 0
    assert_valid(json.loads(out.read_text()))
    assert sorted(p.name for p in out.parent.iterdir()) == ["t.json"]
