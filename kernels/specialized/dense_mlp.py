"""The dense MLP of Kimi K3's layer 0 in two launches of the skinny-GEMM family.

Same function as :meth:`decodescope.kernels.standard.layers.StandardLayer._dense_forward` after
the post-attention ``residual_norm``: ``x_out = situ_and_mul(rmsnorm(r) * mlp_norm @ w13^T) @
w2^T``, with ``w13 = dense_w13 [2*Dn, H]`` (gate rows first, then up rows, vLLM's merged
``gate_up``) and ``w2 = dense_w2 [H, Dn]``, ``Dn = 33792 / tp``. The launches (``layer.{i}.mlp.``):

1. ``residual_norm+gate_up+act``: :class:`.skinny_gemm.SkinnyGemm` with its RMSNorm prologue on
   ``r`` (the residual stream after attention, which o_proj's residual epilogue wrote: the
   attention half's own ``residual_norm`` launch is dropped, as ``front_norm`` does for the MoE
   block) and the SiTU epilogue: each CTA holds a gate tile and the matching up tile, so the
   ``[N, 2*Dn]`` gate/up product never reaches memory; writes ``act [N, Dn]``.
2. ``down``: the same kernel, ``x_out = act @ w2^T``. ``x_out`` is the layer's MLP output, as
   the MoE block's is: the next layer's fused ``input_residual_norm`` prologue adds it to ``r``
   (``bf16(x_out + r)``, the rounding an o_proj-style residual epilogue would apply) and
   normalizes; a residual epilogue here would add ``r`` twice.

The weights are the standard path's tensors as they are (no re-layout: the CTA's row map picks
gate and up tiles, :meth:`.skinny_gemm.GemmPlan.weight_tile`), so both paths can share them.
"""

from __future__ import annotations

import torch

from decodescope.kernels.specialized import skinny_gemm as _sg
from decodescope.kernels.specialized.skinny_gemm import GemmPlan, skinny_gemm, skinny_gemm_ref
from decodescope.tracer import range as _range

BF16 = torch.bfloat16

OPS = ("residual_norm+gate_up+act", "down")  # block "mlp"
BLOCK = "mlp"


def _betas(cfg) -> tuple[float, float]:
    if cfg.moe.activation != "situ":
        raise ValueError(
            f"the specialized dense MLP implements the SiTU activation, preset "
            f"{cfg.model.name!r} uses {cfg.moe.activation!r}"
        )
    return float(cfg.model.situ_beta), float(cfg.model.situ_linear_beta)


def _warps(k: int) -> int:
    """Warps splitting K (a K-slice each): the most of 8, 6, 4, 3, 2, 1 that divides its
    32-wide chunks (33792/tp is 132 chunks at TP8, 66 at TP16: 6 warps, where the default
    ladder 8/4/2 would give 4 and 2)."""
    chunks = k // _sg.KCHUNK
    for w in (8, 6, 4, 3, 2, 1):
        if chunks % w == 0:
            return w
    return 1


def gate_up_plan(cfg, m: int) -> GemmPlan:
    beta, lbeta = _betas(cfg)
    return GemmPlan(
        m=m,
        k=cfg.hidden,
        segments=(2 * cfg.dense_inter,),
        norm=True,
        eps=cfg.eps,
        situ=True,
        situ_beta=beta,
        situ_lbeta=lbeta,
    )


def down_plan(cfg, m: int) -> GemmPlan:
    return GemmPlan(
        m=m,
        k=cfg.dense_inter,
        segments=(cfg.hidden,),
        eps=cfg.eps,
        ks_force=_warps(cfg.dense_inter),
    )


def gate_up_act(cfg, w: dict, r: torch.Tensor, act: torch.Tensor) -> None:
    """``act = situ_and_mul(rmsnorm(r) * mlp_norm @ dense_w13^T)``. One launch."""
    skinny_gemm(r, [w["dense_w13"]], [act], norm_weight=w["mlp_norm"], eps=cfg.eps,
                situ=_betas(cfg))  # fmt: skip


def down_proj(cfg, w: dict, act: torch.Tensor, x_out: torch.Tensor) -> None:
    """``x_out = act @ dense_w2^T``. One launch."""
    skinny_gemm(act, [w["dense_w2"]], [x_out], eps=cfg.eps, ks=_warps(cfg.dense_inter))


def gate_up_act_ref(cfg, w: dict, r: torch.Tensor) -> torch.Tensor:
    """Launch 1's torch reference (FP32 math, the kernel's bf16 rounding points)."""
    outs, _ = skinny_gemm_ref(r, [w["dense_w13"]], norm_weight=w["mlp_norm"], eps=cfg.eps,
                              situ=_betas(cfg))  # fmt: skip
    return outs[0]


def down_proj_ref(cfg, w: dict, act: torch.Tensor) -> torch.Tensor:
    outs, _ = skinny_gemm_ref(act, [w["dense_w2"]])
    return outs[0]


def dense_mlp_ref(cfg, w: dict, r: torch.Tensor) -> torch.Tensor:
    """Both launches' references chained: the MLP output ``x_out`` from the residual ``r``."""
    return down_proj_ref(cfg, w, gate_up_act_ref(cfg, w, r))


class SpecializedDenseMLP:
    """One dense layer's MLP for ``n_tokens`` tokens: its buffer, its two launches."""

    def __init__(self, cfg, w: dict[str, torch.Tensor], n_tokens: int, layer: int = 0,
                 device=None) -> None:  # fmt: skip
        for k in ("dense_w13", "dense_w2", "mlp_norm"):
            if k not in w:
                raise ValueError(f"dense MLP of layer {layer}: weight {k!r} is missing")
        self.cfg, self.w, self.N, self.i = cfg, w, n_tokens, layer
        dev = device if device is not None else w["dense_w13"].device
        self.act = torch.empty(n_tokens, cfg.dense_inter, dtype=BF16, device=dev)

    @property
    def launches(self) -> int:
        return len(OPS)

    def warmup(self) -> None:
        """Compile both kernels (outside capture)."""
        _sg.compile_plan(gate_up_plan(self.cfg, self.N))
        _sg.compile_plan(down_plan(self.cfg, self.N))

    def stages(self, r: torch.Tensor, x_out: torch.Tensor):
        """``(op name, thunk)`` per launch, in order."""
        cfg, w = self.cfg, self.w
        return [
            (OPS[0], lambda: gate_up_act(cfg, w, r, self.act)),
            (OPS[1], lambda: down_proj(cfg, w, self.act, x_out)),
        ]

    def forward_norm(self, r: torch.Tensor, x_out: torch.Tensor) -> None:
        """``x_out`` = the dense MLP of ``rmsnorm(r) * mlp_norm``; ``r`` is only read."""
        for op, fn in self.stages(r, x_out):
            with _range(f"layer.{self.i}.{BLOCK}.{op}"):
                fn()
