"""GPU checks of the specialized attention kernels (run on the H200: ``pytest -m gpu``).

Each kernel vs its torch reference and the attention half vs the standard path's, on fresh
random inputs with NaN-poisoned outputs, at batch 1, 8, 32, 64 and 1+7 tokens per sequence,
kimi-k3 TP8 and TP16 shapes. The same checks (plus timing) run in one go from
``scripts/gpu_specialized_attn.py``; this file reuses its check functions.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

POINTS = ["1x1", "8x1", "32x1", "64x1", "1x8", "8x8"]
SHAPES = [("kimi-k3", 8), ("kimi-k3", 16), ("tiny", 1)]


def _script():
    path = Path(__file__).resolve().parents[1] / "scripts" / "gpu_specialized_attn.py"
    spec = importlib.util.spec_from_file_location("gpu_specialized_attn", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def g():
    return _script()


_WEIGHTS: dict = {}


def _weights(g, preset, tp, label):
    from decodescope.kernels.config import LayerSpec, get_config
    from decodescope.kernels.weights import make_layer_weights

    kind = "kda" if label == "kda" else "mla"
    key = (preset, tp, kind)
    if key not in _WEIGHTS:
        _WEIGHTS.clear()  # one layer's weights at a time (MoE weights are GBs)
        torch.cuda.empty_cache()
        cfg = get_config(preset, tp)
        spec = LayerSpec(3 if kind == "kda" else 7, kind, "moe")
        _WEIGHTS[key] = (cfg, spec, make_layer_weights(cfg, spec, 0, g.DEV))
    cfg, spec, w = _WEIGHTS[key]
    if label == "mla-fp8":
        cfg = get_config(preset, tp, kv_cache_dtype="fp8_e4m3")
    return cfg, spec, w


@pytest.mark.parametrize("preset,tp", SHAPES)
@pytest.mark.parametrize("label", ["kda", "mla", "mla-fp8"])
@pytest.mark.parametrize("point", POINTS)
def test_attention_half(g, preset, tp, label, point):
    from decodescope.kernels.weights import make_state

    cfg, spec, w = _weights(g, preset, tp, label)
    kind = spec.attn
    B, T = (int(v) for v in point.split("x"))
    ctx = {"preset": preset, "tp": tp, "kind": label, "point": point}
    state = make_state(cfg, spec, B, T, seed=B * 10 + T, device=g.DEV)
    n0 = len(g.RESULTS)
    torch.manual_seed(B * 100 + T)
    g.check_kernels(cfg, kind, w, state, B, T, ctx)
    g.check_layer(cfg, spec, w, state, B, T, ctx, std_ok=True)
    bad = [r for r in g.RESULTS[n0:] if r.get("status") in ("FAIL", "error")]
    assert not bad, "\n".join(
        f"{r.get('check')}: {r.get('rel_l2', '')} {r.get('error', '')}" for r in bad
    )
