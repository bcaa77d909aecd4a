"""Deterministic weights and decode state for one rank, from a seed (no downloads).

Weights are BF16 (routed experts too; MXFP4 experts are not built yet). Scales are realistic:
linear layers ``N(0, 1/fan_in)`` so activations stay O(1) through the layer, norm weights near 1,
A_log as in Mamba (log of 1..16), a small router bias. Every tensor is generated on ``device``
with a generator seeded from ``(seed, layer index)``: the same seed gives the same weights on
the same device kind.

Per-layer weights are a plain ``dict[str, Tensor]``; the keys (per rank, ``H`` = hidden):

- both kinds: ``attn_norm [H]`` and ``mlp_norm [H]`` (the two AttnRes stand-ins' RMSNorm weights)
- KDA: ``in_proj [kda_in_proj_out, H]`` (q, k, v, g, f_a, b, pad), ``conv_w [3*D, conv_kernel]``,
  ``f_b [D, head_dim]``, ``A_log [heads] fp32``, ``dt_bias [D] fp32``, ``o_norm [head_dim]``,
  ``o_proj [H, D]`` with ``D = heads/t * head_dim``
- MLA: ``qkv_a [q_lora + kv_lora + rope, H]``, ``g_proj [heads/t * v, H]`` (gated only; the two
  are row views of one tensor),
  ``q_a_norm [q_lora]``, ``kv_a_norm [kv_lora]``, ``q_b [heads/t * (nope + rope), q_lora]``,
  ``w_uk [heads/t, nope, kv_lora]``, ``w_uv [heads/t, kv_lora, v]``, ``o_proj [H, heads/t * v]``
- MoE: ``router [E, H]``, ``router_bias [E] fp32``, ``latent_down [L, H]``, ``latent_norm [L]``,
  ``latent_up [H, L]`` (LatentMoE only), ``w13 [E, 2*I, L]`` (gate rows then up rows),
  ``w2 [E, L, I]``, ``shared_w13 [2*S, H]``, ``shared_w2 [H, S]``
- dense MLP: ``dense_w13 [2*Dn, H]``, ``dense_w2 [H, Dn]``

Decode state per layer (:func:`make_state`): KDA ``kda_state [B, heads/t, hd, hd] fp32`` and
``conv_state [B, 3*D, conv_kernel - 1]``; MLA ``kv_cache [B, context_len + tokens, 576]`` (BF16 or
FP8 e4m3), the first ``context_len`` rows filled, new tokens written at ``context_len + j``.
"""

from __future__ import annotations

import math

import torch

from decodescope.kernels.config import Config, LayerSpec

BF16 = torch.bfloat16


def _gen(device: torch.device | str, seed: int) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(int(seed) & 0x7FFF_FFFF_FFFF)
    return g


def _randn(shape, g, device, std: float, dtype=BF16) -> torch.Tensor:
    t = torch.randn(shape, generator=g, device=device, dtype=dtype)
    return t.mul_(std)


def _linear(out_f: int, in_f: int, g, device) -> torch.Tensor:
    return _randn((out_f, in_f), g, device, 1.0 / math.sqrt(in_f))


def _adjacent(*ws: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The same weights as row views of one ``[sum N, K]`` tensor (values unchanged), so that
    one GEMM can take them all: MLA's ``qkv_a`` and ``g_proj`` (:func:`.specialized.
    attention_layers.merged_rows`, ``DECODESCOPE_WIDE_AG``)."""
    whole = torch.cat(ws)
    return tuple(whole.split([int(w.shape[0]) for w in ws]))


def _norm_w(n: int, g, device) -> torch.Tensor:
    return _randn((n,), g, device, 0.1, torch.float32).add_(1.0).to(BF16)


def layer_seed(seed: int, index: int) -> int:
    return seed * 1_000_003 + index * 7919 + 17


def make_layer_weights(
    cfg: Config, spec: LayerSpec, seed: int = 0, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """All weights of one decoder layer (per rank) for ``spec`` (attention kind + MLP kind)."""
    g = _gen(device, layer_seed(seed, spec.index))
    H = cfg.hidden
    w: dict[str, torch.Tensor] = {
        "attn_norm": _norm_w(H, g, device),
        "mlp_norm": _norm_w(H, g, device),
    }
    if spec.attn == "kda":
        k = cfg.kda
        D, hd, nh = cfg.kda_dim, k.head_dim, cfg.kda_heads
        w["in_proj"] = _linear(cfg.kda_in_proj_out, H, g, device)
        w["conv_w"] = _randn((3 * D, k.conv_kernel), g, device, 1.0 / math.sqrt(k.conv_kernel))
        w["f_b"] = _linear(D, hd, g, device)
        a = torch.rand((nh,), generator=g, device=device, dtype=torch.float32)
        w["A_log"] = torch.log(1.0 + 15.0 * a)
        w["dt_bias"] = _randn((D,), g, device, 0.5, torch.float32)
        w["o_norm"] = _norm_w(hd, g, device)
        w["o_proj"] = _linear(H, D, g, device)
    else:
        m = cfg.mla
        nh = cfg.mla_heads
        w["qkv_a"] = _linear(cfg.mla_qkv_a_out, H, g, device)
        if m.output_gate:
            w["qkv_a"], w["g_proj"] = _adjacent(w["qkv_a"], _linear(cfg.mla_v_dim, H, g, device))
        w["q_a_norm"] = _norm_w(m.q_lora_rank, g, device)
        w["kv_a_norm"] = _norm_w(m.kv_lora_rank, g, device)
        w["q_b"] = _linear(cfg.mla_q_b_out, m.q_lora_rank, g, device)
        # kv_b_proj [heads*(nope+v), kv_lora] split into the absorbed W_UK and W_UV
        s = 1.0 / math.sqrt(m.kv_lora_rank)
        w["w_uk"] = _randn((nh, m.qk_nope_head_dim, m.kv_lora_rank), g, device, s)
        w["w_uv"] = _randn((nh, m.kv_lora_rank, m.v_head_dim), g, device, s)
        w["o_proj"] = _linear(H, cfg.mla_v_dim, g, device)
    if spec.mlp == "dense":
        w["dense_w13"] = _linear(2 * cfg.dense_inter, H, g, device)
        w["dense_w2"] = _linear(H, cfg.dense_inter, g, device)
        return w
    e = cfg.moe
    E, L, Ie, S = e.num_experts, cfg.expert_dim, cfg.expert_inter, cfg.shared_inter
    w["router"] = _linear(E, H, g, device)
    w["router_bias"] = _randn((E,), g, device, 0.05, torch.float32)
    if e.latent_dim:
        w["latent_down"] = _linear(L, H, g, device)
        w["latent_norm"] = _norm_w(L, g, device)
        w["latent_up"] = _linear(H, L, g, device)
    if cfg.expert_dtype == "mxfp4":
        w["w13_q"], w["w13_s"] = mxfp4_random(E, 2 * Ie, L, 1.0 / math.sqrt(L), g, device)
        w["w2_q"], w["w2_s"] = mxfp4_random(E, L, Ie, 1.0 / math.sqrt(Ie), g, device)
    else:
        w["w13"] = _randn((E, 2 * Ie, L), g, device, 1.0 / math.sqrt(L))
        w["w2"] = _randn((E, L, Ie), g, device, 1.0 / math.sqrt(Ie))
    if S:
        w["shared_w13"] = _linear(2 * S, H, g, device)
        w["shared_w2"] = _linear(H, S, g, device)
    return w


# -- MXFP4 routed experts -----------------------------------------------------------------------
#
# Codes are FP4 E2M1, two per byte; one E8M0 scale (2^(s - 127)) per 32 values along K. Packing
# (ours, what the Triton kernel reads): per 64-wide K chunk c, byte j (0..31) holds the code of
# k = 64c + j in its low nibble and of k = 64c + 32 + j in its high nibble; scales [.., N, K/32].

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E2M1_RMS = math.sqrt(sum(v * v for v in E2M1) / 16)


def mxfp4_random(E: int, N: int, K: int, std: float, g, device):
    """Random MXFP4 weights ``[E, N, K]`` whose dequantized values have about ``std``."""
    if K % 64:
        raise ValueError(f"MXFP4 experts need K divisible by 64, got {K}")
    q = torch.randint(0, 256, (E, N, K // 2), generator=g, device=device, dtype=torch.uint8)
    base = 127 + round(math.log2(std / E2M1_RMS))
    jitter = torch.randint(-1, 2, (E, N, K // 32), generator=g, device=device, dtype=torch.int16)
    return q, (jitter + base).to(torch.uint8)


def dequant_mxfp4(q: torch.Tensor, s: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """``q [.., N, K/2]`` + ``s [.., N, K/32]`` -> ``[.., N, K]`` in ``dtype``."""
    lut = torch.tensor(E2M1, dtype=dtype, device=q.device)
    *lead, n, k2 = q.shape
    qc = q.reshape(*lead, n, k2 // 32, 32).long()
    sc = torch.exp2(s.to(dtype) - 127.0).reshape(*lead, n, k2 // 32, 2)
    lo = lut[qc & 15] * sc[..., 0:1]
    hi = lut[qc >> 4] * sc[..., 1:2]
    return torch.cat([lo, hi], dim=-1).reshape(*lead, n, 2 * k2)


def expert_weight(w: dict[str, torch.Tensor], name: str, e, dtype=torch.float32) -> torch.Tensor:
    """Routed expert ``e``'s ``w13`` or ``w2`` (dequantized where MXFP4) in ``dtype``."""
    if f"{name}_q" in w:
        return dequant_mxfp4(w[f"{name}_q"][e], w[f"{name}_s"][e], dtype)
    return w[name][e].to(dtype)


def cache_dtype(cfg: Config) -> torch.dtype:
    return torch.float8_e4m3fn if cfg.kv_cache_dtype == "fp8_e4m3" else BF16


def make_state(
    cfg: Config,
    spec: LayerSpec,
    batch: int,
    tokens_per_seq: int,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """Decode state of one layer for ``batch`` sequences (random, realistic magnitudes)."""
    g = _gen(device, layer_seed(seed, spec.index) + 101)
    if spec.attn == "kda":
        k = cfg.kda
        nh, hd = cfg.kda_heads, k.head_dim
        return {
            "kda_state": _randn((batch, nh, hd, hd), g, device, 0.5, torch.float32),
            "conv_state": _randn((batch, cfg.kda_conv_dim, k.conv_kernel - 1), g, device, 1.0),
        }
    m = cfg.mla
    rows = cfg.context_len + tokens_per_seq
    cache = _randn((batch, rows, m.latent_dim), g, device, 1.0)
    cache[:, cfg.context_len :].fill_(float("nan"))  # slots the step writes: never read unwritten
    return {"kv_cache": cache.to(cache_dtype(cfg))}


def refresh_state_(state: dict[str, torch.Tensor], cfg: Config, seed: int) -> None:
    """Redraw a layer's state in place (same shapes, same buffers: graph-safe between replays)."""
    for i, (name, t) in enumerate(sorted(state.items())):
        g = _gen(t.device, seed * 31 + i)
        if name == "kv_cache":
            tmp = torch.randn(t.shape[0], cfg.context_len, t.shape[2], generator=g, device=t.device)
            t[:, : cfg.context_len].copy_(tmp.to(t.dtype))
        else:
            std = 0.5 if name == "kda_state" else 1.0
            t.copy_(torch.randn(t.shape, generator=g, device=t.device) * std)


def make_inputs(
    cfg: Config, n_tokens: int, seed: int = 0, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hidden, residual)`` for ``n_tokens`` rows: the stream entering the first layer."""
    g = _gen(device, seed * 7 + 3)
    return (
        _randn((n_tokens, cfg.hidden), g, device, 1.0),
        _randn((n_tokens, cfg.hidden), g, device, 1.0),
    )


def weight_bytes(w: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in w.values())
