"""scripts/gpu_wgmma_gemm.py on the CPU, as far as it goes without a GPU (``--device cpu``): the
kernels are replaced by torch models of their math (``tile_gemm`` by the reference's rounding
points, the folded norm by its formula, ``back_tile`` by ``back_tile_ref``), the CUDA-graph
timing and the copy bandwidth by constants. What it catches: the script's own Python (the
cases, the checks' references and tolerances, the lambdas' bound arguments, the table and the
exit code); not the kernels, which the H200 runs check (notes/gpu-logs/s23/w1).
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from tile_fakes import fake_tile_gemm, load_script  # noqa: E402

from decodescope.kernels import bandwidth, timing  # noqa: E402
from decodescope.kernels.specialized import back_tile as bt  # noqa: E402
from decodescope.kernels.specialized import tile_gemm as tg  # noqa: E402


def fake_back_tile(acc, nw, up, sh, out, eps, **kw):
    sp = bt.plan_for(acc.shape[0], acc.shape[1], up.shape[0], eps).tile.splits
    out.copy_(bt.back_tile_ref(acc, nw, up, sh, eps, splits=sp))


def test_dry_run(tmp_path, monkeypatch):
    mod = load_script("gpu_wgmma_gemm")
    monkeypatch.setattr(mod, "L2_BYTES", 2**20)  # few weight copies on the CPU
    monkeypatch.setattr(tg, "tile_gemm", fake_tile_gemm)
    monkeypatch.setattr(bt, "back_tile", fake_back_tile)
    monkeypatch.setattr(timing, "graph_time_us", lambda fns, replays: (1.5, 1.0, 2.0))
    monkeypatch.setattr(bandwidth, "copy_bandwidth_tbs", lambda: 4.0)
    out = tmp_path / "w"
    rc = mod.main(["--out", str(out), "--tp", "16", "--ms", "64", "--cases", "front", "back",
                   "q_b", "o_proj", "--device", "cpu", "--replays", "3"])  # fmt: skip
    rows = json.loads((out / "results.json").read_text())
    checks = [r for r in rows if r["what"] == "check"]
    assert rc == 0, [r for r in checks if r["status"] != "PASS"]
    # 1, 33, 64 tokens x both paths for the tile cases; 33 and 64 for the back tile
    assert len(checks) == 3 * 2 * 3 + 2 * 2
    times = [r for r in rows if r["what"] == "time"]
    assert {r["case"] for r in times} == {"front", "back", "q_b", "o_proj"}
    assert all(r["mma_us"] == r["wgmma_us"] == 1.5 for r in times)
    front = next(r for r in times if r["case"] == "front")
    assert front["floor_us"] == pytest.approx((5248 * 7168 * 2 + 64 * 7168 * 2) / 4e12 * 1e6,
                                              rel=1e-3)  # fmt: skip
    assert "| 16 | back | 64 | 1.5 | 1.5 |" in (out / "table.md").read_text()
