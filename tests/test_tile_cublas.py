"""``DECODESCOPE_TILE_CUBLAS``: the single-weight tile projections (o_proj with its residual
epilogue, KDA's in_proj after its norm launch) on cuBLAS from N tokens (issue #5; default 32,
``0`` turns it off).

CPU (CI): which projections it takes (one weight, no folded norm, the tile kernel's token
range), the knob's parsing, the GEMM and residual epilogue by torch on the CPU (the output
aliasing the residual as o_proj runs it), the norm launch kept in front (stood in for: the
CuTe norm kernel needs a GPU), and the step's op_impl. GPU (``pytest -m gpu``, H200): against
the tile kernel on the same inputs at 32 and 64 tokens.
"""

from __future__ import annotations

import pytest
import torch

from decodescope.kernels.config import get_config
from decodescope.kernels.specialized import tile_gemm as tg

ENV = tg.CUBLAS_ENV


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for v in (ENV, "DECODESCOPE_ATTN_GEMM", "DECODESCOPE_TILE_NORM"):
        monkeypatch.delenv(v, raising=False)


def test_serves(monkeypatch):
    cfg = get_config("kimi-k3", 8)
    H = cfg.hidden
    assert tg.cublas_min_m() == 32  # the default
    monkeypatch.setenv(ENV, "0")
    assert not tg.cublas_serves(64, cfg.kda_dim, 1, False, False)  # 0: off
    monkeypatch.setenv(ENV, "32")
    assert tg.cublas_min_m() == 32
    assert tg.cublas_serves(64, cfg.kda_dim, 1, False, False)  # o_proj
    assert tg.cublas_serves(32, H, 1, True, True)  # KDA in_proj (norm + residual add)
    assert not tg.cublas_serves(16, cfg.kda_dim, 1, False, False)  # below the knob
    assert not tg.cublas_serves(64, H, 2, True, True)  # MLA qkv_a + g: two launches
    assert not tg.cublas_serves(64, cfg.mla.q_lora_rank, 1, True, False)  # q_b: norm folded
    monkeypatch.setenv(ENV, "33")
    with pytest.raises(ValueError, match="DECODESCOPE_TILE_CUBLAS='33': expected one of"):
        tg.cublas_min_m()


def test_epilogue_on_cpu(monkeypatch):
    """o_proj's contract through ``project``: ``out = bf16(x @ W^T + r)``, in place where the
    output is the residual, out of place otherwise (synthetic small shapes: K 512, N 256)."""
    monkeypatch.setenv(ENV, "32")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 512, generator=g).to(torch.bfloat16)
    w = (torch.randn(256, 512, generator=g) * 512**-0.5).to(torch.bfloat16)
    r = torch.randn(64, 256, generator=g).to(torch.bfloat16)
    ref = (x.float() @ w.float().T + r.float()).to(torch.bfloat16)
    out = torch.empty_like(r)
    tg.project(x, [w], [out], epilogue_residual=r, eps=1e-5)
    inplace = r.clone()
    tg.project(x, [w], [inplace], epilogue_residual=inplace, eps=1e-5)
    for o in (out, inplace):
        assert ((o.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2
    plain = torch.empty_like(r)
    tg.project(x, [w], [plain], eps=1e-5)
    assert torch.allclose(plain.float(), (x.float() @ w.float().T), rtol=2e-2, atol=2e-2)


def test_norm_launch_kept(monkeypatch):
    """With a norm (KDA in_proj): the tile path's norm launch (residual add, residual_out)
    first, then the GEMM on its output."""
    monkeypatch.setenv(ENV, "32")
    seen = {}

    def fake_norm(p, x, nw, residual, residual_out):
        seen.update(plan=p, residual=residual, residual_out=residual_out)
        return torch.ones_like(x)

    monkeypatch.setattr(tg, "norm_launch", fake_norm)
    K = 4096  # the tile path takes a norm + residual projection from K 4096 (in_proj: 7168)
    x = torch.randn(64, K).to(torch.bfloat16)
    r, ro = torch.randn_like(x), torch.empty_like(x)
    w = (torch.randn(128, K) * K**-0.5).to(torch.bfloat16)
    out = torch.empty(64, 128, dtype=torch.bfloat16)
    tg.project(x, [w], [out], residual=r, residual_out=ro, norm_weight=torch.ones(K), eps=1e-5)
    assert seen["residual"] is r and seen["residual_out"] is ro and seen["plan"].norm
    ref = torch.ones(64, K) @ w.float().T
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2


def test_op_impl(monkeypatch):
    from decodescope.kernels.specialized import step as S

    def impl(batch):
        p = S.plan(preset="kimi-k3", tp_shape=8, batch=batch, tokens_per_seq=1,
                   layers="dense,kda,mla", seed=0, front_norm=0)  # fmt: skip
        return p.op_impl()

    monkeypatch.setenv(ENV, "0")
    assert set(impl(64).values()) == {S.CUTE}
    monkeypatch.setenv(ENV, "32")
    forced = impl(64)
    monkeypatch.delenv(ENV)
    got = impl(64)  # the default: 32
    assert got == forced
    assert (
        got["attn.o_proj"] == got["attn.input_residual_norm+qkv_proj+f_b_proj"] == (tg.CUBLAS_IMPL)
    )
    assert got["attn.input_residual_norm+fused_qkv_a_proj+g_proj"] == S.CUTE
    assert set(impl(8).values()) == {S.CUTE}


@pytest.mark.parametrize("allreduce", ["fused", "nccl"])
def test_op_impl_tp2(allreduce):
    """tp_world 2 keeps the single-GPU input projection (cuBLAS from 32 tokens, the default) and,
    with NCCL launches, the single-GPU o_proj too; the fused o_proj + all-reduce is CuTe."""
    from decodescope.kernels.specialized import step as S

    p = S.plan(preset="kimi-k3", tp_shape=8, batch=64, tokens_per_seq=1, layers="kda,mla",
               seed=0, tp_world=2, allreduce=allreduce)  # fmt: skip
    got = p.op_impl()
    assert got["attn.input_residual_norm+qkv_proj+f_b_proj"] == tg.CUBLAS_IMPL
    if allreduce == "nccl":
        assert got["attn.o_proj"] == tg.CUBLAS_IMPL
        assert got["attn.allreduce"] == "torch.distributed:nccl"
    else:
        assert "attn.o_proj" not in got
        assert got["attn.o_proj+allreduce+residual"] == S.CUTE


@pytest.mark.gpu
@pytest.mark.parametrize("m", [32, 64])
def test_vs_tile_gpu(m, monkeypatch):
    """o_proj (aliased residual) and KDA in_proj (norm + residual add) at TP8: cuBLAS against
    the tile kernel on the same fresh random inputs."""
    from tile_fakes import attn_projections

    run = attn_projections(get_config("kimi-k3", 8), m, torch.device("cuda"))
    outs = {}
    for mode in ("0", "32"):
        monkeypatch.setenv(ENV, mode)
        outs[mode] = run()
    for a, b in zip(outs["32"], outs["0"], strict=True):
        assert torch.isfinite(a.float()).all()
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 1e-2
