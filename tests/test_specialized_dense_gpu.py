"""The specialized dense MLP on the H200 (``pytest -m gpu tests/test_specialized_dense_gpu.py``).

1. Each of its two kernels equals its torch reference on fresh random inputs with NaN-poisoned
   outputs, at kimi-k3 TP8 and TP16 shapes, 1, 8 and 64 tokens.
2. The dense layer (``layers="dense"``) and K3's first three layers (``"dense,kda,mla"``) of the
   specialized step equal the standard step (scripts/gpu_steps.py's comparison), eager and
   replayed from a CUDA graph, TP8 batch 1 and 64.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    if not bool(a.isfinite().all()):
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("tp", [8, 16])
@pytest.mark.parametrize("m", [1, 8, 64])
def test_dense_kernels_equal_refs(tp, m):
    from decodescope.kernels.config import get_config
    from decodescope.kernels.specialized import dense_mlp as dm

    cfg = get_config("kimi-k3", tp)
    H, Dn = cfg.hidden, cfg.dense_inter
    g = torch.Generator(device="cuda").manual_seed(100 * tp + m)

    def randn(*shape, std=1.0):
        return (torch.randn(shape, generator=g, device="cuda") * std).bfloat16()

    w = {
        "dense_w13": randn(2 * Dn, H, std=H**-0.5),
        "dense_w2": randn(H, Dn, std=Dn**-0.5),
        "mlp_norm": (1 + 0.1 * randn(H).float()).bfloat16(),
    }
    r = randn(m, H)
    act = torch.full((m, Dn), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = torch.full((m, H), float("nan"), dtype=torch.bfloat16, device="cuda")
    dm.gate_up_act(cfg, w, r, act)
    ref_act = dm.gate_up_act_ref(cfg, w, r)
    dm.down_proj(cfg, w, ref_act, out)  # the down GEMM on the reference's input
    torch.cuda.synchronize()
    assert _rel(act, ref_act) < 1e-2
    assert _rel(out, dm.down_proj_ref(cfg, w, ref_act)) < 5e-3
    if m >= dm.SPLIT_NORM_FROM:  # the split path: its own norm launch, the GEMM without prologue
        from decodescope.kernels.specialized import rmsnorm as rms

        h = torch.full((m, H), float("nan"), dtype=torch.bfloat16, device="cuda")
        act2 = torch.full((m, Dn), float("nan"), dtype=torch.bfloat16, device="cuda")
        rms.rmsnorm(r, w["mlp_norm"], h, cfg.eps)
        dm.gate_up_act(cfg, w, h, act2, norm=False)
        torch.cuda.synchronize()
        assert _rel(h, rms.rmsnorm_ref(r, w["mlp_norm"], cfg.eps)) < 1e-2
        assert _rel(act2, dm.gate_up_act_ref(cfg, w, h, norm=False)) < 1e-2


@pytest.fixture(scope="module")
def g():
    path = Path(__file__).resolve().parents[1] / "scripts" / "gpu_steps.py"
    spec = importlib.util.spec_from_file_location("gpu_steps", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("layers", ["dense", "dense,kda,mla"])
@pytest.mark.parametrize("batch", [1, 64])
def test_dense_step_equals_standard(g, layers, batch):
    rec = g.run_case("kimi-k3", 8, batch, 1, layers, seed=0, draws=2, graph=True)
    print(json.dumps({k: v for k, v in rec.items() if k != "draws"}, default=str))
    bad = [
        f"{d['mode']}: {c['check']} = {c['value']:.3g} (tol {c['tol']})"
        for d in rec.get("draws", [])
        if not d["mode"].endswith("-inconclusive")
        for c in d["checks"]
        if not c["ok"]
    ]
    assert rec["status"] == "PASS", rec.get("error") or "\n".join(bad)
    assert rec["launches"]["layer.0:dense"] == (6 if batch >= 32 else 5)
