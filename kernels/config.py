"""Model configuration: the Kimi K3 shapes (DESIGN.md section 2), per-rank shapes at a TP size.

Frozen dataclasses. :class:`ModelConfig` holds the whole model as published; :class:`Config` is
one model at one tensor-parallel shape (``tp``) plus run options (context length, cache dtype,
expert dtype), and its properties give the per-rank shapes the way vLLM shards them:

- KDA: heads/t; one merged input GEMM ``in_proj_qkvgfab`` = q, k, v, output gate g (heads/t x
  head_dim each), f_a (head_dim, replicated), beta (heads/t), padded to a multiple of 16
  (6288 x 7168 at TP8, 3216 x 7168 at TP16); ``f_b_proj`` head_dim -> heads/t x head_dim.
- gated MLA: ``fused_qkv_a_proj`` (q_lora + kv_lora + rope = 2112) replicated; ``g_proj`` and
  ``q_b_proj`` and ``o_proj`` sharded by heads.
- LatentMoE: router and latent down/up projections replicated; routed expert intermediate and the
  shared experts' intermediate sharded by t.

Presets: ``kimi-k3`` (TP 1, 2, 8, 16), ``kimi-k2`` (DeepSeek-V3-like MLA + MoE, no KDA, for
comparison) and ``tiny`` (same structure, small sizes, CPU tests). ``get_config(preset, tp)``
builds one; an impossible combination raises :class:`ConfigError` saying what is wrong.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

LayerKind = Literal["kda", "mla", "dense"]
KV_CACHE_DTYPES = ("bf16", "fp8_e4m3")
EXPERT_DTYPES = ("bf16", "mxfp4")
MAX_TOKENS_PER_SEQ = 8  # 1 + k with k <= 7 draft tokens (speculative verification)


class ConfigError(ValueError):
    """A configuration that cannot run, with a message saying which field and why."""


def _pad(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class KDAConfig:
    """Kimi Delta Attention (linear attention with per-channel decay)."""

    num_heads: int = 96
    head_dim: int = 128
    conv_kernel: int = 4
    gate_lower_bound: float = -5.0  # decay g = lower_bound * sigmoid(exp(A_log) * x)
    in_proj_pad: int = 16  # the merged input GEMM's output is padded to a multiple of this


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention with an optional sigmoid output gate (K3's gated MLA)."""

    num_heads: int = 96
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    output_gate: bool = True  # K3: g_proj + sigmoid gate before o_proj; K2: none
    use_rope: bool = False  # K3: mla_use_nope (no RoPE applied); we never apply RoPE

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one latent KV cache row (512 + 64 = 576)."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    """Routed + shared experts; ``latent_dim`` > 0 makes it LatentMoE (experts in a latent)."""

    num_experts: int = 896
    top_k: int = 16
    n_shared: int = 2
    intermediate: int = 3072  # per routed expert (and per shared expert)
    latent_dim: int = 3584  # 0: routed experts work on the hidden state directly (K2)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling: float = 1.0
    renormalize: bool = True
    scoring: Literal["sigmoid"] = "sigmoid"
    activation: Literal["situ", "silu"] = "situ"


@dataclass(frozen=True)
class ModelConfig:
    """A whole model as published (not per rank)."""

    name: str
    hidden: int
    num_layers: int
    vocab: int
    rms_eps: float
    mla: MLAConfig
    moe: MoEConfig
    kda: KDAConfig | None = None  # None: every layer is full attention (K2)
    full_attn_layers: tuple[int, ...] = ()  # 1-based; ignored when kda is None
    first_dense_layers: int = 1  # layers 0 .. n-1 (0-based) have a dense MLP
    dense_intermediate: int = 33792
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    attn_res_block_size: int = 12  # K3 AttnRes; a fused residual-add + RMSNorm stands in
    tp_shapes: tuple[int, ...] = (1, 2, 8, 16)  # the TP shapes the preset is published for


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer of the model's mix: which attention and which MLP."""

    index: int  # 0-based
    attn: Literal["kda", "mla"]
    mlp: Literal["moe", "dense"]

    @property
    def kind(self) -> LayerKind:
        """The layer kind of DESIGN.md section 5: ``dense`` where the MLP is dense."""
        return "dense" if self.mlp == "dense" else self.attn


@dataclass(frozen=True)
class Config:
    """One model at one tensor-parallel shape, plus run options. Properties are per rank."""

    model: ModelConfig
    tp: int = 1
    context_len: int = 1024
    kv_cache_dtype: str = "bf16"
    expert_dtype: str = "bf16"
    preset: str = ""
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        validate(self)

    # -- convenience -----------------------------------------------------------------------
    @property
    def hidden(self) -> int:
        return self.model.hidden

    @property
    def eps(self) -> float:
        return self.model.rms_eps

    @property
    def kda(self) -> KDAConfig:
        if self.model.kda is None:
            raise ConfigError(f"preset {self.model.name!r} has no KDA layers")
        return self.model.kda

    @property
    def mla(self) -> MLAConfig:
        return self.model.mla

    @property
    def moe(self) -> MoEConfig:
        return self.model.moe

    # -- KDA, per rank ---------------------------------------------------------------------
    @property
    def kda_heads(self) -> int:
        return self.kda.num_heads // self.tp

    @property
    def kda_dim(self) -> int:
        """heads/t x head_dim: the width of each of q, k, v and the output gate."""
        return self.kda_heads * self.kda.head_dim

    @property
    def kda_conv_dim(self) -> int:
        """Channels of the short convolution (q, k, v)."""
        return 3 * self.kda_dim

    @property
    def kda_in_proj_sizes(self) -> dict[str, int]:
        """Output segments of the merged input GEMM, in order (pad last)."""
        d, hd = self.kda_dim, self.kda.head_dim
        used = 4 * d + hd + self.kda_heads
        return {
            "q": d,
            "k": d,
            "v": d,
            "g": d,
            "f_a": hd,
            "b": self.kda_heads,
            "pad": _pad(used, self.kda.in_proj_pad) - used,
        }

    @property
    def kda_in_proj_out(self) -> int:
        return sum(self.kda_in_proj_sizes.values())

    # -- MLA, per rank ---------------------------------------------------------------------
    @property
    def mla_heads(self) -> int:
        return self.mla.num_heads // self.tp

    @property
    def mla_qkv_a_out(self) -> int:
        m = self.mla
        return m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim

    @property
    def mla_q_b_out(self) -> int:
        return self.mla_heads * self.mla.qk_head_dim

    @property
    def mla_v_dim(self) -> int:
        """heads/t x v_head_dim: g_proj output and o_proj input."""
        return self.mla_heads * self.mla.v_head_dim

    # -- MoE, per rank ---------------------------------------------------------------------
    @property
    def expert_inter(self) -> int:
        return self.moe.intermediate // self.tp

    @property
    def shared_inter(self) -> int:
        return self.moe.n_shared * self.moe.intermediate // self.tp

    @property
    def expert_dim(self) -> int:
        """Width the routed experts read and write: the latent, or hidden without one."""
        return self.moe.latent_dim or self.hidden

    @property
    def dense_inter(self) -> int:
        return self.model.dense_intermediate // self.tp

    # -- layers ----------------------------------------------------------------------------
    def layer_mix(self, n_layers: int | None = None) -> list[LayerSpec]:
        return layer_mix(self.model, n_layers)

    def replace(self, **changes) -> Config:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["notes"] = list(self.notes)
        return d


def layer_mix(model: ModelConfig, n_layers: int | None = None) -> list[LayerSpec]:
    """The model's layer pattern, 0-based, first ``n_layers`` of it (all by default).

    Kimi K3: full attention (MLA) at 1-based layers 4, 8, ..., 92, 93; KDA elsewhere; layer 0
    (0-based) has a dense MLP. Without KDA (K2) every layer is MLA.
    """
    n = model.num_layers if n_layers is None else n_layers
    if n < 1 or n > model.num_layers:
        raise ConfigError(f"n_layers must be in 1..{model.num_layers} for {model.name!r}, got {n}")
    full = set(model.full_attn_layers)
    out = []
    for i in range(n):
        attn = "mla" if model.kda is None or (i + 1) in full else "kda"
        mlp = "dense" if i < model.first_dense_layers else "moe"
        out.append(LayerSpec(i, attn, mlp))
    return out


def validate(cfg: Config) -> None:
    """Raise :class:`ConfigError` naming the first impossible field of ``cfg``."""
    m, t = cfg.model, cfg.tp
    if not isinstance(t, int) or t < 1:
        raise ConfigError(f"tp must be a positive integer, got {t!r}")

    def div(what: str, n: int) -> None:
        if n % t:
            raise ConfigError(f"{m.name}: {what} ({n}) is not divisible by tp={t}")

    if m.kda is not None:
        div("KDA heads", m.kda.num_heads)
        if m.kda.conv_kernel < 2:
            raise ConfigError(f"{m.name}: KDA conv_kernel must be >= 2, got {m.kda.conv_kernel}")
        if m.kda.gate_lower_bound >= 0:
            raise ConfigError(f"{m.name}: KDA gate_lower_bound must be negative")
        bad = [i for i in m.full_attn_layers if not 1 <= i <= m.num_layers]
        if bad:
            raise ConfigError(f"{m.name}: full_attn_layers {bad} outside 1..{m.num_layers}")
    div("MLA heads", m.mla.num_heads)
    e = m.moe
    div("moe intermediate", e.intermediate)
    div("shared intermediate", e.n_shared * e.intermediate)
    div("dense intermediate", m.dense_intermediate)
    if e.top_k < 1 or e.top_k > e.num_experts:
        raise ConfigError(
            f"{m.name}: top_k ({e.top_k}) must be in 1..num_experts ({e.num_experts})"
        )
    if e.n_group < 1 or e.num_experts % e.n_group:
        raise ConfigError(
            f"{m.name}: num_experts ({e.num_experts}) not divisible by n_group ({e.n_group})"
        )
    if not 1 <= e.topk_group <= e.n_group:
        raise ConfigError(
            f"{m.name}: topk_group ({e.topk_group}) must be in 1..n_group ({e.n_group})"
        )
    if e.top_k > e.topk_group * (e.num_experts // e.n_group):
        raise ConfigError(f"{m.name}: top_k ({e.top_k}) exceeds the experts of topk_group groups")
    if e.n_shared < 0 or e.latent_dim < 0:
        raise ConfigError(f"{m.name}: n_shared and latent_dim must be >= 0")
    if cfg.context_len < 1:
        raise ConfigError(f"context_len must be >= 1, got {cfg.context_len}")
    if cfg.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(
            f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {cfg.kv_cache_dtype!r}"
        )
    if cfg.expert_dtype not in EXPERT_DTYPES:
        raise ConfigError(f"expert_dtype must be one of {EXPERT_DTYPES}, got {cfg.expert_dtype!r}")
    if cfg.expert_dtype == "mxfp4":
        for what, n in (
            ("expert width", e.latent_dim or m.hidden),
            ("expert intermediate", e.intermediate // t),
        ):
            if n % 64:
                raise ConfigError(f"{m.name}: MXFP4 experts need the {what} ({n}) divisible by 64")
    if m.first_dense_layers < 0 or m.first_dense_layers > m.num_layers:
        raise ConfigError(f"{m.name}: first_dense_layers must be in 0..num_layers")


# -- presets -------------------------------------------------------------------------------

KIMI_K3 = ModelConfig(
    name="kimi-k3",
    hidden=7168,
    num_layers=93,
    vocab=163840,
    rms_eps=1e-5,
    kda=KDAConfig(),
    mla=MLAConfig(),
    moe=MoEConfig(),
    full_attn_layers=(*range(4, 93, 4), 93),
    first_dense_layers=1,
    dense_intermediate=33792,
)

KIMI_K2 = ModelConfig(
    name="kimi-k2",
    hidden=7168,
    num_layers=61,
    vocab=163840,
    rms_eps=1e-6,
    kda=None,
    mla=MLAConfig(num_heads=64, output_gate=False),
    moe=MoEConfig(
        num_experts=384,
        top_k=8,
        n_shared=1,
        intermediate=2048,
        latent_dim=0,
        routed_scaling=2.827,
        activation="silu",
    ),
    first_dense_layers=1,
    dense_intermediate=18432,
)

TINY = ModelConfig(
    name="tiny",
    hidden=256,
    num_layers=8,
    vocab=1024,
    rms_eps=1e-5,
    kda=KDAConfig(num_heads=4, head_dim=32),
    mla=MLAConfig(
        num_heads=4,
        q_lora_rank=96,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
    ),
    moe=MoEConfig(num_experts=32, top_k=4, n_shared=2, intermediate=64, latent_dim=128),
    full_attn_layers=(4, 8),
    first_dense_layers=1,
    dense_intermediate=512,
    tp_shapes=(1, 2),
)

PRESETS: dict[str, ModelConfig] = {m.name: m for m in (KIMI_K3, KIMI_K2, TINY)}


def get_config(preset: str = "kimi-k3", tp_shape: int | str = 8, **options) -> Config:
    """The per-rank config of ``preset`` at ``tp_shape``; ``options`` set Config fields
    (context_len, kv_cache_dtype, expert_dtype)."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    try:
        tp = int(tp_shape)
    except (TypeError, ValueError):
        raise ConfigError(f"tp_shape must be an integer, got {tp_shape!r}") from None
    model = PRESETS[preset]
    if tp not in model.tp_shapes:
        raise ConfigError(
            f"preset {preset!r} has tp_shape in {model.tp_shapes}, got {tp}"
            " (build Config(model, tp=...) directly for another)"
        )
    if "context_len" in options:
        options["context_len"] = int(options["context_len"])
    notes = (
        "AttnRes (attn_res_block_size 12) is not public: a fused residual-add + RMSNorm of the"
        " same cost stands in for it",
        "latent RMSNorm applied to the routed experts' latent output before the up-projection"
        " (DESIGN.md section 9 order)",
    )
    return Config(model=model, tp=tp, preset=preset, notes=notes, **options)
