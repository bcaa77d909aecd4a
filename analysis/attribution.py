"""Attribution: which range, step, layer and op each kernel and memop belongs to (DESIGN.md s. 8).

``attribute(run)`` takes a *raw* run as the importers and the capture return it and fills, for
every kernel and memop:

- ``range_path`` where it is null: the path of the innermost range enclosing the launch. A kernel
  with launch information (``launch_thread``, ``launch_start_ns``: the runtime/driver API record)
  is placed among the ``cpu`` ranges of that thread at the launch time; one without (or one no cpu
  range encloses) among the ``gpu`` ranges of its stream (Kineto's ``gpu_user_annotation``) at its
  start. A path the source already gave (the CUPTI graph-node map) is kept. Nothing enclosing:
  ``(unattributed)``.
- ``step``: kept where set; else the number of the enclosing step range (``step`` ranges numbered
  in order, ``ProfilerStep#N`` as N, see ``naming.toml``); else the run config's ``step`` or 0.
- ``layer``, ``layer_kind``, ``block``, ``op`` from the range path through a naming scheme
  (:mod:`decodescope.analysis.naming`). A layer has one kind: the kind any of its paths reveals.

Vectorised: ranges are sorted once per (rank, timeline, thread) and every query is a
``searchsorted`` followed by a walk up the parent chain, one numpy pass per nesting level.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from decodescope.analysis import naming
from decodescope.analysis.schema import UNATTRIBUTED, Run

__all__ = ["attribute", "innermost", "RangeIndex"]


def _np(col: pa.ChunkedArray | pa.Array, fill: int = 0) -> np.ndarray:
    """int64 numpy array of a column, nulls replaced by ``fill``."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    if col.null_count:
        col = pc.fill_null(col, fill)
    return col.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)


def _strings(col: pa.ChunkedArray | pa.Array) -> list[str | None]:
    return col.to_pylist()


class _Group:
    """The ranges of one (rank, timeline, thread), sorted by (start, -end), with parent links."""

    __slots__ = ("rows", "start", "end", "parent")

    def __init__(self, rows: np.ndarray, start: np.ndarray, end: np.ndarray) -> None:
        order = np.lexsort((-end, start))
        self.rows = rows[order]
        self.start = start[order]
        self.end = end[order]
        self.parent = _parents(self.start, self.end)

    def innermost(self, t: np.ndarray) -> np.ndarray:
        """Row (in the ranges table) of the innermost range containing each t, or -1."""
        idx = np.searchsorted(self.start, t, side="right") - 1
        out = np.full(len(t), -1, dtype=np.int64)
        live = idx >= 0
        while live.any():
            i = idx[live]
            hit = self.end[i] >= t[live]
            where = np.flatnonzero(live)
            out[where[hit]] = self.rows[i[hit]]
            # not containing: climb to the parent and try again
            miss = where[~hit]
            nxt = self.parent[idx[miss]]
            idx[miss] = nxt
            live[:] = False
            live[miss[nxt >= 0]] = True
        return out


def _parents(start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Index of the enclosing range of each range (sorted by start, -end), -1 at the top.

    One stack sweep; ranges that overlap without nesting take the last open range as parent
    (the containment test in :meth:`_Group.innermost` keeps such a chain correct).
    """
    n = len(start)
    parent = np.full(n, -1, dtype=np.int64)
    stack: list[int] = []
    s_list = start.tolist()
    e_list = end.tolist()
    for i in range(n):
        s = s_list[i]
        while stack and e_list[stack[-1]] < s:
            stack.pop()
        if stack:
            parent[i] = stack[-1]
        stack.append(i)
    return parent


class RangeIndex:
    """Innermost-range lookup over a ranges table, grouped by (rank, timeline, thread)."""

    def __init__(self, ranges: pa.Table, mask: np.ndarray | None = None) -> None:
        n = ranges.num_rows
        self.groups: dict[tuple[int, str, int], _Group] = {}
        if n == 0:
            return
        rank = _np(ranges["rank"])
        thread = _np(ranges["thread"])
        timeline = [t or "cpu" for t in _strings(ranges["timeline"])]
        start = _np(ranges["start_ns"])
        end = _np(ranges["end_ns"])
        keep = np.ones(n, dtype=bool) if mask is None else mask.copy()
        keep &= end >= start
        buckets: dict[tuple[int, str, int], list[int]] = collections.defaultdict(list)
        for i in np.flatnonzero(keep).tolist():
            buckets[(int(rank[i]), timeline[i], int(thread[i]))].append(i)
        for key, rows in buckets.items():
            r = np.asarray(rows, dtype=np.int64)
            self.groups[key] = _Group(r, start[r], end[r])

    def lookup(
        self, rank: np.ndarray, timeline: str, thread: np.ndarray, t: np.ndarray, want: np.ndarray
    ) -> np.ndarray:
        """Ranges-table row of the innermost range containing t on (rank, timeline, thread)."""
        out = np.full(len(t), -1, dtype=np.int64)
        if not want.any():
            return out
        pairs = np.stack([rank[want], thread[want]], axis=1)
        where = np.flatnonzero(want)
        uniq, inv = np.unique(pairs, axis=0, return_inverse=True)
        inv = inv.reshape(-1)
        for gi, (rk, th) in enumerate(uniq.tolist()):
            g = self.groups.get((int(rk), timeline, int(th)))
            if g is None:
                continue
            sel = where[inv == gi]
            out[sel] = g.innermost(t[sel])
        return out


def innermost(
    ranges: pa.Table,
    rank: np.ndarray,
    thread: np.ndarray | None,
    launch_t: np.ndarray | None,
    stream: np.ndarray,
    gpu_t: np.ndarray,
    *,
    mask: np.ndarray | None = None,
    index: RangeIndex | None = None,
) -> np.ndarray:
    """Row of the innermost enclosing range for each event, -1 where none.

    cpu ranges on ``thread`` at ``launch_t`` where launch information is there (``thread`` and
    ``launch_t`` >= 0), else gpu ranges on ``stream`` at ``gpu_t``.
    """
    idx = index or RangeIndex(ranges, mask)
    n = len(gpu_t)
    out = np.full(n, -1, dtype=np.int64)
    if thread is not None and launch_t is not None:
        has_launch = thread >= 0
        out = idx.lookup(rank, "cpu", thread, launch_t, has_launch)
    todo = out < 0
    if todo.any():
        gpu = idx.lookup(rank, "gpu", stream, gpu_t, todo)
        out[todo] = gpu[todo]
    return out


def _null_mask(col: pa.ChunkedArray) -> np.ndarray:
    return pc.is_null(col).to_numpy(zero_copy_only=False)


def _range_paths(ranges: pa.Table) -> list[str | None]:
    paths = _strings(ranges["path"])
    names = _strings(ranges["name"])
    return [p if p else nm for p, nm in zip(paths, names, strict=True)]


def _step_numbers(ranges: pa.Table, scheme: naming.Scheme) -> tuple[np.ndarray, np.ndarray]:
    """(mask of step ranges, step number of each range row: -1 where not a step range)."""
    n = ranges.num_rows
    is_step = np.zeros(n, dtype=bool)
    number = np.full(n, -1, dtype=np.int64)
    if n == 0:
        return is_step, number
    names = ranges["name"]
    # classify each distinct name once
    d = names.combine_chunks() if isinstance(names, pa.ChunkedArray) else names
    if not pa.types.is_dictionary(d.type):
        d = pc.dictionary_encode(d)
    idx = _np(d.indices, -1)
    verdicts = [
        scheme.step_number(s) if s is not None else (False, None) for s in d.dictionary.to_pylist()
    ]
    if not verdicts:
        return is_step, number
    flag = np.array([v[0] for v in verdicts] + [False], dtype=bool)
    num = np.array([(-1 if v[1] is None else v[1]) for v in verdicts] + [-1], dtype=np.int64)
    is_step = flag[idx]
    number = num[idx]
    # unnumbered step ranges ("step"): numbered in order of start per (rank, timeline)
    unnumbered = is_step & (number < 0)
    if unnumbered.any():
        rank = _np(ranges["rank"])
        start = _np(ranges["start_ns"])
        timeline = np.array([t or "cpu" for t in _strings(ranges["timeline"])])
        rows = np.flatnonzero(unnumbered)
        for key in {(int(rank[r]), timeline[r]) for r in rows.tolist()}:
            sel = rows[(rank[rows] == key[0]) & (timeline[rows] == key[1])]
            sel = sel[np.argsort(start[sel], kind="stable")]
            number[sel] = np.arange(len(sel))
    return is_step, number


def _event_arrays(t: pa.Table, with_launch: bool) -> dict[str, np.ndarray | None]:
    out: dict[str, np.ndarray | None] = {
        "rank": _np(t["rank"]),
        "stream": _np(t["stream"], -1),
        "start": _np(t["start_ns"]),
    }
    if with_launch:
        missing = _null_mask(t["launch_thread"]) | _null_mask(t["launch_start_ns"])
        out["thread"] = np.where(missing, -1, _np(t["launch_thread"], -1))
        out["launch_t"] = _np(t["launch_start_ns"], 0)
    else:
        out["thread"] = None
        out["launch_t"] = None
    return out


def _fill_paths(t: pa.Table, found: np.ndarray, range_paths: list[str | None]) -> pa.Array:
    """range_path: kept where set, the found range's path, else UNATTRIBUTED (dictionary)."""
    existing = t["range_path"].combine_chunks()
    if pa.types.is_dictionary(existing.type):
        existing = existing.cast(existing.type.value_type)
    keep = ~_null_mask(t["range_path"])
    # dictionary: every range path, then UNATTRIBUTED, then the existing values
    rp = pa.array(range_paths, type=pa.string())
    codes = np.where(found >= 0, found, len(range_paths)).astype(np.int64)
    ex_enc = pc.dictionary_encode(existing)
    ex_idx = _np(ex_enc.indices, 0) + len(range_paths) + 1
    codes = np.where(keep, ex_idx, codes)
    values = pa.concat_arrays([rp, pa.array([UNATTRIBUTED]), ex_enc.dictionary])
    arr = pa.DictionaryArray.from_arrays(pa.array(codes.astype(np.int32)), values)
    # compact the dictionary to what is used, and map null range names to UNATTRIBUTED
    plain = pc.fill_null(arr.cast(pa.string()), UNATTRIBUTED)
    return pc.dictionary_encode(plain)


def _fill_steps(
    t: pa.Table, found_step: np.ndarray, step_number: np.ndarray, default: int
) -> pa.Array:
    existing = t["step"].combine_chunks()
    keep = ~pc.is_null(existing).to_numpy(zero_copy_only=False)
    ex = _np(existing, 0)
    if len(step_number) == 0:
        from_range = np.full(len(found_step), default, dtype=np.int64)
    else:
        from_range = np.where(found_step >= 0, step_number[np.maximum(found_step, 0)], default)
    return pa.array(np.where(keep, ex, from_range).astype(np.int32))


def _name_columns(
    paths: pa.Array, scheme: naming.Scheme
) -> tuple[dict[str, pa.Array], dict[int, collections.Counter[str]]]:
    """layer / layer_kind / block / op columns for a dictionary array of paths."""
    dictionary = paths.dictionary.to_pylist()
    named = [scheme.name_path(p) if p != UNATTRIBUTED else naming.Naming() for p in dictionary]
    idx = _np(paths.indices, 0)
    kinds: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    counts = np.bincount(idx, minlength=len(dictionary)) if len(idx) else np.zeros(len(dictionary))
    for nm, c in zip(named, counts.tolist(), strict=True):
        if nm.layer is not None and nm.layer_kind and c:
            kinds[nm.layer][nm.layer_kind] += c

    def col(values: list[Any], typ: pa.DataType) -> pa.Array:
        return pa.array(values, type=typ).take(pa.array(idx))

    cols = {
        "layer": col([n.layer for n in named], pa.int32()),
        "block": col([n.block for n in named], pa.string()),
        "op": col([n.op for n in named], pa.string()),
    }
    return cols, kinds


def _layer_kinds(layer: pa.Array, kinds: dict[int, str], default: str | None) -> pa.Array:
    values = layer.to_numpy(zero_copy_only=False)
    valid = ~pc.is_null(layer).to_numpy(zero_copy_only=False)
    out: list[str | None] = [None] * len(layer)
    lyr = np.where(valid, np.nan_to_num(values.astype(float), nan=-1), -1).astype(np.int64)
    table = {k: v for k, v in kinds.items()}
    uniq = np.unique(lyr[valid]) if valid.any() else np.array([], dtype=np.int64)
    mapping = {int(u): table.get(int(u), default) for u in uniq.tolist()}
    # build through a small dictionary: one Python step per distinct layer, not per kernel
    keys = sorted(mapping)
    if not keys:
        return pa.array(out, type=pa.string())
    pos = np.searchsorted(np.asarray(keys), lyr)
    pos = np.clip(pos, 0, len(keys) - 1)
    names = [mapping[k] for k in keys] + [None]
    codes = np.where(valid, pos, len(keys)).astype(np.int32)
    return pa.DictionaryArray.from_arrays(pa.array(codes), pa.array(names, type=pa.string())).cast(
        pa.string()
    )


def _attribute_table(
    t: pa.Table,
    ranges: pa.Table,
    index: RangeIndex,
    step_index: RangeIndex,
    range_paths: list[str | None],
    step_number: np.ndarray,
    scheme: naming.Scheme,
    default_step: int,
    with_launch: bool,
) -> tuple[pa.Table, dict[int, collections.Counter[str]]]:
    if t.num_rows == 0:
        return t, {}
    ev = _event_arrays(t, with_launch)
    found = innermost(
        ranges, ev["rank"], ev["thread"], ev["launch_t"], ev["stream"], ev["start"], index=index
    )
    found_step = innermost(
        ranges,
        ev["rank"],
        ev["thread"],
        ev["launch_t"],
        ev["stream"],
        ev["start"],
        index=step_index,
    )
    paths = _fill_paths(t, found, range_paths)
    steps = _fill_steps(t, found_step, step_number, default_step)
    cols, kinds = _name_columns(paths, scheme)
    t = t.set_column(t.schema.get_field_index("range_path"), "range_path", paths)
    t = t.set_column(t.schema.get_field_index("step"), "step", steps)
    for name, arr in cols.items():
        if name in t.column_names:
            t = t.set_column(t.schema.get_field_index(name), name, arr)
    return t, kinds


def attribute(run: Run, scheme: naming.Scheme | str | dict[str, Any] | None = None) -> Run:
    """Fill range_path, step, layer, layer_kind, block and op of every kernel and memop."""
    sch = naming.resolve(scheme)
    ranges = run.ranges
    index = RangeIndex(ranges)
    is_step, step_number = _step_numbers(ranges, sch)
    step_index = RangeIndex(ranges, is_step)
    range_paths = _range_paths(ranges)
    try:
        default_step = int(run.meta.config.get("step", 0))
    except (TypeError, ValueError):
        default_step = 0
    kernels, k_kinds = _attribute_table(
        run.kernels, ranges, index, step_index, range_paths, step_number, sch, default_step, True
    )
    memops, m_kinds = _attribute_table(
        run.memops, ranges, index, step_index, range_paths, step_number, sch, default_step, False
    )
    # one kind per layer: the kind its paths reveal most often
    votes: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for src in (k_kinds, m_kinds):
        for lyr, c in src.items():
            votes[lyr].update(c)
    kinds = {lyr: c.most_common(1)[0][0] for lyr, c in votes.items()}
    if kernels.num_rows:
        kind_col = _layer_kinds(kernels["layer"].combine_chunks(), kinds, sch.default_kind)
        kernels = kernels.set_column(
            kernels.schema.get_field_index("layer_kind"), "layer_kind", kind_col
        )
    return run.replace(kernels=kernels, memops=memops)
