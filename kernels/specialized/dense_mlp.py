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
2. ``down``: ``x_out = act @ w2^T``, the same kernel below 8 tokens, :mod:`.tile_gemm` from 8 on. ``x_out`` is the layer's MLP output, as
   the MoE block's is: the next layer's fused ``input_residual_norm`` prologue adds it to ``r``
   (``bf16(x_out + r)``, the rounding an o_proj-style residual epilogue would apply) and
   normalizes; a residual epilogue here would add ``r`` twice.

From 32 tokens per step on (``SPLIT_NORM_FROM``; ``DECODESCOPE_DENSE_SPLIT_NORM=0|1`` forces
it for A/B runs) the RMSNorm runs as its own launch (``residual_norm``, :mod:`.rmsnorm`,
writing ``h``) and launch 1 becomes ``gate_up+act`` on ``h``: the skinny GEMM's fused prologue
re-reads every token's row per CTA, which the H200 sweep measured at 2-3x the cost of a separate
norm launch at M >= 32 (notes/specialized.md, "Dense layer 0"). Three launches then.

From ``DENSE_TILE_FROM`` (8) to 64 tokens (``DECODESCOPE_DENSE_TILE``, :func:`tile_mode`; ``0``:
all of the above, the default before session 12): ``gate_up+act`` on the tensor cores,
:mod:`.dense_tile` (the :mod:`.tile_gemm` pipeline with a gate/up row map and SiTU in the
epilogue). ``1`` (or ``launch``): the RMSNorm as its own launch, then ``gate_up+act`` on ``h``
(``OPS_SPLIT``, three launches); ``fold`` (unset: the default): the norm folded into the tile
GEMM (``mlp_norm`` folded into a derived ``w13``, :func:`.tile_gemm.folded_weight`, made in
:meth:`warmup`: one more copy of w13 in memory, 121 MB at TP8), two launches (``OPS``). H200
s12/r1 (``scripts/gpu_dense_tile.py``, TP8, before ``ldsm`` became the tile's default): fold
36.2 / 40.2 / 58.4 us at 8 / 32 / 64 tokens against the skinny path's 61.9 / 55.3 / 72.3 and
cuBLAS + a SiTU launch's 54.3 / 56.4 / 61.2; all checks within tolerance.

The weights are the standard path's tensors as they are (no re-layout: the CTA's row map picks
gate and up tiles, :meth:`.skinny_gemm.GemmPlan.weight_tile`), so both paths can share them.
"""

from __future__ import annotations

import functools
import os

import torch

from decodescope.kernels.specialized import dense_tile as _dt
from decodescope.kernels.specialized import rmsnorm as _rms
from decodescope.kernels.specialized import skinny_gemm as _sg
from decodescope.kernels.specialized import tile_gemm as _tg
from decodescope.kernels.specialized.skinny_gemm import GemmPlan, skinny_gemm, skinny_gemm_ref
from decodescope.tracer import range as _range

BF16 = torch.bfloat16

OPS = ("residual_norm+gate_up+act", "down")  # block "mlp"
OPS_SPLIT = ("residual_norm", "gate_up+act", "down")  # from SPLIT_NORM_FROM tokens on
BLOCK = "mlp"
SPLIT_NORM_FROM = 32


DENSE_TILE_FROM = 8  # DECODESCOPE_DENSE_TILE: the tile kernel from this many tokens (to 64)
TILE_MODES = {"": "fold", "0": "", "1": "launch", "launch": "launch", "fold": "fold"}


def tile_mode(n_tokens: int) -> str:
    """``gate_up+act`` on :mod:`.dense_tile` for ``n_tokens`` tokens (``DECODESCOPE_DENSE_TILE``):
    ``""`` (``0``: the skinny GEMM), ``"launch"`` (``1``: the norm its own launch) or ``"fold"``
    (unset: the norm folded into the tile GEMM), from ``DENSE_TILE_FROM`` to 64 tokens."""
    env = os.environ.get("DECODESCOPE_DENSE_TILE", "").strip()
    if env not in TILE_MODES:
        raise ValueError(f"DECODESCOPE_DENSE_TILE must be one of 0, 1, launch, fold, got {env!r}")
    if not DENSE_TILE_FROM <= n_tokens <= 64:
        return ""
    return TILE_MODES[env]


def split_norm_for(n_tokens: int) -> bool:
    """Whether the RMSNorm runs as its own launch for ``n_tokens`` tokens per step
    (:func:`tile_mode` decides where it is on)."""
    tm = tile_mode(n_tokens)
    if tm:
        return tm == "launch"
    env = os.environ.get("DECODESCOPE_DENSE_SPLIT_NORM", "").strip()
    if env in ("0", "1"):
        return env == "1"
    if env:
        raise ValueError(f"DECODESCOPE_DENSE_SPLIT_NORM must be 0 or 1, got {env!r}")
    return n_tokens >= SPLIT_NORM_FROM


def ops_for(n_tokens: int) -> tuple[str, ...]:
    """The dense MLP's launches (``mlp.<op>`` names) for ``n_tokens`` tokens per step."""
    return OPS_SPLIT if split_norm_for(n_tokens) else OPS


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


def gate_up_plan(cfg, m: int, norm: bool = True) -> GemmPlan:
    beta, lbeta = _betas(cfg)
    return GemmPlan(
        m=m,
        k=cfg.hidden,
        segments=(2 * cfg.dense_inter,),
        norm=norm,
        eps=cfg.eps,
        situ=True,
        situ_beta=beta,
        situ_lbeta=lbeta,
    )


DOWN_TILE_FROM = 8  # the tile GEMM for the down projection from this many tokens


def _down_tile(m: int, k: int) -> bool:
    return m >= DOWN_TILE_FROM and _tg.selected(m, k)


def down_plan(cfg, m: int):
    """The down projection's plan: :mod:`.tile_gemm` where it serves ``m x dense_inter``
    (``tile_gemm.selected``: from 8 tokens), else the skinny GEMM. H200 TP8 (bench, a2176a3):
    the skinny kernel took 126.7 us in the layer at 8 tokens for 60 MB of weights."""
    if _down_tile(m, cfg.dense_inter):
        return _tg.gemm_plan(m, cfg.dense_inter, (cfg.hidden,), eps=cfg.eps)
    return GemmPlan(
        m=m,
        k=cfg.dense_inter,
        segments=(cfg.hidden,),
        eps=cfg.eps,
        ks_force=_warps(cfg.dense_inter),
    )


def gate_up_act(cfg, w: dict, r: torch.Tensor, act: torch.Tensor, norm: bool = True) -> None:
    """``act = situ_and_mul(rmsnorm(r) * mlp_norm @ dense_w13^T)`` (``norm=False``: ``r`` is
    already normalized). One launch."""
    nw = w["mlp_norm"] if norm else None
    skinny_gemm(r, [w["dense_w13"]], [act], norm_weight=nw, eps=cfg.eps, situ=_betas(cfg))


def tile_plan(cfg, m: int, fold: bool = False):
    """:mod:`.dense_tile`'s plan for ``m`` tokens (``fold``: the norm folded in)."""
    return _dt.plan(m, cfg.hidden, cfg.dense_inter, rms_fold=fold, eps=cfg.eps)


def gate_up_act_tile(cfg, w: dict, x: torch.Tensor, act: torch.Tensor, fold: bool = False) -> None:
    """``act`` by :mod:`.dense_tile`, one launch: ``x`` normalized (``fold`` False), or the
    residual ``r`` with the norm folded in (``w13`` times ``mlp_norm``: the cached
    :func:`.tile_gemm.folded_weight`, made on the first call: call it before graph capture)."""
    w13 = _tg.folded_weight(w["dense_w13"], w["mlp_norm"]) if fold else w["dense_w13"]
    _dt.dense_gate_up(x, w13, act, _betas(cfg), rms_fold=fold, eps=cfg.eps)


def down_proj(cfg, w: dict, act: torch.Tensor, x_out: torch.Tensor) -> None:
    """``x_out = act @ dense_w2^T``. One launch (:func:`down_plan`'s kernel)."""
    if _down_tile(act.shape[0], act.shape[1]):
        _tg.tile_gemm(act, [w["dense_w2"]], [x_out], eps=cfg.eps)
    else:
        skinny_gemm(act, [w["dense_w2"]], [x_out], eps=cfg.eps, ks=_warps(cfg.dense_inter))


def gate_up_act_ref(cfg, w: dict, r: torch.Tensor, norm: bool = True) -> torch.Tensor:
    """Launch 1's torch reference (FP32 math, the kernel's bf16 rounding points)."""
    nw = w["mlp_norm"] if norm else None
    outs, _ = skinny_gemm_ref(r, [w["dense_w13"]], norm_weight=nw, eps=cfg.eps, situ=_betas(cfg))
    return outs[0]


def down_proj_ref(cfg, w: dict, act: torch.Tensor) -> torch.Tensor:
    outs, _ = skinny_gemm_ref(act, [w["dense_w2"]])
    return outs[0]


def dense_mlp_ref(cfg, w: dict, r: torch.Tensor, split_norm: bool = False) -> torch.Tensor:
    """The launches' references chained: the MLP output ``x_out`` from the residual ``r``
    (``split_norm``: the RMSNorm launch's reference, then the GEMM without its prologue)."""
    if split_norm:
        h = _rms.rmsnorm_ref(r, w["mlp_norm"], cfg.eps)
        return down_proj_ref(cfg, w, gate_up_act_ref(cfg, w, h, norm=False))
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
        self.ops = ops_for(n_tokens)
        self.split = self.ops == OPS_SPLIT
        self.tile = tile_mode(n_tokens)
        if self.tile and not _dt.supports(n_tokens, cfg.hidden, cfg.dense_inter):
            raise ValueError(f"DECODESCOPE_DENSE_TILE: dense_tile does not serve {n_tokens} "
                             f"tokens, H {cfg.hidden}, Dn {cfg.dense_inter} (set "
                             "DECODESCOPE_DENSE_TILE=0 for the skinny GEMM)")  # fmt: skip
        self.h = torch.empty(n_tokens, cfg.hidden, dtype=BF16, device=dev) if self.split else None

    @property
    def launches(self) -> int:
        return len(self.ops)

    def warmup(self) -> None:
        """Compile every kernel (outside capture)."""
        if self.split:
            _rms.compile_plan(_rms.NormPlan(self.N, self.cfg.hidden, self.cfg.eps))
        if self.tile:
            fold = self.tile == "fold"
            _dt.prepare(tile_plan(self.cfg, self.N, fold), *_betas(self.cfg), self.act.device)
            if fold:
                _tg.folded_weight(self.w["dense_w13"], self.w["mlp_norm"])
        else:
            _sg.compile_plan(gate_up_plan(self.cfg, self.N, norm=not self.split))
        _tg.compile_any(down_plan(self.cfg, self.N))

    def stages(self, r: torch.Tensor, x_out: torch.Tensor):
        """``(op name, thunk)`` per launch, in order."""
        cfg, w = self.cfg, self.w
        if self.tile == "fold":
            return [
                (OPS[0], lambda: gate_up_act_tile(cfg, w, r, self.act, fold=True)),
                (OPS[1], lambda: down_proj(cfg, w, self.act, x_out)),
            ]
        if self.split:
            up = gate_up_act_tile if self.tile else functools.partial(gate_up_act, norm=False)
            return [
                (OPS_SPLIT[0], lambda: _rms.rmsnorm(r, w["mlp_norm"], self.h, cfg.eps)),
                (OPS_SPLIT[1], lambda: up(cfg, w, self.h, self.act)),
                (OPS_SPLIT[2], lambda: down_proj(cfg, w, self.act, x_out)),
            ]
        return [
            (OPS[0], lambda: gate_up_act(cfg, w, r, self.act)),
            (OPS[1], lambda: down_proj(cfg, w, self.act, x_out)),
        ]

    def forward_norm(self, r: torch.Tensor, x_out: torch.Tensor) -> None:
        """``x_out`` = the dense MLP of ``rmsnorm(r) * mlp_norm``; ``r`` is only read."""
        for op, fn in self.stages(r, x_out):
            with _range(f"layer.{self.i}.{BLOCK}.{op}"):
                fn()


WIDE_OPS = ("gate_up", "act", "down")  # block "mlp", over all rows of a chunked step


class DenseMLPAllTokens:
    """The dense MLP over all ``n_tokens`` rows of a chunked step (more tokens than the tile
    and skinny kernels take; ``step.tokens_once``), after
    :class:`.attention_layers.AttentionAllTokens`, whose last launch wrote the normalized ``h``:
    ``gate_up`` (one cuBLAS GEMM, ``gu = bf16(h @ dense_w13^T)``), ``act``
    (:func:`.situ_mul.situ_mul`), ``down`` (one cuBLAS GEMM). Three launches, the weights read
    once per step instead of once per chunk; the rounding points of :func:`gate_up_act_ref`
    (``bf16(situ(bf16(g), bf16(u)))``) and of the standard path, whose MLP is the same three
    ops with its own activation kernel."""

    def __init__(self, cfg, w: dict[str, torch.Tensor], n_tokens: int, layer: int = 0,
                 device=None) -> None:  # fmt: skip
        for k in ("dense_w13", "dense_w2"):
            if k not in w:
                raise ValueError(f"dense MLP of layer {layer}: weight {k!r} is missing")
        self.cfg, self.w, self.N, self.i = cfg, w, n_tokens, layer
        self.betas = _betas(cfg)
        dev = device if device is not None else w["dense_w13"].device
        self.gu = torch.empty(n_tokens, 2 * cfg.dense_inter, dtype=BF16, device=dev)
        self.act = torch.empty(n_tokens, cfg.dense_inter, dtype=BF16, device=dev)
        self.ops = WIDE_OPS

    @property
    def launches(self) -> int:
        return len(self.ops)

    def stages(self, h: torch.Tensor, x_out: torch.Tensor):
        """``(op name, thunk)`` per launch, in order."""
        from decodescope.kernels.specialized import situ_mul as _sm

        w = self.w
        return [
            (WIDE_OPS[0], lambda: _tg._cublas_gemm(h, w["dense_w13"], self.gu)),
            (WIDE_OPS[1], lambda: _sm.situ_mul(self.gu, self.act, self.betas)),
            (WIDE_OPS[2], lambda: _tg._cublas_gemm(self.act, w["dense_w2"], x_out)),
        ]

    def forward(self, h: torch.Tensor, x_out: torch.Tensor) -> None:
        """``x_out`` = the dense MLP of the normalized ``h`` (``rmsnorm(r) * mlp_norm``)."""
        for op, fn in self.stages(h, x_out):
            with _range(f"layer.{self.i}.{BLOCK}.{op}"):
                fn()


def dense_mlp_wide_ref(cfg, w: dict, h: torch.Tensor) -> torch.Tensor:
    """:class:`DenseMLPAllTokens`'s launches' references chained, from the normalized ``h``."""
    return down_proj_ref(cfg, w, gate_up_act_ref(cfg, w, h, norm=False))
