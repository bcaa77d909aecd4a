"""Shared by the CPU dry runs of the GPU scripts (``tests/test_gpu_*_script.py``): load a script
from ``scripts/`` as a module, and a torch model of :func:`.tile_gemm.tile_gemm`'s contract to
patch in for the kernel (the plan is still built, so bad variants raise as they would there).
Also the attention projections' GPU A/B case (:func:`attn_projections`) that the cuBLAS and
TMA-GEMM knob tests share."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from decodescope.kernels import specialized  # noqa: F401  (sets CUTE_DSL_ARCH first)
from decodescope.kernels.specialized import tile_gemm as tg
from decodescope.kernels.specialized.skinny_gemm import skinny_gemm_ref

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str):
    """``scripts/<name>.py`` as a module (its ``main`` not run)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def fake_tile_gemm(x, ws, outs, *, residual=None, residual_out=None, norm_weight=None,
                   epilogue_residual=None, eps=1e-5, rms_fold=False, **force):  # fmt: skip
    """The tile GEMM's math in torch, at its rounding points: the folded norm (weights carrying
    the norm weight, ``bf16(rstd * h @ W'^T)`` with ``h = bf16(x + residual)`` written out),
    FP32 outputs unrounded, else :func:`.skinny_gemm.skinny_gemm_ref`."""
    out_f32 = outs[0].dtype == torch.float32
    tg.plan_of(x, ws, residual=residual, norm_weight=norm_weight,
               epilogue_residual=epilogue_residual, eps=eps, rms_fold=rms_fold, out_f32=out_f32,
               **force)  # fmt: skip
    if rms_fold:
        if residual is not None:
            x = (x.float() + residual.float()).to(torch.bfloat16)
            residual_out.copy_(x)
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        for o, w in zip(outs, ws, strict=True):
            o.copy_(((xf @ w.float().T) * rstd).to(o.dtype))
        return
    if out_f32:
        for o, w in zip(outs, ws, strict=True):
            o.copy_(x.float() @ w.float().T)
        return
    refs, rout = skinny_gemm_ref(x, ws, residual=residual, norm_weight=norm_weight,
                                 epilogue_residual=epilogue_residual, eps=eps)  # fmt: skip
    for o, r in zip(outs, refs, strict=True):
        o.copy_(r)
    if residual_out is not None:
        residual_out.copy_(rout)


def attn_projections(cfg, m: int, dev):
    """o_proj (residual epilogue, in place) and KDA's in_proj (norm launch after the residual
    add) through :func:`.tile_gemm.project` on fresh random inputs (seed ``m``): returns
    ``run()``, which projects both under the knobs set now and returns (o_proj's new residual,
    in_proj's output, the new residual of the norm), the outputs NaN-poisoned first."""
    gen = torch.Generator(device=dev).manual_seed(m)
    bf = torch.bfloat16

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev, generator=gen) * scale).to(bf)

    o, r = rnd(m, cfg.kda_dim), rnd(m, cfg.hidden)
    wo = rnd(cfg.hidden, cfg.kda_dim, scale=cfg.kda_dim**-0.5)
    x, res = rnd(m, cfg.hidden), rnd(m, cfg.hidden)
    wi = rnd(cfg.kda_in_proj_out, cfg.hidden, scale=cfg.hidden**-0.5)
    nw = (1 + 0.1 * torch.randn(cfg.hidden, device=dev, generator=gen)).to(bf)

    def run():
        ro = r.clone()
        tg.project(o, [wo], [ro], epilogue_residual=ro, eps=cfg.eps)
        pi = torch.full((m, cfg.kda_in_proj_out), float("nan"), device=dev, dtype=bf)
        rmid = torch.full_like(x, float("nan"))
        tg.project(x, [wi], [pi], residual=res, residual_out=rmid, norm_weight=nw, eps=cfg.eps)
        torch.cuda.synchronize()
        return ro, pi, rmid

    return run
