"""Specialized LatentMoE kernels on the H200 (``pytest -m gpu``): each kernel against its torch
reference, the block against the float32 reference of the math and against the standard path's
MoE block; fresh random inputs, outputs poisoned first; 1, 8, 32 and 64 tokens (the MoE is
token-wise, so 1+7 tokens per sequence is the 8-token case: batch 1 x 8 rows), TP8 and TP16
shapes and the tiny preset. The checks themselves live in ``scripts/gpu_specialized_moe.py``
(the lead's one-call script), so the test and the script cannot drift apart."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_specialized_moe.py"


def _script():
    spec = importlib.util.spec_from_file_location("gpu_specialized_moe", _SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def gsm():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return _script()


@pytest.mark.parametrize("variant", ["pipe", "old"])
@pytest.mark.parametrize("preset,tp", [("tiny", 1), ("kimi-k3", 8), ("kimi-k3", 16)])
@pytest.mark.parametrize("n_tokens", [1, 8, 32, 64])
def test_specialized_moe_block(gsm, preset, tp, n_tokens, variant, monkeypatch):
    from decodescope.kernels.config import LayerSpec, get_config
    from decodescope.kernels.specialized.moe_block import SpecializedMoE
    from decodescope.kernels.weights import make_layer_weights

    monkeypatch.setenv("DECODESCOPE_MOE_EXPERTS", variant)  # the expert kernel under test
    cfg = get_config(preset, tp)
    w = make_layer_weights(cfg, LayerSpec(1, "kda", "moe"), seed=n_tokens, device="cuda")
    blk = SpecializedMoE(cfg, w, n_tokens)
    gsm.RESULTS.clear()
    for draw in range(2):
        ctx = {"preset": preset, "tp": tp, "tokens": n_tokens, "draw": draw, "experts": variant}
        gsm.run_checks(cfg, w, blk, n_tokens, ctx, seed=7 * n_tokens + draw)
    bad = [r for r in gsm.RESULTS if r.get("status") in ("FAIL", "error")]
    assert not bad, bad


@pytest.mark.parametrize("fold", ["0", "1"])
@pytest.mark.parametrize("tp", [8, 16])
@pytest.mark.parametrize("n_tokens", [1, 4, 16])
def test_front_norm_fold(gsm, tp, n_tokens, fold, monkeypatch):
    """The front with the post-attention RMSNorm in it (``front_norm``), the prologue form and
    the folded one (``DECODESCOPE_FRONT_NORM_FOLD=1``: squares beside the MMAs, rstd in the
    epilogue) against vLLM's RMSNorm then the GEMM; each token's row scaled 0.2x-3x so that an
    rstd taken from the wrong row shows; ``y`` poisoned; then a CUDA-graph replay on new rows."""
    from decodescope.kernels.config import LayerSpec, get_config
    from decodescope.kernels.specialized import front_mma as fm
    from decodescope.kernels.specialized import router_topk as rt
    from decodescope.kernels.specialized.moe_block import SpecializedMoE
    from decodescope.kernels.weights import make_layer_weights

    monkeypatch.setenv("DECODESCOPE_FRONT_NORM_FOLD", fold)
    cfg = get_config("kimi-k3", tp)
    w = make_layer_weights(cfg, LayerSpec(1, "kda", "moe"), seed=n_tokens, device="cuda")
    blk = SpecializedMoE(cfg, w, n_tokens)
    g = torch.Generator(device="cuda").manual_seed(100 * tp + n_tokens)
    scale = torch.linspace(0.2, 3.0, n_tokens, device="cuda")[:, None]

    def rows():
        return (torch.randn(n_tokens, cfg.hidden, device="cuda", generator=g) * scale).to(
            torch.bfloat16
        )

    def rel(ref):
        return float(((blk.y_front - ref).norm(dim=1) / ref.norm(dim=1)).max())

    def check(r):
        h_ref, _ = rt.residual_norm_ref(r, torch.zeros_like(r), w["mlp_norm"], cfg.eps)
        assert torch.isfinite(blk.y_front).all()
        assert rel(rt.front_gemv_ref(h_ref, blk.w_front)) < 5e-3  # vLLM's roundings
        if fold == "1":  # its own rounding points: only the FP32 summation order differs
            assert rel(fm.front_fold_ref(r, w["mlp_norm"], blk.w_front, cfg.eps)) < 1e-4

    r = rows()
    blk.y_front.fill_(float("nan"))
    blk.front_norm(r)
    torch.cuda.synchronize()
    check(r)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        blk.front_norm(r)
    for _ in range(2):
        r.copy_(rows())
        blk.y_front.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(r)
