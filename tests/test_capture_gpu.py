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
