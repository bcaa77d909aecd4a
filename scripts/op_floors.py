"""Each op's share of a decodescope run's layers against the op's own bytes floor.

    python scripts/op_floors.py results@specialized-20261204T031629 [--kind mla] [--json]

For a run of decodescope's own workloads (``standard`` or ``specialized``, a preset of
:mod:`decodescope.kernels.config`): per layer kind and op, the op's share of the layer
(:func:`decodescope.analysis.metrics.op_table`: the median over layer-steps of what the op adds to
the step's GPU timeline, its PDL wait left out), the bytes the op must move (its part of
:func:`decodescope.kernels.bytes.layer_bytes_breakdown`, the same parts the layer floor sums, the
routed experts from the run's recorded ``layer_bytes``), that part's floor at the copy bandwidth
measured beside the run, and the share over it: the op table of ``decodescope report`` with
its floors (:func:`decodescope.ui.op_floors.op_floors`; the parts each op name moves:
:data:`decodescope.kernels.bytes.OP_PARTS`), as a Markdown table or JSON.

What it is for: at batch 1 a layer's share over its floor splits into ops that stream at about
the copy rate and ops whose share is latency (a decode over a few MB, a one-CTA RMSNorm, a
top-k) that no bandwidth figure explains. Used for notes/specialized.md "Session 36: the batch-1
budget".
"""

from __future__ import annotations

import argparse
import json
import sys

from decodescope import tracer
from decodescope.analysis import metrics
from decodescope.ui.op_floors import op_floors


class FloorError(ValueError):
    pass


def rows(run, kinds: list[str] | None = None) -> list[dict]:
    """One row per (layer kind, op): share, bytes, floor and share - floor (``decodescope
    report``'s op table, :func:`decodescope.ui.op_floors.op_floors`)."""
    if not run.meta.copy_bw_tbs:
        raise FloorError(f"{run.meta.run_id}: no copy bandwidth measured beside the run")
    ops, why = op_floors(run, metrics.op_table(run.kernels))
    if "op_floor_us" not in ops.column_names:
        raise FloorError(f"{run.meta.run_id}: {why or 'not a run of decodescope workloads'}")
    out = []
    for r in ops.to_pylist():
        if r["layer_kind"] is None or (kinds and r["layer_kind"] not in kinds):
            continue
        row = {"kind": r["layer_kind"], "block": r["block"], "op": r["op"],
               "kernels": r["kernels"], "share_us": r["share_us"], "bytes": r["bytes"],
               "floor_us": r["op_floor_us"], "over_us": r["share_over_floor_us"]}  # fmt: skip
        if "compute_floor_us" in r:  # the run measured its GEMM rate
            row.update(flops=r["flops"], compute_floor_us=r["compute_floor_us"], bound=r["bound"])
        out.append(row)
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
    except (FloorError, OSError, ValueError) as e:
        print(f"op_floors: {a.run}: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(out, indent=1))
        return 0
    m = run.meta
    comp = bool(out) and "compute_floor_us" in out[0]
    rate = f", GEMM {m.gemm_tflops:.0f} TFLOP/s" if comp else ""
    print(f"{m.run_id} ({m.gpu}, TP{m.tp_shape} shapes, batch {m.batch}x{m.tokens_per_seq}, "
          f"copy {m.copy_bw_tbs:.2f} TB/s{rate}, commit {(m.git_commit or '?')[:7]})")  # fmt: skip
    extra = " GFLOP | compute floor us | bound |" if comp else ""
    print(f"| kind | op | kernels | share us | MB | floor us | share - floor us |{extra}")
    print("|---|---|---:|---:|---:|---:|---:|" + ("---:|---:|---|" if comp else ""))
    for kind in dict.fromkeys(r["kind"] for r in out):
        rs = [r for r in out if r["kind"] == kind]
        for r in rs:
            tail = (f" {r['flops'] / 1e9:.1f} | {r['compute_floor_us']:.1f} | {r['bound'] or '-'} |"
                    if comp else "")  # fmt: skip
            print(f"| {kind} | {r['block']}.{r['op']} | {r['kernels']:.0f} | {r['share_us']:.1f} | "
                  f"{r['bytes'] / 1e6:.1f} | {r['floor_us']:.1f} | {r['over_us']:+.1f} |{tail}")  # fmt: skip
        s = sum(r["share_us"] for r in rs)
        f = sum(r["floor_us"] for r in rs)
        tail = ""
        if comp:  # the ops' larger floors summed: what no kernel of theirs can beat
            roof = sum(max(r["floor_us"], r["compute_floor_us"]) for r in rs)
            tail = (f" {sum(r['flops'] for r in rs) / 1e9:.1f} | {roof:.1f} (the larger floor "
                    "per op, summed) | |")  # fmt: skip
        print(f"| {kind} | (sum of the ops) | {sum(r['kernels'] for r in rs):.0f} | {s:.1f} | "
              f"{sum(r['bytes'] for r in rs) / 1e6:.1f} | {f:.1f} | {s - f:+.1f} |{tail}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
