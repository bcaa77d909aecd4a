"""A decode step of N standard layers: weights, state, static buffers, and ``step()``.

The residual stream is carried between layers through two ping-pong buffer pairs; the step's
inputs (``x_in``, ``r_in``) are read, never written, so every CUDA-graph replay computes the same
function of (inputs, state). State (KDA recurrent + conv state, MLA cache rows of the new
tokens) is updated in place.
"""

from __future__ import annotations

import torch

from decodescope.kernels.config import Config, ConfigError, LayerSpec
from decodescope.kernels.standard.layers import StandardLayer
from decodescope.kernels.standard.ops import Ops
from decodescope.kernels.weights import make_inputs, make_layer_weights, make_state


def parse_layers(cfg: Config, layers: str | int | None) -> list[LayerSpec]:
    """``"kda,mla"`` (kinds in order; ``dense`` = the model's first-layer attention + dense MLP),
    ``"mix"`` / ``"mix:8"`` / an int (the first n layers of the model's own mix)."""
    if layers is None or layers == "":
        layers = "kda,mla" if cfg.model.kda is not None else "mla,mla"
    if isinstance(layers, int) or str(layers).isdigit():
        return cfg.layer_mix(int(layers))
    s = str(layers).strip().lower()
    if s == "mix" or s.startswith("mix:"):
        return cfg.layer_mix(int(s.split(":", 1)[1]) if ":" in s else None)
    out = []
    default_attn = "kda" if cfg.model.kda is not None else "mla"
    for i, kind in enumerate(k.strip() for k in s.split(",")):
        if kind == "kda" and cfg.model.kda is None:
            raise ConfigError(f"preset {cfg.model.name!r} has no KDA layers (layers={layers!r})")
        if kind in ("kda", "mla"):
            out.append(LayerSpec(i, kind, "moe"))
        elif kind == "dense":
            out.append(LayerSpec(i, default_attn, "dense"))
        else:
            raise ConfigError(f"unknown layer kind {kind!r} in layers={layers!r} (kda|mla|dense)")
    return out


class StandardModel:
    def __init__(
        self,
        cfg: Config,
        specs: list[LayerSpec],
        batch: int,
        tokens_per_seq: int = 1,
        seed: int = 0,
        device: torch.device | str = "cpu",
        use_vllm: bool | str = True,
        use_triton: bool | None = None,
        tp_world: int = 1,
        kda_mode: str = "auto",
        weights: list[dict[str, torch.Tensor]] | None = None,
        comm=None,  # kernels.standard.comm.Comm: the all-reduce at tp_world > 1
    ) -> None:
        if not 1 <= tokens_per_seq <= 8:
            raise ConfigError(
                f"tokens_per_seq must be in 1..8 (1 + k drafts), got {tokens_per_seq}"
            )
        if batch < 1:
            raise ConfigError(f"batch must be >= 1, got {batch}")
        self.cfg, self.specs = cfg, specs
        self.batch, self.T, self.seed = batch, tokens_per_seq, seed
        self.N = batch * tokens_per_seq
        self.device = torch.device(device)
        self.ops = Ops(self.device, use_vllm=use_vllm, use_triton=use_triton)
        cuda = self.device.type == "cuda"
        self.side = torch.cuda.Stream(self.device) if cuda else None
        if weights is None:
            weights = [make_layer_weights(cfg, s, seed, self.device) for s in specs]
        self.weights = weights  # reusable across batch sizes (same cfg and specs)
        self.states = [make_state(cfg, s, batch, tokens_per_seq, seed, self.device) for s in specs]
        self.x_in, self.r_in = make_inputs(cfg, self.N, seed, self.device)
        self.layers = [
            StandardLayer(
                cfg, s, w, st, batch, tokens_per_seq, self.ops, self.side, tp_world, kda_mode, comm
            )
            for s, w, st in zip(specs, self.weights, self.states, strict=True)
        ]
        self.xs = [torch.empty_like(self.x_in) for _ in range(2)]
        self.rs = [torch.empty_like(self.r_in) for _ in range(2)]
        self.x_out, self.r_out = self.xs[(len(specs) - 1) % 2], self.rs[(len(specs) - 1) % 2]

    def step(self) -> None:
        """One decode step over every layer, on the current stream."""
        x, r = self.x_in, self.r_in
        for i, layer in enumerate(self.layers):
            layer.forward(x, r, self.xs[i % 2], self.rs[i % 2])
            x, r = self.xs[i % 2], self.rs[i % 2]

    def poison(self) -> None:
        """NaN into the step's output buffers and every layer's intermediates (tests: whatever
        a step does not write stays NaN)."""
        for t in (*self.xs, *self.rs):
            t.fill_(float("nan"))
        for layer in self.layers:
            layer.poison()

    def refresh(self, seed: int | None = None) -> None:
        """Fresh random inputs (same buffers): call outside graph capture."""
        s = self.seed + 1 if seed is None else seed
        self.seed = s
        x, r = make_inputs(self.cfg, self.N, s, self.device)
        self.x_in.copy_(x)
        self.r_in.copy_(r)

    def selected_experts(self) -> dict[int, torch.Tensor]:
        """The routing of the last step: ``{layer index: topk_ids [N, k]}``."""
        return {layer.i: layer.topk_ids for layer in self.layers if layer.topk_ids is not None}
