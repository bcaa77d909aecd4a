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


def _plain_strings(col: pa.ChunkedArray | pa.Array) -> pa.Array:
    """A string column as one plain (non-dictionary) string array."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    if pa.types.is_dictionary(col.type):
        col = col.cast(col.type.value_type)
    return col


def _is_gpu(ranges: pa.Table) -> np.ndarray:
    """True for ranges on the gpu timeline (null counts as cpu)."""
    tl = _plain_strings(ranges["timeline"])
    return pc.fill_null(pc.equal(tl, "gpu"), False).to_numpy(zero_copy_only=False)


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
        while stack and e_list[stack[-1]] <= s:
            stack.pop()
        if stack:
            parent[i] = stack[-1]
        stack.append(i)
    return parent


def _groups(*keys: np.ndarray) -> list[np.ndarray]:
    """Positions of the rows of each distinct key tuple (one lexsort, no Python loop per row)."""
    n = len(keys[0])
    if n == 0:
        return []
    order = np.lexsort(keys[::-1])
    change = np.zeros(n, dtype=bool)
    change[0] = True
    for k in keys:
        ks = k[order]
        change[1:] |= ks[1:] != ks[:-1]
    bounds = np.append(np.flatnonzero(change), n)
    return [order[bounds[i] : bounds[i + 1]] for i in range(len(bounds) - 1)]


class RangeIndex:
    """Innermost-range lookup over a ranges table, grouped by (rank, timeline, thread)."""

    def __init__(self, ranges: pa.Table, mask: np.ndarray | None = None) -> None:
        n = ranges.num_rows
        self.groups: dict[tuple[int, str, int], _Group] = {}
        if n == 0:
            return
        rank = _np(ranges["rank"])
        thread = _np(ranges["thread"])
        gpu = _is_gpu(ranges)
        start = _np(ranges["start_ns"])
        end = _np(ranges["end_ns"])
        keep = np.ones(n, dtype=bool) if mask is None else mask.copy()
        keep &= end >= start
        rows = np.flatnonzero(keep)
        if not len(rows):
            return
        for sel in _groups(rank[rows], gpu[rows].astype(np.int64), thread[rows]):
            r = rows[sel]
            key = (int(rank[r[0]]), "gpu" if gpu[r[0]] else "cpu", int(thread[r[0]]))
            self.groups[key] = _Group(r, start[r], end[r])

    def lookup(
        self, rank: np.ndarray, timeline: str, thread: np.ndarray, t: np.ndarray, want: np.ndarray
    ) -> np.ndarray:
        """Ranges-table row of the innermost range containing t on (rank, timeline, thread)."""
        out = np.full(len(t), -1, dtype=np.int64)
        if not want.any():
            return out
        where = np.flatnonzero(want)
        for part in _groups(rank[where], thread[where]):
            sel = where[part]
            g = self.groups.get((int(rank[sel[0]]), timeline, int(thread[sel[0]])))
            if g is not None:
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


def _range_paths(ranges: pa.Table) -> pa.Array:
    """Each range's path (its name where the path is missing), as a plain string array."""
    if ranges.num_rows == 0:
        return pa.array([], pa.string())
    return pc.coalesce(_plain_strings(ranges["path"]), _plain_strings(ranges["name"]))


def _step_numbers(ranges: pa.Table, scheme: naming.Scheme) -> tuple[np.ndarray, np.ndarray]:
    """(mask of step ranges, step number of each range row: -1 where not a step range)."""
    n = ranges.num_rows
    is_step = np.zeros(n, dtype=bool)
    number = np.full(n, -1, dtype=np.int64)
    if n == 0:
        return is_step, number
    names = ranges["name"]
    # classify each distinct name once; a vectorised regex pass picks the candidates
    d = names.combine_chunks() if isinstance(names, pa.ChunkedArray) else names
    if not pa.types.is_dictionary(d.type):
        d = pc.dictionary_encode(d)
    idx = _np(d.indices, -1)
    dictionary = d.dictionary
    if len(dictionary) == 0:
        return is_step, number
    patterns = [r.pattern.pattern for r in (*scheme.unwrap, *scheme.step)]
    candidates = _regex_prefilter(dictionary, patterns)
    if candidates is None:
        candidates = np.arange(len(dictionary))
    flag = np.zeros(len(dictionary) + 1, dtype=bool)
    num = np.full(len(dictionary) + 1, -1, dtype=np.int64)
    for i in candidates.tolist():
        v = dictionary[i].as_py()
        if v is not None:
            ok, k = scheme.step_number(v)
            flag[i] = ok
            num[i] = -1 if k is None else k
    is_step = flag[idx]
    number = num[idx]
    # unnumbered step ranges ("step"): numbered in order of start per (rank, timeline)
    unnumbered = is_step & (number < 0)
    if unnumbered.any():
        rank = _np(ranges["rank"])
        start = _np(ranges["start_ns"])
        gpu = _is_gpu(ranges)
        rows = np.flatnonzero(unnumbered)
        for key in {(int(rank[r]), bool(gpu[r])) for r in rows.tolist()}:
            sel = rows[(rank[rows] == key[0]) & (gpu[rows] == key[1])]
            sel = sel[np.argsort(start[sel], kind="stable")]
            number[sel] = np.arange(len(sel))
    return is_step, number


def _regex_prefilter(values: pa.Array, patterns: list[str]) -> np.ndarray | None:
    """Indices of the strings any pattern may match (Arrow's RE2, vectorised), or None where a
    pattern is beyond RE2 (then every string goes through Python's re)."""
    hit = np.zeros(len(values), dtype=bool)
    for pat in patterns:
        try:
            m = pc.match_substring_regex(values, pat)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            return None
        hit |= pc.fill_null(m, False).to_numpy(zero_copy_only=False)
    return np.flatnonzero(hit)


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


def _fill_paths(t: pa.Table, found: np.ndarray, range_paths: pa.Array) -> pa.Array:
    """range_path: kept where set, the found range's path, else UNATTRIBUTED (dictionary)."""
    existing = _plain_strings(t["range_path"])
    if len(range_paths):
        from_range = range_paths.take(pa.array(np.where(found >= 0, found, 0)))
        from_range = pc.if_else(pa.array(found >= 0), from_range, pa.scalar(None, pa.string()))
    else:
        from_range = pa.nulls(len(found), pa.string())
    plain = pc.coalesce(existing, from_range, pa.scalar(UNATTRIBUTED))
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
    range_paths: pa.Array,
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
