"""Bytes one decoder layer must move per rank in one decode step (DESIGN.md section 7).

``layer_bytes`` counts, per rank: every weight of the layer that the step reads once (attention,
norms, router, latent projections, shared experts, the dense MLP), every routed expert the
batch's routing really selects (distinct experts: pass the step's ``topk_ids``, or a count), the
recurrent state read and written (KDA: FP32 state + conv state), and the MLA latent cache read
(context + new rows) and the new rows written. Activations (a few MB at batch 64) are left out.
The bytes floor is ``layer_bytes / copy bandwidth``.

``layer_memory`` is what one layer occupies on the device (all experts, state, cache): it says
how many layers of a shape fit on one GPU.
"""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING, Any

from decodescope.kernels import config as kconfig
from decodescope.kernels.config import Config

if TYPE_CHECKING:
    import torch

BF16_B = 2


def distinct_experts(topk_ids: torch.Tensor) -> int:
    """How many different experts the step's routing selected (one layer)."""
    import torch

    return int(torch.unique(topk_ids.reshape(-1)).numel())


def expected_distinct(num_experts: int, top_k: int, n_tokens: int) -> float:
    """Distinct experts under uniform routing: 16, 120, 393, 613 at 1, 8, 32, 64 tokens (K3)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** n_tokens)


def _kda_attn_weights(cfg: Config) -> dict[str, int]:
    k = cfg.kda
    D = cfg.kda_dim
    return {
        "in_proj": cfg.kda_in_proj_out * cfg.hidden * BF16_B,
        "f_b": D * k.head_dim * BF16_B,
        "conv_w": 3 * D * k.conv_kernel * BF16_B,
        "gate_params": cfg.kda_heads * 4 + D * 4 + k.head_dim * BF16_B,
        "o_proj": cfg.hidden * D * BF16_B,
    }


def _mla_attn_weights(cfg: Config) -> dict[str, int]:
    m = cfg.mla
    nh = cfg.mla_heads
    out = {
        "fused_qkv_a": cfg.mla_qkv_a_out * cfg.hidden * BF16_B,
        "q_b": cfg.mla_q_b_out * m.q_lora_rank * BF16_B,
        "w_uk_uv": nh * m.kv_lora_rank * (m.qk_nope_head_dim + m.v_head_dim) * BF16_B,
        "q_kv_norms": (m.q_lora_rank + m.kv_lora_rank) * BF16_B,
        "o_proj": cfg.hidden * cfg.mla_v_dim * BF16_B,
    }
    if m.output_gate:
        out["g_proj"] = cfg.mla_v_dim * cfg.hidden * BF16_B
    return out


def expert_bytes(cfg: Config) -> int:
    """One routed expert per rank (w13 + w2): BF16, or MXFP4 codes + one E8M0 scale per 32."""
    n = 3 * cfg.expert_dim * cfg.expert_inter
    return n // 2 + n // 32 if cfg.expert_dtype == "mxfp4" else n * BF16_B


def _moe_fixed(cfg: Config) -> dict[str, int]:
    e = cfg.moe
    H, L = cfg.hidden, cfg.expert_dim
    out = {"router": e.num_experts * H * BF16_B + e.num_experts * 4}
    if e.latent_dim:
        out["latent_down_up"] = 2 * L * H * BF16_B + L * BF16_B
    if e.n_shared:
        out["shared_experts"] = 3 * cfg.shared_inter * H * BF16_B
    return out


def _state(cfg: Config, attn: str, batch: int, tokens_per_seq: int) -> dict[str, int]:
    if attn == "kda":
        k = cfg.kda
        st = batch * cfg.kda_heads * k.head_dim * k.head_dim * 4
        conv = batch * cfg.kda_conv_dim * (k.conv_kernel - 1) * BF16_B
        return {"kda_state_rw": 2 * st, "conv_state_rw": 2 * conv}
    elem = 1 if cfg.kv_cache_dtype == "fp8_e4m3" else BF16_B
    row = cfg.mla.latent_dim * elem
    return {
        "kv_cache_read": batch * (cfg.context_len + tokens_per_seq) * row,
        "kv_cache_write": batch * tokens_per_seq * row,
    }


def layer_bytes_breakdown(
    cfg: Config,
    kind: str,
    batch: int,
    tokens_per_seq: int = 1,
    selected: torch.Tensor | int | float | None = None,
) -> dict[str, int]:
    """Per-part bytes of one layer of ``kind`` (kda | mla | dense). ``selected``: the step's
    ``topk_ids`` (distinct experts counted), a count, or None (uniform-routing expectation)."""
    attn = "mla" if kind == "mla" or cfg.model.kda is None else "kda"
    out = {"norms": 2 * cfg.hidden * BF16_B}
    out.update(_kda_attn_weights(cfg) if attn == "kda" else _mla_attn_weights(cfg))
    out.update(_state(cfg, attn, batch, tokens_per_seq))
    if kind == "dense":
        out["dense_mlp"] = 3 * cfg.dense_inter * cfg.hidden * BF16_B
        return out
    out.update(_moe_fixed(cfg))
    if selected is None:
        n = expected_distinct(cfg.moe.num_experts, cfg.moe.top_k, batch * tokens_per_seq)
    elif isinstance(selected, numbers.Real):  # a count (numpy's too)
        n = selected
    else:  # the step's topk_ids
        n = distinct_experts(selected)
    out["routed_experts"] = int(round(n * expert_bytes(cfg)))
    return out


def layer_bytes(cfg, kind, batch, tokens_per_seq=1, selected=None) -> int:
    """Total of :func:`layer_bytes_breakdown`."""
    return sum(layer_bytes_breakdown(cfg, kind, batch, tokens_per_seq, selected).values())


def floor_us(nbytes: int | float, copy_bw_tbs: float = 4.22) -> float:
    """The bytes floor in microseconds at ``copy_bw_tbs`` TB/s (H200 copy: 4.22)."""
    return nbytes / (copy_bw_tbs * 1e12) * 1e6


def layer_memory(cfg: Config, kind: str, batch: int, tokens_per_seq: int = 1) -> int:
    """Device bytes one layer holds: all weights incl. every routed expert, state, cache."""
    b = layer_bytes_breakdown(cfg, kind, batch, tokens_per_seq, selected=cfg.moe.num_experts)
    if kind == "dense":
        b.pop("routed_experts", None)
    for k in ("kda_state_rw", "conv_state_rw"):
        if k in b:
            b[k] //= 2
    b.pop("kv_cache_write", None)
    return sum(b.values())


# -- the ops of decodescope's layers and the parts they move ----------------------------------

# op name (one of the ``+``-joined names of a fused op) -> {part of layer_bytes_breakdown:
# fraction}; the standard and the specialized layers name their ops from these
OP_PARTS: dict[str, dict[str, float]] = {
    "input_residual_norm": {"norms": 0.5},
    "residual_norm": {"norms": 0.5},
    "qkv_proj": {"in_proj": 1.0},
    "f_b_proj": {"f_b": 1.0},
    "conv1d": {"conv_w": 1.0, "conv_state_rw": 1.0},
    "kda_recurrence": {"kda_state_rw": 1.0, "gate_params": 1.0},
    "fused_qkv_a_proj": {"fused_qkv_a": 1.0},
    "g_proj": {"g_proj": 1.0},
    "q_kv_norm": {"q_kv_norms": 1.0},
    "q_b_proj": {"q_b": 1.0},
    "w_uk_bmm": {"w_uk_uv": 0.5},
    "w_uv_bmm": {"w_uk_uv": 0.5},
    "cache_insert": {"kv_cache_write": 1.0},
    "mla_decode": {"kv_cache_read": 1.0},
    "o_proj": {"o_proj": 1.0},
    "router": {"router": 1.0},
    "latent_down": {"latent_down_up": 0.5},
    "latent_up": {"latent_down_up": 0.5},
    "routed_experts": {"routed_experts": 1.0},
    "gate_up": {"dense_mlp": 2 / 3},
    "down": {"dense_mlp": 1 / 3},
}
# names that move activations only (or a norm weight counted with its projection), and the
# two-GPU runs' communication (NVLink traffic, not in the layer's HBM bytes)
NO_BYTES = frozenset({"gated_norm", "gate_mul", "grouped_topk", "align", "topk_sum",
                      "latent_norm", "add", "act", "copy", "allreduce", "latent_allreduce",
                      "shared_allreduce", "residual"})  # fmt: skip


class OpBytesError(ValueError):
    """An op (or a run) whose bytes these parts cannot give."""


def op_parts(op: str) -> dict[str, float]:
    """The parts (with fractions) one op moves; ``op`` is a ``+``-joined list of names. The
    shared experts' gate / up (2/3 of their bytes) go to an op that also holds the router or the
    latent down-projection (the specialized MoE front), their down projection (1/3) to one that
    holds the routed experts, all of them to an op of their own. A range nested in an op
    (``align.cub::DeviceScan``: a name with a dot) moves nothing of its own: the op around it
    holds the bytes."""
    if "." in op:
        return {}
    subs = op.split("+")
    out: dict[str, float] = {}
    for s in subs:
        if s == "shared_experts":
            if "router" in subs or "latent_down" in subs:
                frac = 2 / 3
            elif "routed_experts" in subs:
                frac = 1 / 3
            else:
                frac = 1.0
            out["shared_experts"] = out.get("shared_experts", 0.0) + frac
        elif s in OP_PARTS:
            for part, f in OP_PARTS[s].items():
                out[part] = out.get(part, 0.0) + f
        elif s not in NO_BYTES:
            raise OpBytesError(f"op {op!r}: no bytes known for {s!r}")
    return out


def run_layer_parts(workload_config: dict[str, Any], kind: str, batch: int, tokens_per_seq: int,
                    recorded: int) -> dict[str, int]:  # fmt: skip
    """The parts of one layer of ``kind`` of a captured run: its shapes from the workload's
    recorded config (``config_json["workload"]["config"]``: preset, tp, context_len, dtypes),
    the routed experts as the run's recorded ``layer_bytes`` has them (the experts its routing
    selected: ``recorded`` less every other part)."""
    preset, tp = workload_config.get("preset"), workload_config.get("tp")
    if not preset or not tp:
        raise OpBytesError("not a run of decodescope's workloads (no preset in its config)")
    opts = {k: workload_config[k] for k in ("context_len", "kv_cache_dtype", "expert_dtype")
            if k in workload_config}  # fmt: skip
    try:
        cfg = kconfig.get_config(preset, tp, **opts)
    except kconfig.ConfigError as e:
        raise OpBytesError(str(e)) from None
    parts = layer_bytes_breakdown(cfg, kind, batch, tokens_per_seq, selected=0)
    if "routed_experts" in parts:
        parts["routed_experts"] = recorded - sum(
            v for k, v in parts.items() if k != "routed_experts"
        )
    elif sum(parts.values()) != recorded:
        raise OpBytesError(
            f"{kind}: the recorded layer bytes ({recorded}) are not this config's "
            f"({sum(parts.values())})"
        )
    return parts


def op_bytes(parts: dict[str, int], ops: list[str]) -> dict[str, int]:
    """Bytes per op of one layer: each op's parts (:func:`op_parts`) at its fractions. The ops
    must move every non-empty part exactly once (an error names what is left over or counted
    twice), so that the ops' floors add up to the layer's."""
    fr = {op: op_parts(op) for op in ops}
    used: dict[str, float] = {}
    for f in fr.values():
        for p, x in f.items():
            used[p] = used.get(p, 0.0) + x
    off = {p: round(1.0 - used.get(p, 0.0), 3) for p, v in parts.items()
           if v and abs(1.0 - used.get(p, 0.0)) > 1e-6}  # fmt: skip
    unknown = sorted(set(used) - set(parts))
    if off or unknown:
        raise OpBytesError(
            "the ops do not move the layer's bytes once (part: fraction left over) "
            f"{off}{f'; parts this layer has not: {unknown}' if unknown else ''}"
        )
    return {op: int(round(sum(parts[p] * x for p, x in f.items()))) for op, f in fr.items()}
