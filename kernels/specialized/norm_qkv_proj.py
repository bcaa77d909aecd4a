"""Residual add + RMSNorm fused into one launch of all of a layer's input projections.

KDA: the merged ``in_proj_qkvgfab`` (q, k, v, g, f_a, b, pad) in one segment (``f_b`` is folded
into :mod:`.kda_decode`). MLA: ``fused_qkv_a_proj`` and ``g_proj`` as two segments of one grid.
The kernel is :class:`.gemv_stream.GemvStream` at one token (``DECODESCOPE_SKINNY_GEMV``),
:class:`.skinny_gemm.SkinnyGemm` below 8 tokens, from 8 :mod:`.tile_gemm` (its norm a launch of
its own) or :class:`.splitk_gemm.SplitKGemm` (``tile_gemm.gemm_plan`` decides); the fused
kernels compute the per-token rstd of ``r' = x + r`` in every CTA; CTA 0 writes ``r'`` (the
new residual stream).
"""

from __future__ import annotations

import torch

from decodescope.kernels.specialized.skinny_gemm import skinny_gemm_ref
from decodescope.kernels.specialized.tile_gemm import gemm_plan, project


def plan_for(cfg, kind: str, m: int):
    if kind == "kda":
        segs: tuple[int, ...] = (cfg.kda_in_proj_out,)
    else:
        segs = (cfg.mla_qkv_a_out,) + ((cfg.mla_v_dim,) if cfg.mla.output_gate else ())
    return gemm_plan(m, cfg.hidden, segs, norm=True, add_residual=True, eps=cfg.eps)


def weights_for(w: dict, kind: str) -> list[torch.Tensor]:
    if kind == "kda":
        return [w["in_proj"]]
    return [w["qkv_a"]] + ([w["g_proj"]] if "g_proj" in w else [])


def norm_qkv_proj(cfg, w: dict, kind: str, x, r, r_out, outs: list[torch.Tensor]) -> None:
    """``r_out = x + r``; ``outs[s] = rmsnorm(r_out) * attn_norm @ W_s^T``. One launch (the
    split-K kernel from 16 tokens on, :func:`.splitk_gemm.enabled_for`)."""
    project(
        x,
        weights_for(w, kind),
        outs,
        residual=r,
        residual_out=r_out,
        norm_weight=w["attn_norm"],
        eps=cfg.eps,
    )


def norm_qkv_proj_ref(cfg, w: dict, kind: str, x, r):
    """Returns ``(outs, r_out)`` with the kernel's rounding points."""
    return skinny_gemm_ref(
        x, weights_for(w, kind), residual=r, norm_weight=w["attn_norm"], eps=cfg.eps
    )
