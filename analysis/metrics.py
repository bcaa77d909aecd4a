"""Per-layer, per-op and per-kernel figures (DESIGN.md section 7), from an attributed kernels table.

- kernels: kernel executions attributed to the layer in one step;
- span_us: last kernel end - first kernel start of the layer in one step (GPU timeline);
- busy_us: length of the union of the layer's kernel intervals; gaps_us = span_us - busy_us;
- kernel_sum_us: sum of kernel durations (exceeds span when streams overlap);
- share_us: the layer's share of the step: last kernel end minus the later of its first kernel
  start and the previous layer's last kernel end (same rank and step; the previous layer is the
  one of the next lower index that ran in the step). Equal to span_us when layers do not
  overlap; smaller when the layer's first kernel starts before the previous layer has ended
  (programmatic dependent launch: it is resident and waits at ``griddepcontrol.wait``, or
  streams overlap across the boundary). The shares of consecutive layers add up to the step's
  time, where the spans would count each overlap twice: projections sum shares.
- op share_us (``op_table``): the same idea one level down, what an op adds to the step's GPU
  timeline. Each op of a (rank, step) covers the interval from its first kernel start to its
  last kernel end; every instant covered by some op is charged to the covering op that ends
  first (the one the timeline is waiting on). Under programmatic dependent launch a kernel's
  recorded duration includes its wait in ``griddepcontrol.wait`` for the previous kernel, so
  span_us and kernel_sum_us of such an op overstate it: its share starts where the previous op
  ended. On one stream without such waits share_us equals span_us. A step's op shares add up
  to the union of its ops' intervals: time between ops (launch bubbles) is nobody's.

Per-step figures are summarised over steps as the median with min and max. Pure pyarrow + numpy.
"""

from __future__ import annotations

import heapq

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

# intervals up to which first_ending_shares builds its segments x intervals matrix
_DENSE_MAX = 1024

METRICS = ("kernels", "span_us", "busy_us", "gaps_us", "kernel_sum_us", "share_us")

__all__ = [
    "METRICS",
    "layer_steps",
    "layer_table",
    "kind_table",
    "op_table",
    "kernel_table",
    "group_stats",
    "with_floor",
]


def _num(col: pa.ChunkedArray | pa.Array, dtype=np.int64) -> np.ndarray:
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if pa.types.is_dictionary(col.type):
        col = col.cast(col.type.value_type)
    return col.to_numpy(zero_copy_only=False).astype(dtype, copy=False)


def _plain(t: pa.Table) -> pa.Table:
    """Decode dictionary columns (group_by keys must be comparable across chunks)."""
    cols = []
    for c in t.columns:
        if pa.types.is_dictionary(c.type):
            c = c.cast(c.type.value_type)
        cols.append(c)
    return pa.Table.from_arrays(cols, names=t.column_names)


def _group_ids(t: pa.Table, keys: list[str]) -> tuple[pa.Table, np.ndarray]:
    """(one row per distinct key, sorted; group id of every row of t)."""
    n = t.num_rows
    tt = _plain(t.select(keys)).append_column("__row", pa.array(np.arange(n, dtype=np.int64)))
    g = tt.group_by(keys, use_threads=False).aggregate([("__row", "list")])
    g = g.sort_by([(k, "ascending") for k in keys])
    rows = g["__row_list"].combine_chunks()
    flat = _num(rows.flatten())
    lens = _num(pc.list_value_length(rows))
    gid = np.empty(n, dtype=np.int64)
    gid[flat] = np.repeat(np.arange(len(lens), dtype=np.int64), lens)
    return g.drop_columns(["__row_list"]), gid


def _median_min_max(values: np.ndarray, gid: np.ndarray, ngroups: int):
    """Exact median, min and max of ``values`` per group (groups with no value give NaN)."""
    order = np.lexsort((values, gid))
    v = values[order]
    g = gid[order]
    counts = np.bincount(g, minlength=ngroups)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    med = np.full(ngroups, np.nan)
    mn = np.full(ngroups, np.nan)
    mx = np.full(ngroups, np.nan)
    ok = counts > 0
    lo = starts + (counts - 1) // 2
    hi = starts + counts // 2
    med[ok] = (v[lo[ok]] + v[hi[ok]]) / 2.0
    mn[ok] = v[starts[ok]]
    mx[ok] = v[starts[ok] + counts[ok] - 1]
    return med, mn, mx


def group_stats(
    t: pa.Table, keys: list[str], metrics: tuple[str, ...] | list[str], count_name: str
) -> pa.Table:
    """One row per distinct ``keys``: the row count as ``count_name``, and for each metric m:
    m (median), m_min, m_max."""
    groups, gid = _group_ids(t, keys)
    ng = groups.num_rows
    out = groups.append_column(count_name, pa.array(np.bincount(gid, minlength=ng), pa.int64()))
    for m in metrics:
        med, mn, mx = _median_min_max(_num(t[m], np.float64), gid, ng)
        out = out.append_column(m, pa.array(med))
        out = out.append_column(f"{m}_min", pa.array(mn))
        out = out.append_column(f"{m}_max", pa.array(mx))
    return out


def _attributed(kernels: pa.Table) -> pa.Table:
    return kernels.filter(pc.is_valid(kernels["layer"]))


def _interval_stats(
    start: np.ndarray, end: np.ndarray, gid: np.ndarray, ngroups: int
) -> dict[str, np.ndarray]:
    """count, span, busy (union length) and kernel-sum per group, in ns (floats)."""
    end = np.maximum(end, start)
    counts = np.bincount(gid, minlength=ngroups)
    first = np.full(ngroups, np.iinfo(np.int64).max, dtype=np.int64)
    last = np.full(ngroups, np.iinfo(np.int64).min, dtype=np.int64)
    np.minimum.at(first, gid, start)
    np.maximum.at(last, gid, end)
    ksum = np.bincount(gid, weights=(end - start).astype(np.float64), minlength=ngroups)
    # busy: make groups disjoint on one axis (relative times, group g shifted by g * stride),
    # then one running-max sweep merges overlapping intervals
    rel_s = start - first[gid]
    rel_e = end - first[gid]
    stride = int(rel_e.max(initial=0)) + 2
    s = rel_s + gid * stride
    e = rel_e + gid * stride
    order = np.lexsort((s, gid))
    s = s[order]
    e = e[order]
    g = gid[order]
    busy = np.zeros(ngroups)
    if len(s):
        prev_max = np.maximum.accumulate(e)
        new = np.ones(len(s), dtype=bool)
        new[1:] = s[1:] > prev_max[:-1]
        block_starts = np.flatnonzero(new)
        block_end = np.maximum.reduceat(e, block_starts)
        lengths = (block_end - s[block_starts]).astype(np.float64)
        busy = np.bincount(g[block_starts], weights=lengths, minlength=ngroups)
    span = np.where(counts > 0, last - first, 0).astype(np.float64)
    return {"kernels": counts, "span": span, "busy": busy, "kernel_sum": ksum}


def _steps_of(kernels: pa.Table, keys: list[str]) -> pa.Table:
    groups, gid = _group_ids(kernels, keys)
    st = _interval_stats(_num(kernels["start_ns"]), _num(kernels["end_ns"]), gid, groups.num_rows)
    return groups, gid, st


def layer_steps(kernels: pa.Table) -> pa.Table:
    """One row per (rank, step, layer): layer_kind, kernels, span_us, busy_us, gaps_us,
    kernel_sum_us, share_us. Kernels without a layer are left out (they have no layer to count
    in)."""
    k = _attributed(kernels)
    k = k.append_column("__kind", pc.fill_null(_plain(k.select(["layer_kind"]))["layer_kind"], ""))
    k = k.set_column(k.schema.get_field_index("step"), "step", pc.fill_null(k["step"], 0))
    keys = ["rank", "step", "layer", "__kind"]
    if k.num_rows == 0:
        return pa.table(
            {
                "rank": pa.array([], pa.int32()),
                "step": pa.array([], pa.int32()),
                "layer": pa.array([], pa.int32()),
                "layer_kind": pa.array([], pa.string()),
                **{
                    m: pa.array([], pa.int64() if m == "kernels" else pa.float64()) for m in METRICS
                },
            }
        )
    groups, gid, st = _steps_of(k, keys)
    kind = pc.if_else(
        pc.equal(groups["__kind"], ""), pa.scalar(None, pa.string()), groups["__kind"]
    )
    share = _shares(groups, gid, _num(k["start_ns"]), _num(k["end_ns"]), st["span"])
    return pa.table(
        {
            "rank": groups["rank"],
            "step": groups["step"],
            "layer": groups["layer"],
            "layer_kind": kind,
            "kernels": pa.array(st["kernels"], pa.int64()),
            "span_us": pa.array(st["span"] / 1e3),
            "busy_us": pa.array(st["busy"] / 1e3),
            "gaps_us": pa.array((st["span"] - st["busy"]) / 1e3),
            "kernel_sum_us": pa.array(st["kernel_sum"] / 1e3),
            "share_us": pa.array(share / 1e3),
        }
    )


def _shares(
    groups: pa.Table, gid: np.ndarray, start: np.ndarray, end: np.ndarray, span: np.ndarray
) -> np.ndarray:
    """share (ns) per (rank, step, layer) group: see the module docstring. ``groups`` is sorted
    by rank, step, layer (so a group's predecessor in the step is the row before it)."""
    n = groups.num_rows
    end = np.maximum(end, start)
    first = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)
    last = np.full(n, np.iinfo(np.int64).min, dtype=np.int64)
    np.minimum.at(first, gid, start)
    np.maximum.at(last, gid, end)
    share = span.astype(np.float64).copy()
    if n > 1:
        rank = _num(pc.fill_null(groups["rank"], -1))
        step = _num(groups["step"])
        same = (rank[1:] == rank[:-1]) & (step[1:] == step[:-1])
        begin = np.maximum(first[1:], last[:-1])
        share[1:] = np.where(same, np.maximum(last[1:] - begin, 0), share[1:])
    return share


def layer_table(kernels: pa.Table) -> pa.Table:
    """One row per (rank, layer): layer_kind, steps, and for each metric m: m (median over steps),
    m_min, m_max."""
    ls = layer_steps(kernels)
    ls = ls.set_column(3, "layer_kind", pc.fill_null(ls["layer_kind"], ""))
    out = group_stats(ls, ["rank", "layer", "layer_kind"], METRICS, "steps")
    kind = pc.if_else(
        pc.equal(out["layer_kind"], ""), pa.scalar(None, pa.string()), out["layer_kind"]
    )
    out = out.set_column(2, "layer_kind", kind)
    return out.sort_by([("rank", "ascending"), ("layer", "ascending")])


def kind_table(kernels: pa.Table) -> pa.Table:
    """One row per layer_kind: layers, steps (median per layer), and for each metric m: m (median
    over the layers of that kind of the per-layer medians), m_min and m_max (the least and the
    greatest per-layer median): the "a KDA layer: 23 kernels, 130 us" figure."""
    lt = layer_table(kernels)
    cols = ["layer_kind", "steps", *METRICS]
    lt = lt.select(cols)
    lt = lt.set_column(0, "layer_kind", pc.fill_null(lt["layer_kind"], "(none)"))
    lt = lt.set_column(1, "steps", lt["steps"].cast(pa.float64()))
    out = group_stats(lt, ["layer_kind"], ("steps", *METRICS), "layers")
    out = out.drop_columns(["steps_min", "steps_max"])
    return out.sort_by([("layer_kind", "ascending")])


def _list_distinct(t: pa.Table, keys: list[str], col: str, out_name: str) -> pa.Table:
    """Distinct values of ``col`` per key, rows sorted by the keys (aligned with group_stats)."""
    g = _plain(t.select([*keys, col])).group_by(keys, use_threads=False)
    out = g.aggregate([(col, "distinct")]).rename_columns([*keys, out_name])
    return out.sort_by([(k, "ascending") for k in keys])


def _op_shares(groups: pa.Table, gid: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """share (ns) per op group (one op of one layer in one rank and step): see the module
    docstring. ``groups`` has ``rank`` and ``step`` columns; ``gid`` maps kernels to groups."""
    n = groups.num_rows
    end = np.maximum(end, start)
    first = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)
    last = np.full(n, np.iinfo(np.int64).min, dtype=np.int64)
    np.minimum.at(first, gid, start)
    np.maximum.at(last, gid, end)
    rank = _num(pc.fill_null(groups["rank"], -1))
    step = _num(groups["step"])
    share = np.zeros(n, dtype=np.float64)
    order = np.lexsort((step, rank))
    cut = np.flatnonzero((np.diff(rank[order]) != 0) | (np.diff(step[order]) != 0)) + 1
    for idx in np.split(order, cut):  # one (rank, step) at a time
        share[idx] = first_ending_shares(first[idx], last[idx])
    return share


def first_ending_shares(start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Each interval's share of the union of the intervals ``[start, end)``: every instant that
    some interval covers is charged to the covering interval that ends first (the one the
    timeline is waiting on), so the shares add up to the union's length. Under programmatic
    dependent launch an interval resident early (waiting at ``griddepcontrol.wait``) gets only
    the time after the one before it has ended. Same units as the inputs; float64."""
    start = np.asarray(start, dtype=np.int64)
    end = np.maximum(np.asarray(end, dtype=np.int64), start)
    n = len(start)
    if n == 0:
        return np.zeros(0, dtype=np.float64)
    t = np.unique(np.concatenate([start, end]))
    t0, t1 = t[:-1], t[1:]
    if n <= _DENSE_MAX:  # one segments x intervals matrix
        cover = (start[None, :] <= t0[:, None]) & (end[None, :] >= t1[:, None])
        ends = np.where(cover, end[None, :], np.iinfo(np.int64).max)
        owner = np.argmin(ends, axis=1)
        owned = cover.any(axis=1)
        return np.bincount(owner[owned], weights=(t1 - t0)[owned].astype(np.float64), minlength=n)
    # a sweep over the segments with the covering intervals in a heap by (end, index): the
    # same owner as the matrix's argmin (lowest end, then lowest index), in O(n log n)
    share = np.zeros(n, dtype=np.float64)
    by_start = np.argsort(start, kind="stable")
    heap: list[tuple[int, int]] = []
    i = 0
    for a, b in zip(t0.tolist(), t1.tolist(), strict=True):
        while i < n and start[by_start[i]] <= a:
            j = int(by_start[i])
            heapq.heappush(heap, (int(end[j]), j))
            i += 1
        while heap and heap[0][0] < b:
            heapq.heappop(heap)
        if heap:
            share[heap[0][1]] += b - a
    return share


OP_METRICS = ("kernels", "span_us", "kernel_sum_us", "share_us")


def op_table(kernels: pa.Table) -> pa.Table:
    """One row per (layer_kind, block, op): kernels per layer-step, span_us, kernel_sum_us and
    share_us (medians over layer-steps, with min/max), layer_steps seen, and the kernel names."""
    k = _attributed(kernels)
    k = _plain(
        k.select(
            ["rank", "step", "layer", "layer_kind", "block", "op", "name", "start_ns", "end_ns"]
        )
    )
    for c in ("layer_kind", "block", "op"):
        k = k.set_column(k.schema.get_field_index(c), c, pc.fill_null(k[c], ""))
    k = k.set_column(1, "step", pc.fill_null(k["step"], 0))
    keys = ["layer_kind", "block", "op", "rank", "step", "layer"]
    if k.num_rows == 0:
        return pa.table(
            {
                "layer_kind": pa.array([], pa.string()),
                "block": pa.array([], pa.string()),
                "op": pa.array([], pa.string()),
                "layer_steps": pa.array([], pa.int64()),
                "kernels": pa.array([], pa.float64()),
                "span_us": pa.array([], pa.float64()),
                "kernel_sum_us": pa.array([], pa.float64()),
                "share_us": pa.array([], pa.float64()),
                "kernel_names": pa.array([], pa.list_(pa.string())),
            }
        )
    groups, gid, st = _steps_of(k, keys)
    per = groups.select(["layer_kind", "block", "op"])
    per = per.append_column("kernels", pa.array(st["kernels"].astype(np.float64)))
    per = per.append_column("span_us", pa.array(st["span"] / 1e3))
    per = per.append_column("kernel_sum_us", pa.array(st["kernel_sum"] / 1e3))
    share = _op_shares(groups, gid, _num(k["start_ns"]), _num(k["end_ns"]))
    per = per.append_column("share_us", pa.array(share / 1e3))
    out = group_stats(per, ["layer_kind", "block", "op"], OP_METRICS, "layer_steps")
    names = _list_distinct(k, ["layer_kind", "block", "op"], "name", "kernel_names")
    out = out.append_column("kernel_names", names["kernel_names"])
    for c in ("layer_kind", "block", "op"):
        out = out.set_column(
            out.schema.get_field_index(c),
            c,
            pc.if_else(pc.equal(out[c], ""), pa.scalar(None, pa.string()), out[c]),
        )
    return out.sort_by([("layer_kind", "ascending"), ("block", "ascending"), ("op", "ascending")])


def kernel_table(kernels: pa.Table) -> pa.Table:
    """One row per kernel name: calls, total_us, median_us, min_us, max_us, share of the total
    kernel time, and the ops it ran in ("block.op"; outside a layer op the innermost range's name,
    "(unattributed)" outside every range)."""
    if kernels.num_rows == 0:
        return pa.table(
            {
                "name": pa.array([], pa.string()),
                "calls": pa.array([], pa.int64()),
                "total_us": pa.array([], pa.float64()),
                "median_us": pa.array([], pa.float64()),
                "min_us": pa.array([], pa.float64()),
                "max_us": pa.array([], pa.float64()),
                "share": pa.array([], pa.float64()),
                "ops": pa.array([], pa.list_(pa.string())),
            }
        )
    k = _plain(kernels.select(["name", "start_ns", "end_ns", "block", "op", "range_path", "layer"]))
    dur = (_num(k["end_ns"]) - _num(k["start_ns"])).astype(np.float64) / 1e3
    k = k.append_column("dur_us", pa.array(dur))
    k = k.set_column(0, "name", pc.fill_null(k["name"], "(unnamed)"))
    op = pc.binary_join_element_wise(k["block"], k["op"], ".")
    # outside a layer op: the innermost range's name ("(unattributed)" where there is none)
    innermost = pc.struct_field(pc.extract_regex(k["range_path"], r"(?P<last>[^/]*)$"), [0])
    in_layer = pc.if_else(
        pc.is_valid(k["layer"]), pa.scalar("(layer)"), pa.scalar(None, pa.string())
    )
    op = pc.coalesce(op, k["op"], in_layer, innermost, pa.scalar("(unattributed)"))
    k = k.append_column("op_label", op)
    stats = group_stats(k, ["name"], ("dur_us",), "calls")
    groups, gid = _group_ids(k, ["name"])
    total = np.bincount(gid, weights=dur, minlength=groups.num_rows)
    grand = float(dur.sum()) or 1.0
    ops = _list_distinct(k, ["name"], "op_label", "ops")
    out = pa.table(
        {
            "name": stats["name"],
            "calls": stats["calls"],
            "total_us": pa.array(total),
            "median_us": stats["dur_us"],
            "min_us": stats["dur_us_min"],
            "max_us": stats["dur_us_max"],
            "share": pa.array(total / grand),
            "ops": ops["ops"],
        }
    )
    return out.sort_by([("total_us", "descending"), ("name", "ascending")])


def with_floor(
    kinds: pa.Table, layer_bytes: dict[str, int] | None, copy_bw_tbs: float | None
) -> pa.Table:
    """A :func:`kind_table` with the bytes floor of DESIGN.md section 7 beside the span:
    ``bytes`` (what one layer of the kind must read and write per rank in one step),
    ``floor_us`` = bytes / copy bandwidth, ``efficiency`` = span_us / floor_us (1.0 would be
    a layer running at copy speed) and ``share_efficiency`` = share_us / floor_us (the layer's
    share of the step against its floor: below ``efficiency`` where the layer's first kernel is
    resident early under programmatic dependent launch). Nulls where the run did not measure
    them."""
    n = kinds.num_rows
    lb = layer_bytes or {}
    b = [lb.get(k) for k in kinds["layer_kind"].to_pylist()]
    floor = [(x / (copy_bw_tbs * 1e6)) if x is not None and copy_bw_tbs else None for x in b]
    spans = kinds["span_us"].to_pylist() if n else []
    eff = [s / f if f and s is not None else None for s, f in zip(spans, floor, strict=True)]
    shares = kinds["share_us"].to_pylist() if n and "share_us" in kinds.column_names else [None] * n
    sh_eff = [s / f if f and s is not None else None for s, f in zip(shares, floor, strict=True)]
    return (
        kinds.append_column("bytes", pa.array(b, pa.int64()))
        .append_column("floor_us", pa.array(floor, pa.float64()))
        .append_column("efficiency", pa.array(eff, pa.float64()))
        .append_column("share_efficiency", pa.array(sh_eff, pa.float64()))
    )


# -- several ranks (tp_world > 1) ------------------------------------------------------------------

SKEW_METRICS = ("start_skew_us", "end_skew_us", "span_all_us", "span_rank_max_us")


def ranks_of(kernels: pa.Table) -> list[int]:
    """The ranks present in a kernels table (null rank counts as 0), sorted."""
    if kernels.num_rows == 0:
        return []
    return sorted({int(r) for r in pc.fill_null(kernels["rank"], 0).to_pylist()})


def rank_kind_table(kernels: pa.Table) -> pa.Table:
    """:func:`kind_table` for each rank apart: one row per (rank, layer_kind). With one rank it is
    ``kind_table`` with a ``rank`` column in front."""
    ranks = ranks_of(kernels)
    parts = []
    rank_col = pc.fill_null(kernels["rank"], 0) if kernels.num_rows else None
    for r in ranks:
        kt = kind_table(kernels.filter(pc.equal(rank_col, r)))
        parts.append(kt.add_column(0, "rank", pa.array([r] * kt.num_rows, pa.int32())))
    if not parts:
        kt = kind_table(kernels)
        return kt.add_column(0, "rank", pa.array([], pa.int32()))
    return pa.concat_tables(parts)


def rank_skew(kernels: pa.Table) -> pa.Table:
    """One row per (step, layer) seen on more than one rank: how far apart the ranks ran it.

    - ``start_skew_us``: latest minus earliest of the ranks' layer starts (first kernel start of
      the layer on that rank in that step);
    - ``end_skew_us``: the same for the layer ends (last kernel end);
    - ``span_all_us``: latest end minus earliest start over the ranks (the layer as the group
      ran it); ``span_rank_max_us`` / ``span_rank_min_us``: the longest / shortest rank's span;
    - ``ranks``: ranks that ran it; ``late_rank``: the rank that started last.

    The ranks' clocks must be comparable (one host: CUPTI normalises to the host clock). A rank
    that starts late makes the others wait inside the all-reduce: their all-reduce kernels get
    longer, and their spans with them."""
    ls_cols = ["rank", "step", "layer", "layer_kind"]
    k = _attributed(kernels)
    empty = pa.table(
        {
            "step": pa.array([], pa.int32()),
            "layer": pa.array([], pa.int32()),
            "layer_kind": pa.array([], pa.string()),
            "ranks": pa.array([], pa.int64()),
            "late_rank": pa.array([], pa.int32()),
            **{m: pa.array([], pa.float64()) for m in SKEW_METRICS},
            "span_rank_min_us": pa.array([], pa.float64()),
        }
    )
    if k.num_rows == 0:
        return empty
    k = _plain(k.select([*ls_cols, "start_ns", "end_ns"]))
    k = k.set_column(0, "rank", pc.fill_null(k["rank"], 0))
    k = k.set_column(1, "step", pc.fill_null(k["step"], 0))
    k = k.set_column(3, "layer_kind", pc.fill_null(k["layer_kind"], ""))
    groups, gid = _group_ids(k, ls_cols)
    ng = groups.num_rows
    start = _num(k["start_ns"])
    end = np.maximum(_num(k["end_ns"]), start)
    first = np.full(ng, np.iinfo(np.int64).max, dtype=np.int64)
    last = np.full(ng, np.iinfo(np.int64).min, dtype=np.int64)
    np.minimum.at(first, gid, start)
    np.maximum.at(last, gid, end)
    # per (step, layer): over the rank rows
    per = groups.append_column("first", pa.array(first)).append_column("last", pa.array(last))
    g2, gid2 = _group_ids(per, ["step", "layer"])
    n2 = g2.num_rows
    base = int(first.min()) if ng else 0  # ns since the epoch do not fit a float exactly
    f, la = (first - base).astype(np.float64), (last - base).astype(np.float64)
    span = la - f
    ranks = np.bincount(gid2, minlength=n2)

    def red(v, fn, init):
        out = np.full(n2, init, dtype=np.float64)
        fn.at(out, gid2, v)
        return out

    f_min, f_max = red(f, np.minimum, np.inf), red(f, np.maximum, -np.inf)
    l_min, l_max = red(la, np.minimum, np.inf), red(la, np.maximum, -np.inf)
    s_max, s_min = red(span, np.maximum, -np.inf), red(span, np.minimum, np.inf)
    rank_arr = _num(per["rank"])
    late = np.full(n2, -1, dtype=np.int64)
    for i in np.argsort(f, kind="stable"):  # the last writer per group is the latest start
        late[gid2[i]] = rank_arr[i]
    kinds = _plain(per.select(["layer_kind"]))["layer_kind"].to_pylist()
    kind2: list[str | None] = [None] * n2
    for i, g in enumerate(gid2.tolist()):
        kind2[g] = kind2[g] or (kinds[i] or None)
    keep = ranks > 1
    return pa.table(
        {
            "step": g2["step"].filter(pa.array(keep)),
            "layer": g2["layer"].filter(pa.array(keep)),
            "layer_kind": pa.array([k2 for k2, kp in zip(kind2, keep, strict=True) if kp],
                                   pa.string()),
            "ranks": pa.array(ranks[keep], pa.int64()),
            "late_rank": pa.array(late[keep], pa.int32()),
            "start_skew_us": pa.array((f_max - f_min)[keep] / 1e3),
            "end_skew_us": pa.array((l_max - l_min)[keep] / 1e3),
            "span_all_us": pa.array((l_max - f_min)[keep] / 1e3),
            "span_rank_max_us": pa.array(s_max[keep] / 1e3),
            "span_rank_min_us": pa.array(s_min[keep] / 1e3),
        }
    )  # fmt: skip


def skew_table(kernels: pa.Table) -> pa.Table:
    """One row per layer seen on several ranks: layer_kind, steps, and for each of
    :data:`SKEW_METRICS` the median over steps with min and max (see :func:`rank_skew`)."""
    sk = rank_skew(kernels)
    sk = sk.set_column(2, "layer_kind", pc.fill_null(sk["layer_kind"], ""))
    out = group_stats(sk, ["layer", "layer_kind"], SKEW_METRICS, "steps")
    kind = pc.if_else(
        pc.equal(out["layer_kind"], ""), pa.scalar(None, pa.string()), out["layer_kind"]
    )
    return out.set_column(1, "layer_kind", kind).sort_by([("layer", "ascending")])


__all__ += ["SKEW_METRICS", "ranks_of", "rank_kind_table", "rank_skew", "skew_table"]
