"""Plain-torch reference of one decode layer's math (float64 by default).

The function both decode paths must compute (DESIGN.md sections 2 and 9), written for clarity:
one op per function, token by token where the math is sequential, no fusion, no in-place updates
of the caller's tensors. The standard path's tests and the specialized path's tests compare with
it by relative L2 error (METHOD.md).

Conventions: ``N = batch * T`` rows, row ``b * T + t`` is token ``t`` of sequence ``b``; weights
and state as :mod:`decodescope.kernels.weights` names them. Every function upcasts its inputs to
``dtype`` (float64 unless given; float32 is fine for full-size checks on a GPU).

The layer (AttnRes stand-in = residual-add + RMSNorm)::

    r = x + r;  h = rmsnorm(r) * attn_norm;  a = attn(h)      # kda or mla
    r = a + r;  h = rmsnorm(r) * mlp_norm;   x = moe(h)       # or the dense MLP
    return x, r

Routing picks the top-k of ``sigmoid(logits) + bias`` and weights by ``sigmoid(logits)``
renormalized. Near-ties can rank differently at another precision, so :func:`moe_ref` takes the
expert ids to use (``topk_ids``) and :func:`routing_ref` reports how close the call was.
"""

from __future__ import annotations

import math

import torch

from decodescope.kernels.config import Config, LayerSpec
from decodescope.kernels.weights import expert_weight

F64 = torch.float64


def _up(t: torch.Tensor, dtype) -> torch.Tensor:
    return t.to(dtype)


def rmsnorm_ref(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * w.to(x.dtype) if w is not None else y


def situ_ref(g: torch.Tensor, u: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """SiTU-and-mul: ``beta*tanh(g/beta)*sigmoid(g) * linear_beta*tanh(u/linear_beta)``."""
    return (
        beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))
    )


def act_and_mul_ref(cfg: Config, gu: torch.Tensor) -> torch.Tensor:
    """``gu [..., 2*I]`` (gate then up) -> ``[..., I]`` with the model's activation."""
    i = gu.shape[-1] // 2
    g, u = gu[..., :i], gu[..., i:]
    if cfg.moe.activation == "silu":
        return torch.nn.functional.silu(g) * u
    return situ_ref(g, u, cfg.model.situ_beta, cfg.model.situ_linear_beta)


def attn_res_ref(x, r, w, eps, dtype=F64):
    """AttnRes stand-in: ``r = x + r; h = rmsnorm(r) * w``. Returns ``(h, r)``."""
    r = _up(x, dtype) + _up(r, dtype)
    return rmsnorm_ref(r, w, eps), r


# -- KDA ----------------------------------------------------------------------------------


def kda_attn_ref(cfg: Config, w, h, kda_state, conv_state, T: int, dtype=F64):
    """KDA decode for ``h [B*T, H]``. Returns ``(out [B*T, H], kda_state', conv_state')``."""
    k = cfg.kda
    nh, hd, D = cfg.kda_heads, k.head_dim, cfg.kda_dim
    B = h.shape[0] // T
    proj = _up(h, dtype) @ _up(w["in_proj"], dtype).T
    sz = cfg.kda_in_proj_sizes
    q, kk, v, g, f_a, b, _ = torch.split(proj, list(sz.values()), dim=-1)
    qkv = torch.cat([q, kk, v], -1).view(B, T, 3 * D)
    # short causal conv over (conv state, new tokens), then SiLU
    cw = _up(w["conv_w"], dtype)  # [3D, K]
    K = cw.shape[1]
    window = torch.cat([_up(conv_state, dtype), qkv.transpose(1, 2)], dim=2)  # [B, 3D, K-1+T]
    conv = torch.stack([(window[:, :, t : t + K] * cw).sum(-1) for t in range(T)], dim=1)
    conv = torch.nn.functional.silu(conv)  # [B, T, 3D]
    new_conv_state = window[:, :, T:].clone()
    q, kk, v = conv.split(D, dim=-1)
    # decay gate (per channel) and beta (per head)
    f = f_a @ _up(w["f_b"], dtype).T + _up(w["dt_bias"], dtype)  # [N, D]
    a = torch.exp(_up(w["A_log"], dtype)).repeat_interleave(hd)  # [D]
    gk = (k.gate_lower_bound * torch.sigmoid(a * f)).view(B, T, nh, hd)
    beta = torch.sigmoid(b).view(B, T, nh)
    q = torch.nn.functional.normalize(q.view(B, T, nh, hd), dim=-1) * hd**-0.5
    kk = torch.nn.functional.normalize(kk.view(B, T, nh, hd), dim=-1)
    v = v.view(B, T, nh, hd)
    S = _up(kda_state, dtype).clone()  # [B, nh, hd(k), hd(v)]
    outs = []
    for t in range(T):
        S = S * torch.exp(gk[:, t]).unsqueeze(-1)
        kv_mem = torch.einsum("bhk,bhkv->bhv", kk[:, t], S)
        u = beta[:, t].unsqueeze(-1) * (v[:, t] - kv_mem)
        S = S + kk[:, t].unsqueeze(-1) * u.unsqueeze(-2)
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    o = torch.stack(outs, dim=1)  # [B, T, nh, hd]
    gate = torch.sigmoid(g.view(B, T, nh, hd))
    o = rmsnorm_ref(o, w["o_norm"], cfg.eps) * gate
    out = o.reshape(B * T, D) @ _up(w["o_proj"], dtype).T
    return out, S, new_conv_state


# -- gated MLA ----------------------------------------------------------------------------


def mla_attn_ref(cfg: Config, w, h, kv_cache, T: int, dtype=F64):
    """Absorbed MLA decode. Returns ``(out [B*T, H], kv_cache')`` (new rows at ctx + t)."""
    m = cfg.mla
    nh, ctx = cfg.mla_heads, cfg.context_len
    B = h.shape[0] // T
    h = _up(h, dtype)
    a = h @ _up(w["qkv_a"], dtype).T
    q_a, kv_a, k_pe = torch.split(a, [m.q_lora_rank, m.kv_lora_rank, m.qk_rope_head_dim], -1)
    q_a = rmsnorm_ref(q_a, w["q_a_norm"], cfg.eps)
    kv_a = rmsnorm_ref(kv_a, w["kv_a_norm"], cfg.eps)
    q = (q_a @ _up(w["q_b"], dtype).T).view(B * T, nh, m.qk_head_dim)
    q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], -1)
    q_lat = torch.einsum("nhd,hdl->nhl", q_nope, _up(w["w_uk"], dtype))
    q576 = torch.cat([q_lat, q_pe], -1).view(B, T, nh, m.latent_dim)
    # cache insert in the cache's own dtype (what the kernel stores is what it reads back)
    new_rows = torch.cat([kv_a, k_pe], -1).view(B, T, m.latent_dim)
    cache = kv_cache.clone()
    cache[:, ctx : ctx + T] = new_rows.to(kv_cache.dtype)
    kv = _up(cache, dtype)
    scale = 1.0 / math.sqrt(m.qk_head_dim)
    o_lat = torch.empty(B, T, nh, m.kv_lora_rank, dtype=dtype, device=h.device)
    for t in range(T):
        keys = kv[:, : ctx + t + 1]  # causal among the new tokens
        s = torch.einsum("bhl,bsl->bhs", q576[:, t], keys) * scale
        p = torch.softmax(s, dim=-1)
        o_lat[:, t] = torch.einsum("bhs,bsl->bhl", p, keys[..., : m.kv_lora_rank])
    o = torch.einsum("nhl,hlv->nhv", o_lat.view(B * T, nh, -1), _up(w["w_uv"], dtype))
    if m.output_gate:
        gate = (h @ _up(w["g_proj"], dtype).T).view(B * T, nh, m.v_head_dim)
        o = o * torch.sigmoid(gate)
    out = o.reshape(B * T, nh * m.v_head_dim) @ _up(w["o_proj"], dtype).T
    return out, cache


# -- MoE ----------------------------------------------------------------------------------


def routing_ref(cfg: Config, w, h, dtype=F64):
    """Sigmoid router with bias. Returns ``(scores [N, E], topk_ids [N, k], margin [N])`` where
    margin is the gap between the k-th and (k+1)-th biased score (small: a near-tie)."""
    e = cfg.moe
    logits = _up(h, dtype) @ _up(w["router"], dtype).T
    scores = torch.sigmoid(logits)
    sel = scores + _up(w["router_bias"], dtype)
    if e.n_group > 1:
        N = sel.shape[0]
        grp = sel.view(N, e.n_group, -1).topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(grp).scatter_(1, grp.topk(e.topk_group, dim=-1).indices, 1.0)
        mask = keep.repeat_interleave(e.num_experts // e.n_group, dim=1)
        sel = sel.masked_fill(mask == 0, float("-inf"))
    top = sel.topk(min(e.top_k + 1, e.num_experts), dim=-1)
    ids = top.indices[:, : e.top_k]
    if e.top_k < e.num_experts:
        margin = top.values[:, e.top_k - 1] - top.values[:, e.top_k]
    else:
        margin = torch.full_like(top.values[:, 0], float("inf"))
    return scores, ids, margin


def moe_ref(cfg: Config, w, h, topk_ids=None, dtype=F64):
    """LatentMoE (or plain MoE without a latent). Returns ``(out [N, H], topk_ids)``.

    Only the selected experts' weights are upcast (full-size checks stay cheap)."""
    e = cfg.moe
    h = _up(h, dtype)
    scores, ids, _ = routing_ref(cfg, w, h, dtype)
    if topk_ids is not None:
        ids = topk_ids.to(h.device, torch.long)
    tw = scores.gather(1, ids)
    if e.renormalize:
        tw = tw / tw.sum(-1, keepdim=True)
    tw = tw * e.routed_scaling
    z = h @ _up(w["latent_down"], dtype).T if e.latent_dim else h
    N, k = ids.shape
    flat = ids.reshape(-1)
    zt = z.repeat_interleave(k, dim=0)  # [N*k, L]: row n*k + j is token n's j-th expert
    y = torch.zeros(N * k, z.shape[1], dtype=dtype, device=h.device)
    for e_id in torch.unique(flat).tolist():  # one expert at a time: cheap at full size too
        rows = (flat == e_id).nonzero().squeeze(1)
        w13 = expert_weight(w, "w13", e_id, dtype).to(h.device)  # [2I, L] (MXFP4 dequantized)
        w2 = expert_weight(w, "w2", e_id, dtype).to(h.device)  # [L, I]
        y[rows] = act_and_mul_ref(cfg, zt[rows] @ w13.T) @ w2.T
    routed = (y.view(N, k, -1) * tw.unsqueeze(-1)).sum(1)
    if e.latent_dim:
        routed = rmsnorm_ref(routed, w["latent_norm"], cfg.eps) @ _up(w["latent_up"], dtype).T
    out = routed
    if "shared_w13" in w:
        s = act_and_mul_ref(cfg, h @ _up(w["shared_w13"], dtype).T)
        out = out + s @ _up(w["shared_w2"], dtype).T
    return out, ids


def dense_mlp_ref(cfg: Config, w, h, dtype=F64):
    h = _up(h, dtype)
    return act_and_mul_ref(cfg, h @ _up(w["dense_w13"], dtype).T) @ _up(w["dense_w2"], dtype).T


# -- layer --------------------------------------------------------------------------------


def layer_ref(cfg: Config, spec: LayerSpec, w, state, x, r, T: int, topk_ids=None, dtype=F64):
    """One decoder layer. Returns ``(x', r', new_state: dict, topk_ids | None)``."""
    h, r = attn_res_ref(x, r, w["attn_norm"], cfg.eps, dtype)
    if spec.attn == "kda":
        a, s, c = kda_attn_ref(cfg, w, h, state["kda_state"], state["conv_state"], T, dtype)
        new_state = {"kda_state": s, "conv_state": c}
    else:
        a, cache = mla_attn_ref(cfg, w, h, state["kv_cache"], T, dtype)
        new_state = {"kv_cache": cache}
    h, r = attn_res_ref(a, r, w["mlp_norm"], cfg.eps, dtype)
    if spec.mlp == "dense":
        return dense_mlp_ref(cfg, w, h, dtype), r, new_state, None
    out, ids = moe_ref(cfg, w, h, topk_ids, dtype)
    return out, r, new_state, ids


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64; NaN anywhere gives inf."""
    o, r = out.double(), ref.double().to(out.device)
    if not torch.isfinite(o).all():
        return float("inf")
    return float((o - r).norm() / r.norm().clamp_min(1e-30))
