"""Real H200 captures committed under data/runs/: the capture's output as users get it.

Each run folder under ``data/runs`` is checked (a test per folder; none there, nothing collected).
The lead commits the small runs ``scripts/gpu_capture.py`` writes (toy_eager, toy_graph, ...).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from decodescope.tracer import read_run
from decodescope.tracer.store import is_run_dir

RUNS = Path(__file__).resolve().parent.parent / "data" / "runs"
FOLDERS = sorted(p for p in RUNS.glob("*") if is_run_dir(p)) if RUNS.is_dir() else []
CUPTI = [p for p in FOLDERS if read_run(p).meta.source == "cupti"]


def _ov(run):
    return {r["kind"]: r["count"] for r in run.overheads.to_pylist() if r["count"] is not None}


def _toy_ops():
    return [
        f"layer.{i}.{b}.{o}"
        for i in range(2)
        for b, o, _ in __import__("decodescope.kernels.toy", fromlist=["OPS"]).OPS
    ]


@pytest.mark.parametrize("path", CUPTI, ids=[p.name for p in CUPTI])
def test_records_converted(path):
    run = read_run(path)
    k = run.kernels.to_pylist()
    assert k, "a capture with no kernels"
    for x in k:
        # after a device-side assert CUPTI delivers the kernels it saw with zero timestamps
        assert x["end_ns"] > x["start_ns"] or (run.meta.partial and x["end_ns"] == 0)
        assert x["name"] and x["mangled"]
        assert x["correlation_id"] is not None and x["stream"] is not None
        assert (
            min(x["grid_x"], x["grid_y"], x["grid_z"], x["block_x"], x["block_y"], x["block_z"])
            >= 1
        )
    if not run.meta.partial:  # the crash / hang test programs emit no ranges of their own
        assert run.ranges.num_rows > 0, "NVTX markers never reached CUPTI (NVTX_INJECTION64_PATH?)"
    assert run.ranges.num_rows == 0 or set(run.ranges.column("timeline").to_pylist()) == {"cpu"}


@pytest.mark.parametrize("path", CUPTI, ids=[p.name for p in CUPTI])
def test_dropped_records_accounted(path):
    run = read_run(path)
    assert run.meta.dropped_records is not None
    assert _ov(run).get("dropped_records", 0) == run.meta.dropped_records
    assert not any(kind.startswith("conversion_errors") and n for kind, n in _ov(run).items())


@pytest.mark.parametrize("path", CUPTI, ids=[p.name for p in CUPTI])
def test_attribution_and_steps(path):
    from decodescope.tracer.validate import attributed, check_attribution

    run = read_run(path)
    att = attributed(run)
    steps = sorted({s for s in att.kernels.column("step").to_pylist() if s is not None})
    assert steps == list(range(len(steps))), "steps numbered 0..N-1 without gaps"
    if run.meta.graph_mode == "graph":
        assert _ov(run).get("graph_kernels_unmapped", 0) == 0
        assert run.kernels.column("graph_node_id").null_count == 0
        assert all(
            a == "cudaGraphLaunch" or "GraphLaunch" in a
            for a in run.kernels.column("launch_api").to_pylist()
        )
    else:
        assert _ov(run).get("kernels_without_launch", 0) == 0
    if run.meta.workload == "toy":
        chk = check_attribution(run, _toy_ops())
        assert chk["ok"], chk["problems"]
        apis = {x["launch_api"] for x in att.kernels.to_pylist() if x["op"] in ("gate", "residual")}
        assert None not in apis, "Triton and CuTe DSL launches must join their launch API call"


@pytest.mark.parametrize("path", FOLDERS, ids=[p.name for p in FOLDERS])
def test_chrome_export(path):
    from test_chrome import assert_valid

    from decodescope.tracer.chrome import chrome_trace

    assert_valid(chrome_trace(read_run(path)))
