"""Model-level projections from per-layer traces, and the published reference figures.

Everything here is a *projection*: per-layer times measured on one GPU (each layer's share of
the step, ``share_us`` in :mod:`.metrics`: its span less any overlap with the previous layer),
summed over the model's layer mix. It is never a served-request measurement, and every output says so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import pyarrow as pa

# Kimi K3's layer mix (DESIGN.md section 2): 69 KDA + 24 gated-MLA layers, layer 0 dense.
K3_LAYER_MIX: Mapping[str, int] = {"kda": 69, "mla": 24, "dense": 1}

# DESIGN.md section 1: vLLM's published figures for its latency_specialized path. Their hardware
# is not ours; they are shown beside our numbers, never mixed into them.
REFERENCE_HARDWARE = "16x GB300, TP16 (vLLM latency_specialized, published)"
REFERENCE = {
    "per_layer": {
        "standard": {"kernels": 23, "span_us": 130.0},
        "specialized": {"kernels": 13, "span_us": 69.0},
        "ratio": 1.88,
    },
    "tok_s": [
        # (what, batch, standard, specialized, ratio)
        ("DSpark 7 drafts, acceptance 6", 1, 488.0, 842.0, 1.73),
        ("no speculation", 1, None, 256.4, 1.88),
        ("no speculation", 64, None, 3606.1, 1.62),
    ],
}


@dataclasses.dataclass(frozen=True)
class StepProjection:
    """A projected decode step: what was summed, what was missing, and the result."""

    step_us: float
    tok_s: float
    batch: int
    tokens_per_step: float
    parts: dict[str, float]  # kind -> count * span_us
    missing: tuple[str, ...]  # layer kinds of the mix with no measurement (excluded)
    outside_us: float
    counts: dict[str, int] = dataclasses.field(default_factory=dict)  # kind -> layers summed

    @property
    def dense_measured(self) -> bool:
        """Whether the dense layer(s) of the mix came from a measured dense span."""
        return "dense" in self.parts

    @property
    def label(self) -> str:
        notes = []
        if self.counts:
            notes.append(" + ".join(f"{n} {k}" for k, n in self.counts.items()) + " layers")
        if self.missing:
            notes.append(f"excludes {', '.join(self.missing)}: not measured")
        s = "projection from per-layer shares of the step"
        return s + (f" ({'; '.join(notes)})" if notes else "")


def project_step(
    kind_span_us: Mapping[str, float],
    batch: int,
    *,
    layer_mix: Mapping[str, int] = K3_LAYER_MIX,
    outside_us: float = 0.0,
    tokens_per_seq: float = 1.0,
) -> StepProjection:
    """Sum per-kind layer times (``share_us``, or spans) over ``layer_mix``; tok/s = batch *
    tokens_per_seq / step.

    A kind of the mix with no span (the dense layer 0 in a run of ``layers="kda,mla"``, as the
    first committed results/ runs are) is left out and named in ``missing`` and the label; with
    a measured ``dense`` span (``layers="dense,kda,mla"``) it is summed like the others.

    ``tokens_per_seq`` is 1 for plain decode, or the accepted tokens per verify step (the
    acceptance length) for speculative decoding.
    """
    if batch <= 0:
        raise ValueError(f"batch must be positive, got {batch}")
    parts: dict[str, float] = {}
    counts: dict[str, int] = {}
    missing = []
    for kind, count in layer_mix.items():
        if count <= 0:
            continue
        span = kind_span_us.get(kind)
        if span is None:
            missing.append(kind)
            continue
        parts[kind] = count * float(span)
        counts[kind] = int(count)
    if not parts:
        raise ValueError("no layer kind of the mix was measured")
    step = sum(parts.values()) + outside_us
    tokens = batch * tokens_per_seq
    return StepProjection(
        step_us=step,
        tok_s=tokens / (step * 1e-6),
        batch=batch,
        tokens_per_step=tokens,
        parts=parts,
        missing=tuple(missing),
        outside_us=outside_us,
        counts=counts,
    )


def bytes_floor_us(layer_bytes: float, copy_bw_tbs: float) -> float:
    """The time to move ``layer_bytes`` at the measured copy bandwidth, in microseconds."""
    if copy_bw_tbs <= 0:
        raise ValueError("copy bandwidth must be positive")
    return layer_bytes / (copy_bw_tbs * 1e12) * 1e6


def projection_table(rows: list[dict]) -> pa.Table:
    """Rows of dicts (backend, batch, step_us, tok_s, label, ...) as an Arrow table."""
    return pa.Table.from_pylist(rows)
