"""scripts/gpu_tile_gemm.py on the CPU, as far as it goes without a GPU: one child per GEMM runs
its checks and its timing phase in this process with the kernel replaced by a torch model of
its math (``tile_gemm`` -> the reference's rounding, the folded norm by its own formula), CUDA
graph timing by a constant and the device by the CPU. What it catches: the script's own
Python (names, the job lists, the lambdas' bound arguments, the table); not the kernels.
"""

from __future__ import annotations

import contextlib
import json
import sys
import types

import pytest

torch = pytest.importorskip("torch")

from tile_fakes import fake_tile_gemm, load_script  # noqa: E402

from decodescope.kernels import specialized  # noqa: E402,F401  (sets CUTE_DSL_ARCH first)
from decodescope.kernels.specialized import splitk_gemm as sk  # noqa: E402
from decodescope.kernels.specialized import tile_gemm as tg  # noqa: E402


class _Barrier:
    def wait(self, timeout=None):
        return 0

    def abort(self):
        pass


@pytest.mark.parametrize("name", ["q_b", "o_proj", "qkv_a_g"])
def test_child_checks_and_timing_on_cpu(monkeypatch, tmp_path, name):
    mod = load_script("gpu_tile_gemm")
    monkeypatch.setattr(tg, "tile_gemm", fake_tile_gemm)
    monkeypatch.setattr(tg, "norm_launch", lambda *a, **k: None)
    monkeypatch.setattr(sk, "project", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    cpu = torch.device("cpu")
    monkeypatch.setattr(torch, "device", lambda *a, **k: cpu)
    monkeypatch.setattr(mod, "graph_time_us", lambda fns, replays: (1.0, 1.0, 1.0))
    from decodescope.kernels import bandwidth

    monkeypatch.setattr(bandwidth, "copy_bandwidth_tbs", lambda: 4.0)
    # the standard path's q_b row calls a Triton norm (no triton here): a stand-in module
    fake_tk = types.ModuleType("decodescope.kernels.standard.triton_kernels")
    fake_tk.rmsnorm2 = lambda *a, **k: None
    monkeypatch.setitem(sys.modules, fake_tk.__name__, fake_tk)
    monkeypatch.setattr(mod, "CHECK_MS", (8, 33))  # CPU time: fewer and smaller checks
    monkeypatch.setattr(mod, "L2_BYTES", 1)  # two weight copies
    ms = [8] if name == "qkv_a_g" else [8, 32, 64]  # qkv_a_g: 52 MB per weight copy
    out = tmp_path / f"child_{name}.json"
    a = {"tp": 8, "ms": ms, "replays": 3, "no_timing": False, "budget": 100,
         "no_base_variants": True}  # fmt: skip
    mod.child(name, a, contextlib.nullcontext(), _Barrier(), str(out))
    res = json.loads(out.read_text())
    bad = [r for r in res if r.get("status") in ("FAIL", "error")]
    assert not bad, bad
    times = [r for r in res if r.get("status") == "time"]
    whats = {r["what"] for r in times}
    if name == "q_b":
        assert any(w.startswith("fold plan") for w in whats)
        assert any(w.startswith("fold ldsm") for w in whats)
        assert "standard: triton rmsnorm2 + cuBLAS (2 launches)" in whats
    if name == "o_proj":
        assert any(w.startswith("tile hoist ldsm") for w in whats)
        assert {r["M"] for r in times if r["what"].startswith("tile hoist ldsm (")} == {8, 32, 64}
        assert any(w.startswith("tile nohoist noldsm") for w in whats)
    if name == "qkv_a_g":  # the residual fold
        assert any(w.startswith("fold plan") for w in whats)
    assert "checks:" in mod.table(res)
