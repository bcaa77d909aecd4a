"""scripts/gpu_tma_gemm.py on the CPU, as far as it goes without a GPU: the kernel replaced by
its torch reference (written into the output it was given), CUDA-graph timing by a constant,
the profiler window by nothing and the device by the CPU. What it catches: the script's own
Python (the shapes, the sweep's tilings and their plans, the packed copies, the lambdas' bound
arguments, the table and the JSON); not the kernel.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from tile_fakes import load_script  # noqa: E402

from decodescope.kernels import specialized  # noqa: E402,F401  (sets CUTE_DSL_ARCH first)
from decodescope.kernels.specialized import tma_gemm as tm  # noqa: E402


def _fake_tma_gemm(x, w, out, e=None, **kw):
    """The kernel's contract on the CPU: the packed weight unpacked first (the plan is still
    built, so a bad tiling raises as it would on the GPU)."""
    n = out.shape[1]
    p = tm.plan(x.shape[0], x.shape[1], n, residual_epilogue=e is not None, **kw)
    if p.packed:
        rt, kt = p.row_tiles, p.kt
        w = w.view(rt, kt, p.bm, tm.BK).permute(0, 2, 1, 3).reshape(rt * p.bm, -1)[:n]
    out.copy_(tm.tma_gemm_ref(x, w, e))


@pytest.mark.parametrize("profile", [False, True])
def test_sweep_on_cpu(monkeypatch, tmp_path, profile):
    mod = load_script("gpu_tma_gemm")
    monkeypatch.setattr(mod, "DEV", "cpu")
    monkeypatch.setattr(mod, "L2_BYTES", 1)  # two weight copies
    monkeypatch.setattr(tm, "tma_gemm", _fake_tma_gemm)
    monkeypatch.setattr(mod, "graph_time_us", lambda fns, replays: (2.0, 1.0, 3.0))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda.profiler, "start", lambda: None)
    monkeypatch.setattr(torch.cuda.profiler, "stop", lambda: None)
    from decodescope.kernels import bandwidth

    monkeypatch.setattr(bandwidth, "copy_bandwidth_tbs", lambda: 4.0)
    out = tmp_path / "tma"
    argv = ["--out", str(out), "--tp", "16", "--tokens", "32", "--ops", "o_proj", "down",
            "--sweep"] + (["--profile"] if profile else [])  # fmt: skip
    assert mod.main(argv) == 0
    res = json.loads((out / "tma_gemm.json").read_text())
    rows = res["rows"]
    assert res["copy_tbs"] == 4.0
    tma = [r for r in rows if r["status"] != "cublas"]
    assert tma and all(r["status"] == "PASS" and r["err"] < 1e-2 for r in tma)
    # every sweep tiling that fits the op ran: o_proj (k 768) all of them, down (k 2112) too
    assert len(tma) == 2 * len(mod.SWEEP)
    assert {r["op"] for r in rows if r["status"] == "cublas"} == {"o_proj", "down"}
    assert any(r["packed"] for r in tma) and any(r["wsp"] for r in tma)
    table = (out / "table.md").read_text()
    assert "| 16 | o_proj | 32 | tma-cl |" in table and "| cuBLAS |" in table
    if profile:
        assert all(r["us"] is None for r in rows)
    else:
        assert all(r["us"] == 2.0 for r in rows)
