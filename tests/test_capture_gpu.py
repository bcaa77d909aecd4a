"""The real capture on a GPU (run on the H200: ``pytest -m gpu tests/test_capture_gpu.py``).

``scripts/gpu_capture.py`` runs the same checks and more in one call, printing a table.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def _toy_ops():
    from decodescope.kernels.toy import reference_ops

    return [name for _, _, name, _ in reference_ops(2)]


def _ov(run):
    return {r["kind"]: r["count"] for r in run.overheads.to_pylist() if r["count"] is not None}


def test_toy_eager(tmp_path):
    from decodescope.tracer.capture import run_capture
    from decodescope.tracer.validate import check_attribution

    res = run_capture(
        {"workload": "toy", "graph": False, "steps": 5, "warmup": 2},
        out=tmp_path / "r",
        timeout=300,
    )
    assert res.ok, res.message
    run = res.run
    assert run.ranges.num_rows > 0, "NVTX markers did not reach CUPTI"
    chk = check_attribution(run, _toy_ops())
    assert chk["ok"], chk["problems"]
    assert _ov(run).get("kernels_without_launch", 0) == 0
    assert run.meta.dropped_records == 0 and run.meta.partial is False


def test_toy_graph_replays(tmp_path):
    from decodescope.tracer.capture import run_capture
    from decodescope.tracer.validate import check_attribution

    res = run_capture(
        {"workload": "toy", "graph": True, "steps": 10, "warmup": 2},
        out=tmp_path / "r",
        timeout=300,
    )
    assert res.ok, res.message
    run = res.run
    assert run.kernels.column("graph_node_id").null_count == 0
    assert _ov(run).get("graph_kernels_unmapped", 0) == 0
    chk = check_attribution(run, _toy_ops())
    assert chk["ok"] and chk["steps"] == 10, chk["problems"]


PROG = """
import torch
x = torch.randn(1, 256, device="cuda"); w = torch.randn(256, 256, device="cuda")
def body():
    torch.cuda.nvtx.range_push("mine"); y = torch.relu(x @ w); torch.cuda.nvtx.range_pop()
    return y
for _ in range(2): body()
s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s): body()
torch.cuda.current_stream().wait_stream(s)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g): body()
for _ in range(4): g.replay()
torch.cuda.synchronize()
"""


def test_program_foreign_nvtx_under_graph(tmp_path):
    from decodescope.tracer.capture import run_capture

    prog = tmp_path / "prog.py"
    prog.write_text(PROG)
    res = run_capture(
        {"program": True}, out=tmp_path / "r", timeout=300, command=["python", str(prog)]
    )
    assert res.ok, res.message
    k = res.run.kernels.to_pylist()
    graph = [x for x in k if x["graph_node_id"] is not None]
    assert graph and all(x["range_path"] == "mine" for x in graph)


GRAPH_TRACE_PROG = """
import json, sys, tempfile, torch
from decodescope.analysis.schema import RunMeta
from decodescope.kernels.toy import make_toy
from decodescope.tracer import cupti_records as cr
from decodescope.tracer import range as trange
from decodescope.tracer.capture import ACTIVITY_KINDS, Session, read_chunks

wl = make_toy()
side = torch.cuda.Stream(); side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    for _ in range(2): wl.step()
torch.cuda.current_stream().wait_stream(side); torch.cuda.synchronize()
s = Session(tempfile.mkdtemp(), kinds=(*ACTIVITY_KINDS, "GRAPH_TRACE")).start()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g), trange("step"):
    wl.step()
torch.cuda.synchronize()
for _ in range(5): g.replay()          # graph-level: one record per launch
with trange("step"): wl.step()         # an eager step keeps its kernel records
torch.cuda.synchronize()
late = s.enable_kind("GRAPH_TRACE")    # refused while running (it crashed cuGraphLaunch)
s.stop()
raw = read_chunks(s.out)
run = cr.assemble(raw, RunMeta(run_id="gt", source="cupti"))
k = run.kernels.to_pylist()
print(json.dumps({
    "late": late, "errors": s.errors,
    "graph_kernels": sum(x["graph_node_id"] is not None for x in k),
    "eager_kernels": sum(x["graph_node_id"] is None for x in k),
    "graph_ranges": [r["end_ns"] - r["start_ns"] for r in run.ranges.to_pylist()
                     if r["timeline"] == "gpu"],
}))
"""


def test_graph_trace_from_the_start(tmp_path):
    """GRAPH_TRACE asked for at start: one record per graph launch and no kernel records for
    the replays, eager kernels still traced; a late enable_kind is refused. Its own process."""
    import json
    import subprocess
    import sys

    prog = tmp_path / "gt.py"
    prog.write_text(GRAPH_TRACE_PROG)
    r = subprocess.run([sys.executable, str(prog)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["late"] is False, got
    assert got["eager_kernels"] > 0 and got["graph_kernels"] == 0, got
    assert len(got["graph_ranges"]) == 5 and all(d > 0 for d in got["graph_ranges"]), got
