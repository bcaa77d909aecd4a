"""A chunked verify step's token-parallel ops over all of its rows, on the H200
(``pytest -m gpu tests/test_wide_ops_gpu.py``; ``step.tokens_once``, session 21).

Each piece against its torch reference on fresh random inputs with NaN-poisoned outputs, at
the kimi-k3 TP8 and TP16 shapes and 256 / 512 rows: the RMSNorm of an FP32 input (the MoE
latent sum) and of a strided column slice (MLA's ``q_a``), ``tile_gemm.project_wide`` (the
input projection with its residual add and norm, q_b, o_proj's residual epilogue), and the
MoE block with ``wide=True`` (the cuBLAS front, the grouped experts, the wide back in three
launches and, with ``DECODESCOPE_WIDE_BACK=addmm``, in two) against ``moe_block_ref`` on the
kernels' own routing. The whole step against the standard one is
tests/test_specialized_step_gpu.py's and scripts/gpu_steps.py's.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BF16 = torch.bfloat16


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    if not bool(a.isfinite().all()):
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _gen(seed: int):
    return torch.Generator(device="cuda").manual_seed(seed)


def _randn(g, *shape, std=1.0, dtype=BF16):
    return (torch.randn(shape, generator=g, device="cuda") * std).to(dtype)


@pytest.mark.parametrize("m", [256, 512])
def test_rmsnorm_fp32_and_strided(m):
    from decodescope.kernels.specialized import rmsnorm as rms

    g = _gen(m)
    x = _randn(g, m, 3584, dtype=torch.float32) * (1 + torch.arange(m, device="cuda")[:, None])
    w = (1 + 0.1 * _randn(g, 3584).float()).to(BF16)
    y = torch.full((m, 3584), float("nan"), dtype=BF16, device="cuda")
    rms.rmsnorm(x, w, y, 1e-5)
    torch.cuda.synchronize()
    assert _rel(y, rms.rmsnorm_ref(x, w, 1e-5)) < 4e-3
    a = _randn(g, m, 2112)  # q_a = a[:, :1536], row stride 2112
    wq = (1 + 0.1 * _randn(g, 1536).float()).to(BF16)
    yq = torch.full((m, 1536), float("nan"), dtype=BF16, device="cuda")
    rms.rmsnorm(a[:, :1536], wq, yq, 1e-5)
    torch.cuda.synchronize()
    assert _rel(yq, rms.rmsnorm_ref(a[:, :1536].contiguous(), wq, 1e-5)) < 4e-3


@pytest.mark.parametrize("tp", [8, 16])
@pytest.mark.parametrize("m", [256, 512])
def test_project_wide_equals_refs(tp, m):
    from decodescope.kernels.config import get_config
    from decodescope.kernels.specialized import norm_qkv_proj as nqp
    from decodescope.kernels.specialized import oproj_residual_norm as op

    cfg = get_config("kimi-k3", tp)
    H = cfg.hidden
    g = _gen(10 * tp + m)
    w = {
        "attn_norm": (1 + 0.1 * _randn(g, H).float()).to(BF16),
        "in_proj": _randn(g, cfg.kda_in_proj_out, H, std=H**-0.5),
        "qkv_a": _randn(g, cfg.mla_qkv_a_out, H, std=H**-0.5),
        "g_proj": _randn(g, cfg.mla_v_dim, H, std=H**-0.5),
        "q_a_norm": (1 + 0.1 * _randn(g, cfg.mla.q_lora_rank).float()).to(BF16),
        "q_b": _randn(g, cfg.mla_q_b_out, cfg.mla.q_lora_rank, std=cfg.mla.q_lora_rank**-0.5),
        "o_proj": _randn(g, H, cfg.kda_dim, std=cfg.kda_dim**-0.5),
    }
    x, r = _randn(g, m, H), _randn(g, m, H)

    def nan(*shape):
        return torch.full(shape, float("nan"), dtype=BF16, device="cuda")

    proj, r_mid = nan(m, cfg.kda_in_proj_out), nan(m, H)
    nqp.norm_qkv_proj(cfg, w, "kda", x, r, r_mid, [proj])
    a, gg = nan(m, cfg.mla_qkv_a_out), nan(m, cfg.mla_v_dim)
    nqp.norm_qkv_proj(cfg, w, "mla", x, r, nan(m, H), [a, gg])
    q = nan(m, cfg.mla_q_b_out)
    op.q_b_proj(cfg, w, a, q)
    o = _randn(g, m, cfg.kda_dim)
    r_out = nan(m, H)
    op.oproj_residual(cfg, w, o, r_mid, r_out)
    torch.cuda.synchronize()
    (p_ref,), rm_ref = nqp.norm_qkv_proj_ref(cfg, w, "kda", x, r)
    (a_ref, g_ref), _ = nqp.norm_qkv_proj_ref(cfg, w, "mla", x, r)
    assert _rel(r_mid, rm_ref) < 1e-3
    assert _rel(proj, p_ref) < 1e-2
    assert _rel(a, a_ref) < 1e-2 and _rel(gg, g_ref) < 1e-2
    assert _rel(q, op.q_b_proj_ref(cfg, w, a)) < 1e-2
    assert _rel(r_out, op.oproj_residual_ref(cfg, w, o, r_mid)) < 1e-2


@pytest.mark.parametrize("tp", [8, 16])
@pytest.mark.parametrize("m", [256, 512])
def test_rmsnorm_side_cast(tp, m):
    """``NormPlan.side`` (``DECODESCOPE_WIDE_BACK=addmm``): the latent RMSNorm of the FP32 sum
    as before, and in the same launch the shared sum ``[m, hidden]`` rounded to BF16, equal to
    torch's round-to-nearest-even bit for bit; outputs poisoned."""
    from decodescope.kernels.config import get_config
    from decodescope.kernels.specialized import rmsnorm as rms

    cfg = get_config("kimi-k3", tp)
    L, H = cfg.expert_dim, cfg.hidden
    g = _gen(300 + m + tp)
    x = _randn(g, m, L, std=3.0, dtype=torch.float32)
    w = (1 + 0.1 * _randn(g, L).float()).to(BF16)
    s = _randn(g, m, H, std=5.0, dtype=torch.float32)
    y = torch.full((m, L), float("nan"), dtype=BF16, device="cuda")
    so = torch.full((m, H), float("nan"), dtype=BF16, device="cuda")
    rms.rmsnorm(x, w, y, cfg.eps, side_in=s, side_out=so)
    torch.cuda.synchronize()
    assert _rel(y, rms.rmsnorm_ref(x, w, cfg.eps)) < 4e-3
    assert torch.equal(so, s.to(BF16))


@pytest.mark.parametrize("back", ["add", "addmm"])
@pytest.mark.parametrize("tp", [8, 16])
@pytest.mark.parametrize("m", [256, 512])
def test_wide_moe_block_equals_ref(monkeypatch, tp, m, back):
    """``back``: ``DECODESCOPE_WIDE_BACK`` (``addmm``: the back in two launches, the shared
    sum rounded by the norm launch and added in the GEMM's epilogue)."""
    from decodescope.kernels.config import LayerSpec, get_config
    from decodescope.kernels.specialized import moe_block as mb
    from decodescope.kernels.weights import make_layer_weights

    monkeypatch.setenv("DECODESCOPE_WIDE_BACK", back)
    cfg = get_config("kimi-k3", tp)
    w = make_layer_weights(cfg, LayerSpec(1, "kda", "moe"), seed=tp, device="cuda")
    blk = mb.SpecializedMoE(cfg, w, m, layer=1, device="cuda", wide=True)
    h = _randn(_gen(m + tp), m, cfg.hidden)
    out = torch.full((m, cfg.hidden), float("nan"), dtype=BF16, device="cuda")
    for _ in range(2):  # twice: the route kernel zeroes acc itself (nothing else does)
        blk.acc.fill_(float("nan"))
        blk.forward(h, out)
        torch.cuda.synchronize()
    ref, _ = mb.moe_block_ref(cfg, w, h, topk_ids=blk.topk_ids)
    assert _rel(out, ref) < 1e-2


@pytest.mark.parametrize("tp", [8, 16])
@pytest.mark.parametrize("m", [256, 512])
def test_wide_dense_mlp_equals_ref(tp, m):
    """The dense MLP over all rows (session 22): :mod:`.situ_mul` alone against its reference,
    then ``DenseMLPAllTokens`` (cuBLAS gate_up, SiTU, cuBLAS down) against the chained
    references, outputs poisoned."""
    from decodescope.kernels.config import LayerSpec, get_config
    from decodescope.kernels.specialized import dense_mlp as dm
    from decodescope.kernels.specialized import situ_mul as sm
    from decodescope.kernels.weights import make_layer_weights

    cfg = get_config("kimi-k3", tp)
    g = _gen(100 + m + tp)
    betas = (float(cfg.model.situ_beta), float(cfg.model.situ_linear_beta))
    gu = _randn(g, m, 2 * cfg.dense_inter, std=3.0)
    act = torch.full((m, cfg.dense_inter), float("nan"), dtype=BF16, device="cuda")
    sm.situ_mul(gu, act, betas)
    torch.cuda.synchronize()
    assert _rel(act, sm.situ_mul_ref(gu, betas)) < 2e-3
    w = make_layer_weights(cfg, LayerSpec(0, "kda", "dense"), seed=tp, device="cuda")
    mlp = dm.DenseMLPAllTokens(cfg, w, m, layer=0, device="cuda")
    h = _randn(g, m, cfg.hidden)
    out = torch.full((m, cfg.hidden), float("nan"), dtype=BF16, device="cuda")
    mlp.act.fill_(float("nan"))
    mlp.forward(h, out)
    torch.cuda.synchronize()
    assert _rel(out, dm.dense_mlp_wide_ref(cfg, w, h)) < 1e-2
