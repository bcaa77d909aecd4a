"""The LatentMoE back at one token on the streaming GEMV (:class:`.gemv_stream.GemvStreamBack`,
``DECODESCOPE_MOE_BACK=gemv``).

CPU (CI): the plans compile for sm_90a at 1, 2 and 4 tokens (kimi-k3: latent 3584, hidden
7168), the knob's choice (gemv up to 4 tokens, the default's kernel above), plan validation,
and the PTX issues the weight loads before ``griddepcontrol.wait`` and the routed sum's loads
after it. GPU (``pytest -m gpu``, H200): the kernel against ``up_proj_shared_add_ref`` (the
reference's own rounding, ``bf16(acc * rstd * w)``), NaN-poisoned outputs, tokens of different
scales, then a CUDA graph replayed with fresh inputs.
"""

from __future__ import annotations

import glob
import tempfile

import pytest
import torch

from decodescope.kernels.config import get_config
from decodescope.kernels.specialized import back_mma as bm
from decodescope.kernels.specialized import gemv_stream as gs
from decodescope.kernels.specialized.up_proj_shared_add import up_proj_shared_add_ref

L, H = 3584, 7168


def test_dims_are_kimi_k3():
    cfg = get_config("kimi-k3", 16)
    assert (cfg.expert_dim, cfg.hidden) == (L, H)
    assert get_config("kimi-k3", 8).expert_dim == L  # the latent is not sharded


@pytest.mark.parametrize("T", [1, 2, 4])
def test_back_plans_compile(T):
    p = gs.back_plan(T, L, H, 1e-5)
    assert p.back and p.norm and p.grid * p.cta_rows >= H
    assert gs.compile_back_plan(p) is not None


def test_back_choice(monkeypatch):
    """``DECODESCOPE_MOE_BACK=gemv``: the GEMV at 1..4 tokens, above that what ``auto`` picks;
    unset: BackMma as before."""
    monkeypatch.delenv("DECODESCOPE_MOE_BACK", raising=False)
    assert bm.back_variant(1, L, H) == "mma"
    monkeypatch.setenv("DECODESCOPE_MOE_BACK", "gemv")
    assert [bm.back_variant(T, L, H) for T in (1, 4, 5, 8, 32, 64)] == [
        "gemv", "gemv", "mma", "mma", "tile", "tile",
    ]  # fmt: skip
    assert bm.back_variant(1, 3584 - 32, H) == "mma"  # a latent the GEMV does not serve
    monkeypatch.setenv("DECODESCOPE_MOE_BACK", "nope")
    with pytest.raises(ValueError, match="DECODESCOPE_MOE_BACK"):
        bm.back_variant(1, L, H)


def test_back_plan_validation():
    with pytest.raises(ValueError, match="back needs"):
        gs.GemvPlan(m=1, k=L, segments=(H,), back=True)  # no norm
    with pytest.raises(ValueError, match="back needs"):
        gs.GemvPlan(m=1, k=L, segments=(H, 16), norm=True, back=True)
    with pytest.raises(ValueError, match="back needs"):
        gs.GemvPlan(m=1, k=L - 32, segments=(H,), norm=True, back=True)  # a K tail
    with pytest.raises(ValueError, match="1..4 tokens"):
        acc = torch.zeros(5, L)
        gs.back_gemv(acc, torch.zeros(L, dtype=torch.bfloat16),
                     torch.zeros(H, L, dtype=torch.bfloat16), torch.zeros(5, H),
                     torch.zeros(5, H, dtype=torch.bfloat16), 1e-5)  # fmt: skip


def test_back_ptx_order():
    """Weights before the PDL wait (they never come from the previous kernel), the FP32 routed
    sum and ``shared_out`` after it (the previous kernels write them)."""
    import cutlass.cute as cute

    from decodescope.kernels.specialized import interface as itf
    from decodescope.kernels.specialized.up_proj_shared_add import fake_back_args

    p = gs.back_plan(1, L, H, 1e-5, pdl=True)
    d = tempfile.mkdtemp()
    cute.compile(gs.GemvStreamBack(p), *fake_back_args(1, L, H), itf.env_stream(),
                 options=f"--enable-tvm-ffi --keep-ptx --dump-dir={d}")  # fmt: skip
    (path,) = glob.glob(f"{d}/**/*.ptx", recursive=True)
    with open(path) as f:
        ptx = f.read()
    wait = ptx.index("griddepcontrol.wait")
    assert ptx.count("griddepcontrol.wait") == 1
    loads_before = ptx[:wait].count("ld.global")
    assert loads_before >= p.rows * p.grp * min(p.depth, p.ngroups)  # the first weight groups
    assert "ld.global.v4.f32" in ptx[wait:] or "ld.global.v4.b32" in ptx[wait:]


# -- GPU ---------------------------------------------------------------------------------------


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 4])
@pytest.mark.parametrize("cfg", [None, (4, 4, 2, 2), (16, 1, 4, 2)])
def test_back_gemv_gpu(T, cfg):
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(10 * T + (cfg or (0,))[0])
    eps = get_config("kimi-k3", 16).eps
    scale = torch.logspace(-1, 1, T, device=dev).unsqueeze(1)
    acc = torch.randn(T, L, device=dev, generator=g) * scale
    nw = (1 + 0.1 * torch.randn(L, device=dev, generator=g)).to(torch.bfloat16)
    up = (torch.randn(H, L, device=dev, generator=g) / L**0.5).to(torch.bfloat16)
    sh = torch.randn(T, H, device=dev, generator=g)
    out = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device=dev)
    gs.back_gemv(acc, nw, up, sh, out, eps, cfg=cfg)
    torch.cuda.synchronize()
    ref = up_proj_shared_add_ref(acc, nw, up, sh, eps)
    assert torch.isfinite(out.float()).all() and _rel(out, ref) < 1e-2
    # a CUDA graph replayed on fresh inputs
    out_g = torch.full_like(out, float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gs.back_gemv(acc, nw, up, sh, out_g, eps, cfg=cfg)
    for _ in range(2):
        acc.copy_(torch.randn(T, L, device=dev, generator=g) * scale)
        sh.copy_(torch.randn(T, H, device=dev, generator=g))
        out_g.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = up_proj_shared_add_ref(acc, nw, up, sh, eps)
        assert torch.isfinite(out_g.float()).all() and _rel(out_g, ref) < 1e-2
