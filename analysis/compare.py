"""Run A against run B: per layer kind, per layer and per op, with deltas, ratio and a verdict.

Every table has ``a_<m>`` and ``b_<m>`` columns, ``<m>_delta`` (b - a) and ``ratio``
(a_span_us / b_span_us: the speedup of B; above 1 means B is faster). Rows present on one side
only keep nulls on the other. Pure: attributed kernels tables in, tables out.
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from decodescope.analysis import metrics

__all__ = [
    "compare_kinds",
    "compare_layers",
    "compare_ops",
    "only_one_side",
    "fused_coverage",
    "verdict",
    "verdicts",
]

_LAYER_METRICS = ("kernels", "span_us", "busy_us", "gaps_us", "kernel_sum_us", "share_us")
_OP_METRICS = ("kernels", "span_us", "kernel_sum_us", "share_us")
_NULL_KEY = "\x00"  # stands for a null key while joining (Arrow joins never match nulls)


def _keyed(t: pa.Table, keys: list[str]) -> pa.Table:
    for k in keys:
        i = t.schema.get_field_index(k)
        col = t[k]
        if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
            t = t.set_column(i, k, pc.fill_null(col, _NULL_KEY))
        else:
            t = t.set_column(i, k, pc.fill_null(col, -1))
    return t


def _unkey(t: pa.Table, keys: list[str]) -> pa.Table:
    for k in keys:
        i = t.schema.get_field_index(k)
        col = t[k]
        null = pa.scalar(None, col.type)
        if pa.types.is_string(col.type):
            t = t.set_column(i, k, pc.if_else(pc.equal(col, _NULL_KEY), null, col))
        else:
            t = t.set_column(i, k, pc.if_else(pc.equal(col, -1), null, col))
    return t


def _side_by_side(a: pa.Table, b: pa.Table, keys: list[str], ms: tuple[str, ...]) -> pa.Table:
    """Full outer join of two summary tables on ``keys``: a_m, b_m, m_delta, ratio."""
    extra = [c for c in ("layers", "steps", "layer_steps") if c in a.column_names]
    cols = [*keys, *extra, *ms]
    a2 = _keyed(a.select(cols), keys).rename_columns(keys + [f"a_{c}" for c in cols[len(keys) :]])
    b2 = _keyed(b.select(cols), keys).rename_columns(keys + [f"b_{c}" for c in cols[len(keys) :]])
    j = a2.join(b2, keys, join_type="full outer", coalesce_keys=True)
    j = _unkey(j, keys).sort_by([(k, "ascending") for k in keys])
    out = j.select(keys)
    for c in extra:
        out = out.append_column(f"a_{c}", j[f"a_{c}"]).append_column(f"b_{c}", j[f"b_{c}"])
    for m in ms:
        a_m = j[f"a_{m}"].cast(pa.float64())
        b_m = j[f"b_{m}"].cast(pa.float64())
        out = out.append_column(f"a_{m}", a_m).append_column(f"b_{m}", b_m)
        out = out.append_column(f"{m}_delta", pc.subtract(b_m, a_m))
    a_s = out["a_span_us"].to_numpy(zero_copy_only=False).astype(float)
    b_s = out["b_span_us"].to_numpy(zero_copy_only=False).astype(float)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where((b_s > 0) & np.isfinite(a_s), a_s / b_s, np.nan)
    out = out.append_column("ratio", pa.array(ratio, from_pandas=True))
    return out


def compare_kinds(a_kernels: pa.Table, b_kernels: pa.Table) -> pa.Table:
    """Per layer kind (medians over the layers of the kind): A vs B."""
    return _side_by_side(
        metrics.kind_table(a_kernels), metrics.kind_table(b_kernels), ["layer_kind"], _LAYER_METRICS
    )


def compare_layers(a_kernels: pa.Table, b_kernels: pa.Table) -> pa.Table:
    """Per (rank, layer) (medians over steps): A vs B. The layer kind of each side is kept."""
    a = metrics.layer_table(a_kernels)
    b = metrics.layer_table(b_kernels)
    out = _side_by_side(a, b, ["rank", "layer"], _LAYER_METRICS)
    # the kind: A's where A has the layer, else B's
    ka = _kind_of(a, out)
    kb = _kind_of(b, out)
    return (
        out.add_column(2, "layer_kind", pc.coalesce(ka, kb))
        .add_column(3, "a_layer_kind", ka)
        .add_column(4, "b_layer_kind", kb)
    )


def _kind_of(side: pa.Table, out: pa.Table) -> pa.Array:
    lut = {
        (r, lyr): k
        for r, lyr, k in zip(
            side["rank"].to_pylist(),
            side["layer"].to_pylist(),
            side["layer_kind"].to_pylist(),
            strict=True,
        )
    }
    return pa.array(
        [
            lut.get((r, lyr))
            for r, lyr in zip(out["rank"].to_pylist(), out["layer"].to_pylist(), strict=True)
        ],
        pa.string(),
    )


def compare_ops(a_kernels: pa.Table, b_kernels: pa.Table) -> pa.Table:
    """Per (layer_kind, block, op): kernels per layer-step, span, kernel-sum and share, A vs B."""
    a = metrics.op_table(a_kernels)
    b = metrics.op_table(b_kernels)
    return _side_by_side(a, b, ["layer_kind", "block", "op"], _OP_METRICS)


def only_one_side(a_kernels: pa.Table, b_kernels: pa.Table) -> pa.Table:
    """Kernel names that ran on one side only: side ("a" | "b"), name, calls, total_us, ops."""
    ka = metrics.kernel_table(a_kernels)
    kb = metrics.kernel_table(b_kernels)
    names_a = set(ka["name"].to_pylist())
    names_b = set(kb["name"].to_pylist())
    parts = []
    for side, t, other in (("a", ka, names_b), ("b", kb, names_a)):
        mask = pa.array([n not in other for n in t["name"].to_pylist()], pa.bool_())
        sel = t.filter(mask).select(["name", "calls", "total_us", "ops"])
        parts.append(sel.add_column(0, "side", pa.array([side] * sel.num_rows, pa.string())))
    return pa.concat_tables(parts)


def fused_coverage(a_kernels: pa.Table, b_kernels: pa.Table) -> pa.Table:
    """For each B op named "x+y+z" (a fused op): the A ops it covers and A's figures for them.

    Columns: layer_kind, block, b_op, covers (A ops found), missing (parts A lacks), a_kernels
    and a_span_us (the sums over the covered A ops, per layer-step medians), b_kernels, b_span_us,
    and a_share_us / b_share_us (what the ops add to the step: ``metrics.op_table``'s share_us;
    B's span overstates a fused op whose kernels wait in ``griddepcontrol.wait``).
    """
    a = metrics.op_table(a_kernels)
    b = metrics.op_table(b_kernels)
    a_rows = a.to_pylist()
    rows = []
    for r in b.to_pylist():
        op = r["op"]
        if not op or "+" not in op:
            continue
        parts = [p for p in op.split("+") if p]
        if any(x["op"] == op for x in a_rows):  # A runs the same fused op (one name, one range)
            parts = [op]
        covers, missing = [], []
        a_k = 0.0
        a_s = 0.0
        a_sh = 0.0
        for p in parts:
            same_kind = [x for x in a_rows if x["op"] == p and x["layer_kind"] == r["layer_kind"]]
            hits = same_kind or [x for x in a_rows if x["op"] == p]
            if hits:
                covers.append(p)
                a_k += sum(x["kernels"] for x in hits)
                a_s += sum(x["span_us"] for x in hits)
                a_sh += sum(x["share_us"] for x in hits)
            else:
                missing.append(p)
        rows.append(
            {
                "layer_kind": r["layer_kind"],
                "block": r["block"],
                "b_op": op,
                "covers": covers,
                "missing": missing,
                "a_kernels": a_k if covers else None,
                "a_span_us": a_s if covers else None,
                "b_kernels": r["kernels"],
                "b_span_us": r["span_us"],
                "a_share_us": a_sh if covers else None,
                "b_share_us": r["share_us"],
            }
        )
    schema = pa.schema(
        [
            ("layer_kind", pa.string()),
            ("block", pa.string()),
            ("b_op", pa.string()),
            ("covers", pa.list_(pa.string())),
            ("missing", pa.list_(pa.string())),
            ("a_kernels", pa.float64()),
            ("a_span_us", pa.float64()),
            ("b_kernels", pa.float64()),
            ("b_span_us", pa.float64()),
            ("a_share_us", pa.float64()),
            ("b_share_us", pa.float64()),
        ]
    )
    return pa.Table.from_pylist(rows, schema=schema)


def _fmt_num(x: float) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.0f}" if abs(x - round(x)) < 1e-9 or abs(x) >= 100 else f"{x:.3g}"


def verdicts(kinds: pa.Table) -> list[str]:
    """One sentence per layer kind of a :func:`compare_kinds` table, e.g.
    "B is 1.88x faster per KDA layer: 23 -> 13 kernels, 130 -> 69 us"."""
    out = []
    for r in kinds.to_pylist():
        kind = r["layer_kind"] or "(none)"
        label = kind.upper() if kind in ("kda", "mla") else kind
        noun = "layer" if label == "layer" else f"{label} layer"
        plural = "layers" if label == "layer" else f"{label} layers"  # not "layer layers"
        if r["a_span_us"] is None:
            out.append(
                f"{plural} only in B ({_fmt_num(r['b_kernels'])} kernels, {_fmt_num(r['b_span_us'])} us)"
            )
            continue
        if r["b_span_us"] is None:
            out.append(
                f"{plural} only in A ({_fmt_num(r['a_kernels'])} kernels, {_fmt_num(r['a_span_us'])} us)"
            )
            continue
        ratio = r["ratio"]
        figures = (
            f"{_fmt_num(r['a_kernels'])} -> {_fmt_num(r['b_kernels'])} kernels, "
            f"{_fmt_num(r['a_span_us'])} -> {_fmt_num(r['b_span_us'])} us"
        ) + _share_note(r)
        if ratio is None or (isinstance(ratio, float) and math.isnan(ratio)):
            out.append(f"{noun}: {figures}")
        elif ratio >= 1.005:
            out.append(f"B is {ratio:.2f}x faster per {noun}: {figures}")
        elif ratio <= 1 / 1.005:
            out.append(f"B is {1 / ratio:.2f}x slower per {noun}: {figures}")
        else:
            out.append(f"B is as fast as A per {noun} (1.00x): {figures}")
    return out


def _share_note(r: dict) -> str:
    """ ", by share 113 -> 112 us (1.01x faster)" where a side's layers overlap the layer before them
    (programmatic dependent launch: share below span by 1% or more), so the span, which counts
    that overlap, and the share, which does not, can tell different stories; "" otherwise."""
    sa, sb = r.get("a_share_us"), r.get("b_share_us")
    pa_, pb = r.get("a_span_us"), r.get("b_span_us")
    if not (sa and sb and pa_ and pb) or (sa >= 0.99 * pa_ and sb >= 0.99 * pb):
        return ""
    r_ = sa / sb  # B's speedup by share, said in words: it may point the other way than the span
    how = (
        f"{r_:.2f}x faster"
        if r_ >= 1.005
        else f"{1 / r_:.2f}x slower"
        if r_ <= 1 / 1.005
        else "as fast, 1.00x"
    )
    return f", by share {_fmt_num(sa)} -> {_fmt_num(sb)} us ({how})"


def verdict(a_kernels: pa.Table, b_kernels: pa.Table) -> str:
    """The comparison in a line per layer kind (joined by "; ")."""
    lines = verdicts(compare_kinds(a_kernels, b_kernels))
    return "; ".join(lines) if lines else "no layers on either side: nothing to compare per layer"
