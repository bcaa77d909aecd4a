"""Each op's share of a decodescope run's layers against the op's own bytes floor.

    python scripts/op_floors.py results@specialized-20261204T031629 [--kind mla] [--json]

For a run of decodescope's own workloads (``standard`` or ``specialized``, a preset of
:mod:`decodescope.kernels.config`): per layer kind and op, the op's share of the layer
(:func:`decodescope.analysis.metrics.op_table`: the median over layer-steps of what the op adds to
the step's GPU timeline, its PDL wait left out), the bytes the op must move (its part of
:func:`decodescope.kernels.bytes.layer_bytes_breakdown`, the same parts the layer floor sums, the
routed experts from the run's recorded ``layer_bytes``), that part's floor at the copy bandwidth
measured beside the run, and the share over it. The ops of a fused kernel are the ``+``-joined
names of what they fuse; each name maps to its parts below (norm weights, activations, routing
work: no bytes of their own). The shared experts' gate/up (2/3 of their bytes) go to an op that
also holds the router or the latent down-projection, their down projection (1/3) to one that
holds the routed experts, all of them to an op of their own.

What it is for: at batch 1 a layer's share over its floor splits into ops that stream at about
the copy rate and ops whose share is latency (a decode over a few MB, a one-CTA RMSNorm, a
top-k) that no bandwidth figure explains. Used for notes/specialized.md "Session 36: the batch-1
budget".
"""

from __future__ import annotations

import argparse
import json
import sys

import pyarrow.compute as pc

from decodescope import tracer
from decodescope.analysis import metrics
from decodescope.kernels import bytes as kbytes
from decodescope.kernels import config as kconfig

# sub-op name -> {bytes part: fraction}; the parts are kernels.bytes.layer_bytes_breakdown's
PARTS: dict[str, dict[str, float]] = {
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
NO_BYTES = {"gated_norm", "gate_mul", "grouped_topk", "align", "topk_sum", "latent_norm", "add",
            "act", "copy"}  # fmt: skip


class FloorError(ValueError):
    pass


def op_parts(op: str) -> dict[str, float]:
    """The bytes parts (with fractions) of one op, a ``+``-joined list of sub-op names."""
    subs = op.split("+")
    out: dict[str, float] = {}
    for s in subs:
        if s == "shared_experts":
            if "router" in subs or "latent_down" in subs:
                frac = 2 / 3  # gate / up beside the MoE front
            elif "routed_experts" in subs:
                frac = 1 / 3  # the down projection beside the routed experts
            else:
                frac = 1.0
            out["shared_experts"] = out.get("shared_experts", 0.0) + frac
            continue
        if s in NO_BYTES:
            continue
        if s not in PARTS:
            raise FloorError(f"op {op!r}: no bytes known for {s!r}")
        for part, f in PARTS[s].items():
            out[part] = out.get(part, 0.0) + f
    return out


def kind_parts(run, kind: str) -> dict[str, int]:
    """The layer kind's bytes parts at the run's shapes; the routed experts as the recorded
    ``layer_bytes`` has them (the experts the run's routing selected)."""
    cfg_json = run.meta.config_json
    cfg_json = json.loads(cfg_json) if isinstance(cfg_json, str) else (cfg_json or {})
    wl = (cfg_json.get("workload") or {}).get("config") or {}
    preset = wl.get("preset") or run.meta.preset
    tp = wl.get("tp") or run.meta.tp_shape
    if not preset or not tp:
        raise FloorError(f"{run.meta.run_id}: not a run of decodescope's workloads (no preset)")
    opts = {k: wl[k] for k in ("context_len", "kv_cache_dtype", "expert_dtype") if k in wl}
    cfg = kconfig.get_config(preset, tp, **opts)
    parts = kbytes.layer_bytes_breakdown(
        cfg, kind, run.meta.batch or 1, run.meta.tokens_per_seq or 1, selected=0
    )
    recorded = (run.meta.layer_bytes or {}).get(kind)
    if recorded is None:
        raise FloorError(f"{run.meta.run_id}: no layer_bytes recorded for {kind!r}")
    if kind != "dense":
        parts["routed_experts"] = recorded - sum(
            v for k, v in parts.items() if k != "routed_experts"
        )
    return parts


def rows(run, kinds: list[str] | None = None) -> list[dict]:
    bw = run.meta.copy_bw_tbs
    if not bw:
        raise FloorError(f"{run.meta.run_id}: no copy bandwidth measured beside the run")
    ops = metrics.op_table(run.kernels)
    out = []
    for kind in sorted(set(pc.drop_null(ops["layer_kind"]).to_pylist())):
        if kinds and kind not in kinds:
            continue
        parts = kind_parts(run, kind)
        used: dict[str, float] = {}
        sel = ops.filter(pc.equal(ops["layer_kind"], kind))
        for r in sel.to_pylist():
            fr = op_parts(r["op"])
            nbytes = sum(parts.get(p, 0) * f for p, f in fr.items())
            for p, f in fr.items():
                used[p] = used.get(p, 0.0) + f
            floor = nbytes / (bw * 1e6)
            out.append({"kind": kind, "block": r["block"], "op": r["op"],
                        "kernels": r["kernels"], "share_us": r["share_us"], "bytes": int(nbytes),
                        "floor_us": floor, "over_us": r["share_us"] - floor})  # fmt: skip
        missing = {p: round(1 - used.get(p, 0.0), 3) for p in parts
                   if parts[p] and abs(1 - used.get(p, 0.0)) > 1e-6}  # fmt: skip
        if missing:
            raise FloorError(
                f"{run.meta.run_id}: the {kind} ops do not cover the layer's bytes once "
                f"(part: fraction left over) {missing}"
            )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", help="run folder or DATASET@RUN_ID of a decodescope bench or capture")
    ap.add_argument("--kind", action="append", help="layer kind(s) to show (default: all)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    a = ap.parse_args(argv)
    try:
        run = tracer.load(a.run)
        out = rows(run, a.kind)
    except (FloorError, kconfig.ConfigError, OSError, ValueError) as e:
        print(f"op_floors: {a.run}: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(out, indent=1))
        return 0
    m = run.meta
    print(f"{m.run_id} ({m.gpu}, TP{m.tp_shape} shapes, batch {m.batch}x{m.tokens_per_seq}, "
          f"copy {m.copy_bw_tbs:.2f} TB/s, commit {(m.git_commit or '?')[:7]})")  # fmt: skip
    print("| kind | op | kernels | share us | MB | floor us | share - floor us |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for kind in dict.fromkeys(r["kind"] for r in out):
        rs = [r for r in out if r["kind"] == kind]
        for r in rs:
            print(f"| {kind} | {r['block']}.{r['op']} | {r['kernels']:.0f} | {r['share_us']:.1f} | "
                  f"{r['bytes'] / 1e6:.1f} | {r['floor_us']:.1f} | {r['over_us']:+.1f} |")  # fmt: skip
        s = sum(r["share_us"] for r in rs)
        f = sum(r["floor_us"] for r in rs)
        print(f"| {kind} | (sum of the ops) | {sum(r['kernels'] for r in rs):.0f} | {s:.1f} | "
              f"{sum(r['bytes'] for r in rs) / 1e6:.1f} | {f:.1f} | {s - f:+.1f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
