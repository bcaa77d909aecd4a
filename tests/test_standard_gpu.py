"""The standard layers on the H200 with the real kernels (Triton, vLLM's ops where they load):
tiny and full TP8 / TP16 shapes against the reference, poisoned outputs, and a CUDA-graph step
that reproduces the eager step. Run there with ``pytest -m gpu tests/test_standard_gpu.py``."""

from __future__ import annotations

import pytest
import torch

from decodescope.kernels import reference as R
from decodescope.kernels.config import get_config
from decodescope.kernels.standard.model import StandardModel, parse_layers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
TOL = 1.5e-2


def _check(preset, tp, kind, batch, T, dtype=torch.float64, **options):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    cfg = get_config(preset, tp, **options)
    specs = parse_layers(cfg, kind)
    m = StandardModel(cfg, specs, batch, T, seed=seed, device="cuda")
    before = {k: v.clone() for k, v in m.states[0].items()}
    m.poison()
    m.step()
    torch.cuda.synchronize()
    x, r, ns, _ = R.layer_ref(
        cfg, specs[0], m.weights[0], before, m.x_in, m.r_in, T,
        topk_ids=m.layers[0].topk_ids, dtype=dtype,
    )  # fmt: skip
    errs = {"x": R.rel_l2(m.x_out, x), "r": R.rel_l2(m.r_out, r)}
    for k, v in ns.items():
        got = m.states[0][k]
        if k == "kv_cache":
            got, v = got[:, cfg.context_len :], v[:, cfg.context_len :]
        errs[k] = R.rel_l2(got, v)
    msg = f"{preset} tp{tp} {kind} B={batch} T={T} seed={seed}: {errs} impl={m.ops.impl}"
    fp8 = cfg.kv_cache_dtype == "fp8_e4m3"  # fp8 rows: a one-ulp flip is ~6% of an element
    assert all(e < (6e-2 if fp8 and k == "kv_cache" else TOL) for k, e in errs.items()), msg
    return m


@pytest.mark.parametrize("kind", ["kda", "mla", "dense"])
@pytest.mark.parametrize("batch, T", [(1, 1), (5, 1), (3, 4)])
def test_tiny_on_gpu(kind, batch, T):
    _check("tiny", 1, kind, batch, T)


@pytest.mark.parametrize("mode", ["fused", "chain"])
def test_tiny_kda_paths_on_gpu(mode):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    cfg = get_config("tiny", 1)
    specs = parse_layers(cfg, "kda")
    m = StandardModel(cfg, specs, 2, 2, seed=seed, device="cuda", kda_mode=mode)
    before = {k: v.clone() for k, v in m.states[0].items()}
    m.step()
    x, _, _, _ = R.layer_ref(
        cfg, specs[0], m.weights[0], before, m.x_in, m.r_in, 2, topk_ids=m.layers[0].topk_ids
    )
    assert R.rel_l2(m.x_out, x) < TOL, (mode, seed, m.ops.impl)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [8, 16])
@pytest.mark.parametrize("kind", ["kda", "mla"])
@pytest.mark.parametrize("batch, T", [(1, 1), (8, 2)])
def test_full_shapes_one_layer(tp, kind, batch, T):
    m = _check("kimi-k3", tp, kind, batch, T, dtype=torch.float32)
    impl = m.ops.impl
    # the kernels that must be ours or vLLM's on the H200, never the torch fallback
    for op in ("moe.routed_experts", "moe.act_and_mul", "residual_norm"):
        assert impl.get(op, "").startswith(("triton", "vllm")), impl
    attn = "attn.mla_decode" if kind == "mla" else (
        "attn.fused_kda_decode" if tp == 8 else "attn.kda_chain"
    )  # fmt: skip
    assert impl.get(attn, "").startswith("triton"), impl


@pytest.mark.parametrize("preset, tp", [("tiny", 1), ("kimi-k3", 8)])
def test_fp8_latent_cache(preset, tp):
    m = _check(preset, tp, "mla", 3, 2, dtype=torch.float32, kv_cache_dtype="fp8_e4m3")
    assert m.states[0]["kv_cache"].dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("tp", [8, 16])
def test_full_shapes_mxfp4_experts(tp):
    m = _check("kimi-k3", tp, "kda", 4, 1, dtype=torch.float32, expert_dtype="mxfp4")
    assert m.ops.impl["moe.routed_experts(mxfp4 w4a16)"].startswith("triton"), m.ops.impl


@pytest.mark.parametrize("preset, tp", [("tiny", 1), ("kimi-k3", 16)])
def test_cuda_graph_step_equals_eager(preset, tp):
    cfg = get_config(preset, tp)
    m = StandardModel(cfg, parse_layers(cfg, "kda,mla"), 2, 1, seed=11, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        m.step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        m.step()
    saved = [{k: v.clone() for k, v in st.items()} for st in m.states]
    m.step()
    torch.cuda.synchronize()
    eager = m.x_out.clone()
    eager_state = [{k: v.clone() for k, v in st.items()} for st in m.states]
    for st, sv in zip(m.states, saved, strict=True):
        for k in st:
            st[k].copy_(sv[k])
    m.x_out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert R.rel_l2(m.x_out, eager) < 1e-3
    for st, es in zip(m.states, eager_state, strict=True):
        for k in st:
            assert R.rel_l2(st[k].float(), es[k].float()) < 1e-3, k
