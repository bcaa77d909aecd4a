"""The workload registry (docs/internal-api.md, "Workloads and capture").

A workload is built inside the capture's child process by a factory registered by name. The
standard-layer issue owns this module and adds its factories; this is only the registry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Workload:
    name: str
    step: Callable[[], None]  # one decode step on the current stream, capturable into a graph
    refresh: Callable[[], None] | None = None  # fresh random inputs, called outside capture
    meta: dict[str, Any] = field(default_factory=dict)  # RunMeta fields (see the contract)


WORKLOADS: dict[str, Callable[..., Workload]] = {}


def register(name: str) -> Callable[[Callable[..., Workload]], Callable[..., Workload]]:
    """Register a workload factory under ``name``: ``@register("toy") def make(**opts): ...``."""

    def deco(factory: Callable[..., Workload]) -> Callable[..., Workload]:
        WORKLOADS[name] = factory
        return factory

    return deco


# -- the standard decode layers (issue 4) ------------------------------------------------------


def _int(v: Any, name: str) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        raise ValueError(f"option {name} must be an integer, got {v!r}") from None


@register("standard")
def standard(
    preset: str = "kimi-k3",
    tp_shape: int | str = 8,
    batch: int | str = 1,
    tokens_per_seq: int | str = 1,
    layers: str = "kda,mla",
    seed: int | str = 0,
    backend: str = "standard",
    context_len: int | str = 1024,
    kv_cache_dtype: str = "bf16",
    expert_dtype: str = "bf16",
    device: str | None = None,
    tp_world: int | str = 1,
    allreduce: str = "nccl",
    weights: str = "rank",
    **unknown: Any,
) -> Workload:
    """vLLM's default Hopper decomposition of Kimi K3 decode layers (kernels/standard).

    Options (strings or ints from the CLI): preset (kimi-k3 | kimi-k2 | tiny), tp_shape, batch,
    tokens_per_seq (1 + k drafts, k <= 7), layers ("kda,mla", "mix", "mix:8", ...), seed,
    context_len, kv_cache_dtype (bf16 | fp8_e4m3), expert_dtype (bf16 | mxfp4: routed experts
    dequantized in the fused-MoE kernel, W4A16), device (default cuda if available).

    Two or more GPUs (tp_world > 1, one process per rank, started by
    decodescope.tracer.distributed): allreduce (nccl | oneshot: torch symmetric memory), weights
    (rank: per-rank random weights at tp_shape, replicated tensors equal on every rank | shard:
    the weights of tp_shape / tp_world built whole on each rank and sharded the way vLLM shards
    them, kernels/sharding.py)."""
    import json

    import torch

    from decodescope.kernels import bytes as kbytes
    from decodescope.kernels import vllm_ops
    from decodescope.kernels.config import get_config
    from decodescope.kernels.standard.model import StandardModel, parse_layers

    if unknown:
        raise ValueError(f"unknown option(s) for workload 'standard': {', '.join(sorted(unknown))}")
    if backend != "standard":
        raise ValueError(f"workload 'standard' runs backend 'standard', got {backend!r}")
    cfg = get_config(
        preset,
        tp_shape,
        context_len=_int(context_len, "context_len"),
        kv_cache_dtype=kv_cache_dtype,
        expert_dtype=expert_dtype,
    )
    specs = parse_layers(cfg, layers)
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    b, t, s = _int(batch, "batch"), _int(tokens_per_seq, "tokens_per_seq"), _int(seed, "seed")
    world = _int(tp_world, "tp_world")
    rank, comm, wts = 0, None, None
    if world > 1:
        from decodescope.kernels import sharding
        from decodescope.kernels.standard.comm import Comm, init_from_env

        rank, dev = init_from_env(world)
        comm = Comm(allreduce, dev)
        wts = sharding.build_rank_weights(cfg, specs, s, rank, world, weights, dev)
    elif allreduce not in ("nccl", "oneshot") or weights not in ("rank", "shard"):
        raise ValueError(f"allreduce={allreduce!r} / weights={weights!r}: unknown value")
    model = StandardModel(
        cfg, specs, b, t, seed=s, device=dev, tp_world=world, weights=wts, comm=comm
    )
    if world > 1 and weights == "shard":
        sharding.shard_model_state_(model, rank, world)
    meta: dict[str, Any] = {
        "workload": "standard",
        "backend": "standard",
        "preset": preset,
        "batch": b,
        "tokens_per_seq": t,
        "tp_shape": cfg.tp,
        "tp_world": world,
    }

    def update_meta() -> None:
        """layer_bytes from the routing the last step really selected (median per kind)."""
        sel = model.selected_experts()
        per_kind: dict[str, list[int]] = {}
        distinct: dict[str, int] = {}
        for layer in model.layers:
            kind = layer.spec.kind
            ids = sel.get(layer.i)
            nb = kbytes.layer_bytes(cfg, kind, b, t, ids)
            per_kind.setdefault(kind, []).append(nb)
            if ids is not None:
                distinct[f"layer.{layer.i}"] = kbytes.distinct_experts(ids)
        meta["layer_bytes"] = {k: sorted(v)[len(v) // 2] for k, v in per_kind.items()}
        config = {
            "config": cfg.to_dict(),
            "layers": [f"{sp.index}:{sp.kind}" for sp in specs],
            "op_impl": dict(model.ops.impl),
            "op_rejected": dict(model.ops.rejected),
            "vllm_ops": vllm_ops.load(),
            "vllm_ops_errors": vllm_ops.errors(),
            "distinct_experts": distinct,
            "seed": model.seed,
            "kda_path": "fused" if cfg.model.kda and cfg.kda_heads >= 12 else "triton-chain",
        }
        if world > 1:
            config |= {"rank": rank, "allreduce": allreduce, "weights": weights}
        meta["config_json"] = json.dumps(config, default=str)
        meta["notes"] = "; ".join(cfg.notes) + (
            "; tp_world 1: no all-reduce runs" if meta["tp_world"] == 1 else ""
        )

    def step() -> None:
        model.step()

    def refresh() -> None:
        model.refresh()
        model.step()  # eager, outside capture: warms up and routes the new inputs
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)
        update_meta()

    refresh()
    wl = Workload(name="standard", step=step, refresh=refresh, meta=meta)
    wl.model = model  # type: ignore[attr-defined]  (tests and scripts reach the layers)
    return wl
