"""Tensor-parallel sharding of one layer's weights and state, the way vLLM shards them.

A rank of a TP group holds (DESIGN.md section 2, kernels/config.py):

- column-parallel (rows split by rank): KDA ``in_proj`` q, k, v, g and beta rows (``f_a``
  replicated), ``conv_w`` (q, k, v channels), ``f_b``, ``A_log``, ``dt_bias``; MLA ``g_proj``,
  ``q_b``, ``w_uk`` / ``w_uv`` (heads); routed experts' ``w13`` (gate rows and up rows apart),
  the shared experts' and the dense MLP's gate/up GEMM;
- row-parallel (input columns split): ``o_proj``, experts' ``w2``, ``shared_w2``, ``dense_w2``;
  their outputs are partial sums that the all-reduce adds up;
- replicated: norms, MLA ``qkv_a`` (the down-projections), router and its bias, the latent
  down/up projections (LatentMoE).

So a layer at tensor-parallel size ``t`` on ``t`` ranks, each holding its shard, computes after
its all-reduces exactly what the unsharded layer computes (up to summation order): the contract
the TP2 checks (tests/test_tp2_*.py, scripts/gpu_tp2.py) test.

- :func:`shard_layer_weights` / :func:`shard_state`: rank ``r``'s part of weights / decode state
  built at a smaller TP (usually 1), e.g. TP1 -> TP2;
- :func:`rank_layer_weights`: per-rank weights at a TP shape with fewer ranks than the shape
  (TP8 shapes on 2 GPUs): replicated tensors identical on every rank (same seed), sharded ones
  drawn per rank, so that routing and residual stream agree across ranks;
- :func:`tp_layer_ref`: the float reference of one layer over several ranks' weights, summing the
  ranks' partial results where the all-reduces sit (what two GPUs must compute).
"""

from __future__ import annotations

import torch

from decodescope.kernels import reference as ref
from decodescope.kernels.config import Config, ConfigError, LayerSpec
from decodescope.kernels.weights import expert_weight, make_layer_weights

# tensors every rank holds whole
REPLICATED = frozenset(
    {
        "attn_norm",
        "mlp_norm",
        "o_norm",
        "qkv_a",
        "q_a_norm",
        "kv_a_norm",
        "router",
        "router_bias",
        "latent_down",
        "latent_norm",
        "latent_up",
    }
)


def _parts(full: Config, cfg: Config, world: int | None = None) -> int:
    if cfg.model is not full.model:
        raise ConfigError(f"sharding {full.model.name!r} into {cfg.model.name!r}: not one model")
    if cfg.tp % full.tp:
        raise ConfigError(f"tp {cfg.tp} is not a multiple of the source tp {full.tp}")
    parts = cfg.tp // full.tp
    if world is not None and parts != world:
        raise ConfigError(f"tp {full.tp} -> {cfg.tp} makes {parts} shards, not {world}")
    return parts


def _slice(t: torch.Tensor, dim: int, rank: int, parts: int) -> torch.Tensor:
    n = t.shape[dim]
    if n % parts:
        raise ConfigError(f"dimension {dim} of size {n} does not split into {parts} shards")
    s = n // parts
    return t.narrow(dim, rank * s, s)


def _segments(
    t: torch.Tensor, dim: int, sizes: list[int], split: list[bool], rank: int, parts: int
) -> torch.Tensor:
    """Concatenate, along ``dim``, each segment of ``t`` (``sizes``) sharded or whole."""
    out, off = [], 0
    for n, s in zip(sizes, split, strict=True):
        seg = t.narrow(dim, off, n)
        out.append(_slice(seg, dim, rank, parts) if s else seg)
        off += n
    if off != t.shape[dim]:
        raise ConfigError(f"segments cover {off} of {t.shape[dim]} along dimension {dim}")
    return torch.cat(out, dim)


def shard_layer_weights(
    full: Config, cfg: Config, spec: LayerSpec, w: dict[str, torch.Tensor], rank: int
) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s weights at ``cfg.tp`` from the weights ``w`` built at ``full.tp``.

    Every returned tensor is a new contiguous tensor on ``w``'s device (``w`` can be freed).
    An unknown weight name raises (nothing is dropped silently)."""
    p = _parts(full, cfg)
    if not 0 <= rank < p:
        raise ConfigError(f"rank {rank} outside 0..{p - 1}")
    out: dict[str, torch.Tensor] = {}
    for name, t in w.items():
        if name in REPLICATED:
            s = t
        elif name == "in_proj":
            sz = full.kda_in_proj_sizes
            names = ["q", "k", "v", "g", "f_a", "b"]
            s = _segments(
                t.narrow(0, 0, sum(sz[n] for n in names)),
                0,
                [sz[n] for n in names],
                [n != "f_a" for n in names],
                rank,
                p,
            )
            pad = cfg.kda_in_proj_sizes["pad"]
            if pad:
                s = torch.cat([s, s.new_zeros(pad, s.shape[1])], 0)
        elif name == "conv_w":
            d = full.kda_dim
            s = _segments(t, 0, [d, d, d], [True] * 3, rank, p)
        elif name in ("f_b", "A_log", "dt_bias", "g_proj", "q_b", "w_uk", "w_uv"):
            s = _slice(t, 0, rank, p)
        elif name in ("o_proj", "shared_w2", "dense_w2"):
            s = _slice(t, 1, rank, p)
        elif name in ("w13", "w13_q", "w13_s"):
            half = t.shape[1] // 2
            s = _segments(t, 1, [half, half], [True, True], rank, p)
        elif name in ("w2", "w2_q", "w2_s"):
            s = _slice(t, 2, rank, p)
        elif name in ("shared_w13", "dense_w13"):
            half = t.shape[0] // 2
            s = _segments(t, 0, [half, half], [True, True], rank, p)
        else:
            raise ConfigError(f"no sharding rule for weight {name!r} of layer {spec.index}")
        out[name] = s.contiguous() if s is not t else t.clone()
    _check_shapes(cfg, spec, out)
    return out


def _check_shapes(cfg: Config, spec: LayerSpec, w: dict[str, torch.Tensor]) -> None:
    """Each sharded tensor must have the shape :func:`make_layer_weights` gives at ``cfg.tp``."""
    want = layer_weight_shapes(cfg, spec)
    for name, t in w.items():
        if name in want and tuple(t.shape) != want[name]:
            raise ConfigError(
                f"sharded {name!r} of layer {spec.index} has shape {tuple(t.shape)}, "
                f"expected {want[name]} at tp {cfg.tp}"
            )


def layer_weight_shapes(cfg: Config, spec: LayerSpec) -> dict[str, tuple[int, ...]]:
    """Shapes of the sharded weights :func:`make_layer_weights` builds at ``cfg.tp``."""
    H, out = cfg.hidden, {}
    if spec.attn == "kda":
        D, hd = cfg.kda_dim, cfg.kda.head_dim
        out |= {
            "in_proj": (cfg.kda_in_proj_out, H),
            "conv_w": (3 * D, cfg.kda.conv_kernel),
            "f_b": (D, hd),
            "A_log": (cfg.kda_heads,),
            "dt_bias": (D,),
            "o_proj": (H, D),
        }
    else:
        m, nh = cfg.mla, cfg.mla_heads
        out |= {
            "g_proj": (cfg.mla_v_dim, H),
            "q_b": (cfg.mla_q_b_out, m.q_lora_rank),
            "w_uk": (nh, m.qk_nope_head_dim, m.kv_lora_rank),
            "w_uv": (nh, m.kv_lora_rank, m.v_head_dim),
            "o_proj": (H, cfg.mla_v_dim),
        }
    if spec.mlp == "dense":
        Dn = cfg.dense_inter
        return out | {"dense_w13": (2 * Dn, H), "dense_w2": (H, Dn)}
    E, L, Ie, S = cfg.moe.num_experts, cfg.expert_dim, cfg.expert_inter, cfg.shared_inter
    out |= {
        "w13": (E, 2 * Ie, L),
        "w2": (E, L, Ie),
        "w13_q": (E, 2 * Ie, L // 2),
        "w13_s": (E, 2 * Ie, L // 32),
        "w2_q": (E, L, Ie // 2),
        "w2_s": (E, L, Ie // 32),
    }
    if S:
        out |= {"shared_w13": (2 * S, H), "shared_w2": (H, S)}
    return out  # fmt: skip


def shard_state(
    full: Config, cfg: Config, spec: LayerSpec, state: dict[str, torch.Tensor], rank: int
) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s decode state (KDA heads and conv channels split; MLA cache replicated)."""
    p = _parts(full, cfg)
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name == "kda_state":
            s = _slice(t, 1, rank, p)
        elif name == "conv_state":
            d = full.kda_dim
            s = _segments(t, 1, [d, d, d], [True] * 3, rank, p)
        elif name == "kv_cache":
            s = t
        else:
            raise ConfigError(f"no sharding rule for state {name!r} of layer {spec.index}")
        out[name] = s.contiguous() if s is not t else t.clone()
    return out


def rank_layer_weights(
    cfg: Config,
    spec: LayerSpec,
    seed: int,
    rank: int,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """Weights of rank ``rank`` at ``cfg.tp`` when fewer than ``cfg.tp`` ranks run (TP8 shapes
    on two GPUs): replicated tensors (and KDA's replicated ``f_a`` rows) are the same on every
    rank, sharded tensors differ by rank. Rank 0's weights are ``make_layer_weights(seed)``."""
    base = make_layer_weights(cfg, spec, seed, device)
    if rank == 0:
        return base
    own = make_layer_weights(cfg, spec, seed + 1_000_033 * rank, device)
    for name in REPLICATED & own.keys():
        own[name] = base[name]
    if "in_proj" in own:
        d, hd = cfg.kda_dim, cfg.kda.head_dim
        own["in_proj"][4 * d : 4 * d + hd].copy_(base["in_proj"][4 * d : 4 * d + hd])
    del base
    return own


# -- the reference over ranks --------------------------------------------------------------------


def tp_layer_ref(
    cfg: Config,
    spec: LayerSpec,
    ws: list[dict[str, torch.Tensor]],
    states: list[dict[str, torch.Tensor]],
    x: torch.Tensor,
    r: torch.Tensor,
    T: int,
    topk_ids: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
):
    """One layer over ``len(ws)`` ranks (each ``ws[i]`` at ``cfg.tp``), with the ranks' partial
    results summed where the standard path all-reduces. Returns ``(x', r', new_states, ids)``.

    Replicated weights are read from rank 0. Only the selected experts' weights are upcast, so
    full-size checks on a GPU stay cheap (float32 there)."""
    eps = cfg.eps
    w0 = ws[0]
    h, r = ref.attn_res_ref(x, r, w0["attn_norm"], eps, dtype)
    a = None
    new_states = []
    for w, st in zip(ws, states, strict=True):
        if spec.attn == "kda":
            ai, s, c = ref.kda_attn_ref(cfg, w, h, st["kda_state"], st["conv_state"], T, dtype)
            new_states.append({"kda_state": s, "conv_state": c})
        else:
            ai, cache = ref.mla_attn_ref(cfg, w, h, st["kv_cache"], T, dtype)
            new_states.append({"kv_cache": cache})
        a = ai if a is None else a + ai  # attn all-reduce
    h, r = ref.attn_res_ref(a, r, w0["mlp_norm"], eps, dtype)
    if spec.mlp == "dense":
        out = sum(
            ref.act_and_mul_ref(cfg, h @ w["dense_w13"].to(dtype).T) @ w["dense_w2"].to(dtype).T
            for w in ws
        )
        return out, r, new_states, None
    e = cfg.moe
    scores, ids, _ = ref.routing_ref(cfg, w0, h, dtype)
    if topk_ids is not None:
        ids = topk_ids.to(h.device, torch.long)
    tw = scores.gather(1, ids)
    if e.renormalize:
        tw = tw / tw.sum(-1, keepdim=True)
    tw = tw * e.routed_scaling
    z = h @ w0["latent_down"].to(dtype).T if e.latent_dim else h
    N, k = ids.shape
    flat = ids.reshape(-1)
    zt = z.repeat_interleave(k, dim=0)
    y = torch.zeros(N * k, z.shape[1], dtype=dtype, device=h.device)
    for e_id in torch.unique(flat).tolist():
        rows = (flat == e_id).nonzero().squeeze(1)
        for w in ws:  # the intermediate split: partial sums over ranks (latent all-reduce)
            w13 = expert_weight(w, "w13", e_id, dtype).to(h.device)
            w2 = expert_weight(w, "w2", e_id, dtype).to(h.device)
            y[rows] += ref.act_and_mul_ref(cfg, zt[rows] @ w13.T) @ w2.T
    routed = (y.view(N, k, -1) * tw.unsqueeze(-1)).sum(1)
    if e.latent_dim:
        routed = ref.rmsnorm_ref(routed, w0["latent_norm"], eps) @ w0["latent_up"].to(dtype).T
    out = routed
    if "shared_w13" in w0:
        for w in ws:  # shared all-reduce
            s = ref.act_and_mul_ref(cfg, h @ w["shared_w13"].to(dtype).T)
            out = out + s @ w["shared_w2"].to(dtype).T
    return out, r, new_states, ids


# -- the workload's per-rank weights -------------------------------------------------------------

WEIGHT_MODES = ("rank", "shard")


def source_config(cfg: Config, world: int) -> Config:
    """The config whose weights ``world`` ranks shard into ``cfg.tp`` (tp ``cfg.tp / world``)."""
    if cfg.tp % world:
        raise ConfigError(f"tp_shape {cfg.tp} is not divisible by tp_world {world}")
    return cfg.replace(tp=cfg.tp // world)


def build_rank_weights(
    cfg: Config,
    specs: list[LayerSpec],
    seed: int,
    rank: int,
    world: int,
    mode: str = "rank",
    device: torch.device | str = "cpu",
) -> list[dict[str, torch.Tensor]]:
    """Every layer's weights for ``rank``: ``mode`` "rank" (:func:`rank_layer_weights`) or
    "shard" (the layer built whole at tp ``cfg.tp / world`` and sharded, one layer at a time so
    that only one whole layer is ever resident)."""
    if mode not in WEIGHT_MODES:
        raise ConfigError(f"weights must be one of {', '.join(WEIGHT_MODES)}, got {mode!r}")
    if mode == "rank":
        return [rank_layer_weights(cfg, sp, seed, rank, device) for sp in specs]
    full = source_config(cfg, world)
    out = []
    for sp in specs:
        w = make_layer_weights(full, sp, seed, device)
        out.append(shard_layer_weights(full, cfg, sp, w, rank))
        del w
    return out


def shard_model_state_(model, rank: int, world: int) -> None:
    """Overwrite a StandardModel's decode state with rank ``rank``'s shard of the state the
    unsharded model (tp ``cfg.tp / world``, same seed) starts from."""
    from decodescope.kernels.weights import make_state

    full = source_config(model.cfg, world)
    for sp, st in zip(model.specs, model.states, strict=True):
        whole = make_state(full, sp, model.batch, model.T, model.seed, model.device)
        for k, v in shard_state(full, model.cfg, sp, whole, rank).items():
            st[k].copy_(v)
