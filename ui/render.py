"""Rich tables and JSON from Arrow tables: the one place that decides how a figure is printed."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import json
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import pyarrow as pa
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderResult
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Column, Table
from rich.text import Text

__all__ = ["arrow_table", "to_jsonable", "dumps", "progress", "fmt", "Fitted", "fit_tables"]

LIST_ITEMS = 4  # list cells show this many items, then "+N more"
TEXT_FLOOR = 12  # a text column (names, ops) keeps this many characters while numbers need room


def fmt(value: Any, column: str = "") -> str:
    """One cell: integers plain, microseconds to 1 decimal, ratios as "1.88x", shares as %."""
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if column == "waves":  # a third, partial wave reads 2.91; a whole one 1.00
            return f"{value:.2f}"
        if column in ("ratio", "efficiency", "share_efficiency"):
            return f"{value:.2f}x"
        if column in ("share",) or column.endswith("_pct"):
            return f"{value * 100:.1f}%" if column == "share" else f"{value:+.1f}%"
        if column.endswith("_delta"):
            return f"{value:+.1f}" if not value.is_integer() else f"{value:+.0f}"
        if value.is_integer() and abs(value) < 1e15 and not _is_time(column):
            return f"{value:.0f}"
        return f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"
    if isinstance(value, list):
        shown = [fmt(v) for v in value[:LIST_ITEMS]]
        if len(value) > LIST_ITEMS:
            shown.append(f"+{len(value) - LIST_ITEMS} more")
        return ", ".join(shown)
    if isinstance(value, dict):
        return ", ".join(f"{k}={fmt(v)}" for k, v in value.items())
    if isinstance(value, datetime.datetime):
        return value.isoformat(timespec="seconds")
    return str(value)


def _is_time(column: str) -> bool:
    """A column of microseconds (``span_us``, ``a_span_us``, ``span_us_min``): always decimals,
    so that a whole number (a Kineto trace's integer microseconds) reads like its neighbours."""
    return column.endswith("_us") or "_us_" in column


def header(column: str) -> str:
    """A readable column header: a_span_us -> "A span us", kernels_delta -> "Δ kernels"."""
    c = column
    prefix = ""
    if c.startswith(("a_", "b_")):
        prefix, c = c[0].upper() + " ", c[2:]
    if c.endswith("_delta"):
        prefix, c = "Δ ", c[: -len("_delta")]
    c = c.replace("layer_kind", "kind").replace("kernel_sum", "kernel-sum").replace("_us", " us")
    return prefix + c.replace("_", " ")


def arrow_table(
    t: pa.Table,
    title: str | None = None,
    columns: Sequence[str] | None = None,
    headers: dict[str, str] | None = None,
    limit: int | None = None,
    max_width: dict[str, int] | None = None,
    no_wrap: Sequence[str] = (),
    keys: int | None = None,
) -> Fitted:
    """A rich Table of (some columns of) an Arrow table; numbers right-aligned; laid out for the
    console's width (:class:`Fitted`: ``keys`` leading columns repeat where it splits; columns in
    ``no_wrap`` never fold, such as a text bar)."""
    cols = [c for c in (columns or t.column_names) if c in t.column_names]
    rt = Table(title=title, title_justify="left", header_style="bold", show_lines=False)
    for c in cols:
        typ = t.schema.field(c).type
        numeric = pa.types.is_integer(typ) or pa.types.is_floating(typ)
        rt.add_column(
            (headers or {}).get(c, header(c)),
            justify="right" if numeric else "left",
            overflow="fold",
            max_width=(max_width or {}).get(c),
            no_wrap=c in no_wrap,
        )
    rows = t.select(cols).to_pylist()
    shown = rows if limit is None else rows[:limit]
    for r in shown:
        rt.add_row(*[Text(fmt(r[c], c)) for c in cols])
    if limit is not None and len(rows) > limit:
        rt.caption = f"{len(rows) - limit} more rows not shown"
    return Fitted(rt, keys)


class Fitted:
    """A rich Table laid out for the console's width without cutting a number.

    rich shrinks the widest columns of a table that is too wide, folding a number over two lines
    ("78." above "8") or cutting it to "1,07…". Here, where the table is wider than the console:
    text columns (names, ops) give room first (down to ``TEXT_FLOOR`` characters) and headers wrap
    between words, every number keeps its width; where even that does not fit, headers fold too;
    where that does not fit either, the columns split over several tables, each repeating the
    ``keys`` leading columns (default: the leading text columns) and keeping a metric's A, B and
    delta columns together. A table that fits is printed as it is."""

    def __init__(self, table: Table, keys: int | None = None) -> None:
        self.table = table
        self.keys = keys

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield from fit_tables(self.table, options.max_width, console, self.keys)


def _plain(console: Console, renderable: Any) -> str | None:
    if isinstance(renderable, str):
        return console.render_str(renderable).plain
    if isinstance(renderable, Text):
        return renderable.plain
    return None


def _natural(console: Console, col: Column) -> tuple[int, int, int]:
    """(content width, widest cell, longest header word) of a column, in cells."""
    cells = []
    for c in col._cells:
        text = _plain(console, c)
        if text is None:
            cells.append(console.measure(c).maximum)
        else:
            cells.append(max((cell_len(line) for line in text.split("\n")), default=0))
    head = _plain(console, col.header) or ""
    widest = max(cells, default=0)
    natural = max([widest, *(cell_len(line) for line in head.split("\n"))])
    if col.max_width is not None:
        natural = min(natural, col.max_width)
    word = max((cell_len(w) for w in head.split()), default=0)
    return natural, widest, word


def _floor(nat: tuple[int, int, int], col: Column, fold_headers: bool) -> int:
    natural, widest, word = nat
    if col.no_wrap:
        return natural
    if col.justify == "right":  # a number: never folded
        return min(natural, widest if fold_headers else max(widest, word))
    return min(natural, TEXT_FLOOR if fold_headers else max(TEXT_FLOOR, word))


def _overhead(table: Table, n: int) -> int:
    """Borders and padding of a table of ``n`` columns."""
    _, right, _, left = table.padding
    edge = 2 if table.box and table.show_edge else 0
    return edge + (max(n - 1, 0) if table.box else 0) + n * (left + right)


def _shrink(widths: list[int], floors: list[int], room: int, first: Sequence[bool]) -> list[int]:
    """Narrow the widest column above its floor, one cell at a time, until they fit ``room``:
    the ``first`` ones (numbers: their headers wrap between words) before the others (text,
    which folds over more lines)."""
    w = list(widths)
    for allowed in (first, [True] * len(w)):
        while sum(w) > room:
            free = [i for i in range(len(w)) if allowed[i] and w[i] > floors[i]]
            if not free:
                break
            i = max(free, key=lambda j: w[j])
            w[i] -= 1
    return w


def _subset(
    table: Table, idx: Sequence[int], widths: Sequence[int] | None, title: Any, caption: Any
) -> Table:
    t = copy.copy(table)
    t.columns = []
    for n, i in enumerate(idx):
        col = table.columns[i]
        change: dict[str, Any] = {"_index": n}
        if widths is not None:  # laid out here: fixed widths; text folds rather than "…"
            change.update(width=widths[n], overflow="fold" if not col.no_wrap else col.overflow)
        t.columns.append(dataclasses.replace(col, **change))
    t.title, t.caption = title, caption
    return t


def _units(console: Console, table: Table, idx: Iterable[int]) -> list[list[int]]:
    """Consecutive columns of one metric ("A span us", "B span us", "Δ span us") stay together."""
    out: list[list[int]] = []
    last = None
    for i in idx:
        head = (_plain(console, table.columns[i].header) or "").strip()
        base = head[2:] if head[:2] in ("A ", "B ", "Δ ") else None
        if base is not None and base == last and out:
            out[-1].append(i)
        else:
            out.append([i])
        last = base
    return out


def _layout(table: Table, idx: list[int], nats: list, room: int) -> list[int] | None:
    """Widths for the columns ``idx`` within ``room`` (borders included), or None: they fit as
    they are. Raises LookupError where they cannot fit."""
    natural = [nats[i][0] for i in idx]
    space = room - _overhead(table, len(idx))
    if sum(natural) <= space:
        return None
    for fold_headers in (False, True):
        floors = [_floor(nats[i], table.columns[i], fold_headers) for i in idx]
        if sum(floors) <= space:
            numbers = [table.columns[i].justify == "right" for i in idx]
            return _shrink(natural, floors, space, numbers)
    raise LookupError


def min_width(table: Table, console: Console) -> int:
    """The narrowest the table prints without folding a number or a header word."""
    nats = [_natural(console, c) for c in table.columns]
    floors = [_floor(n, c, False) for n, c in zip(nats, table.columns, strict=True)]
    return sum(floors) + _overhead(table, len(floors))


def fit_tables(table: Table, width: int, console: Console, keys: int | None = None) -> list[Table]:
    """``table`` laid out for ``width`` cells: itself where it fits, else narrowed or split
    (see :class:`Fitted`)."""
    cols = table.columns
    if not cols:
        return [table]
    nats = [_natural(console, c) for c in cols]
    every = list(range(len(cols)))
    try:
        widths = _layout(table, every, nats, width)
        return [table if widths is None else _subset(table, every, widths, table.title,
                                                    table.caption)]  # fmt: skip
    except LookupError:
        pass
    if keys is None:
        keys = next((i for i, c in enumerate(cols) if c.justify == "right"), len(cols))
    keys = min(keys, len(cols) - 1)
    key_idx = every[:keys]
    groups: list[list[int]] = []
    for unit in _units(console, table, every[keys:]):
        trial = [*key_idx, *(groups[-1][keys:] if groups else []), *unit]
        floors = [_floor(nats[i], cols[i], False) for i in trial]
        if groups and sum(floors) + _overhead(table, len(trial)) <= width:
            groups[-1] = trial
        else:
            groups.append([*key_idx, *unit])
    out = []
    for n, idx in enumerate(groups):
        title = table.title if n == 0 else (f"{table.title} (continued)" if table.title else None)
        caption = table.caption if n == len(groups) - 1 else None
        try:
            widths = _layout(table, idx, nats, width)
        except LookupError:  # one metric alone does not fit: rich folds it
            widths = None
        out.append(_subset(table, idx, widths, title, caption))
    return out


def to_jsonable(obj: Any) -> Any:
    """Arrow tables become lists of row dicts; NaN becomes null; datetimes ISO strings."""
    if isinstance(obj, pa.Table):
        return [to_jsonable(r) for r in obj.to_pylist()]
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, float) and (math.isnan(obj) or math.isinf(obj)):
        return None
    if isinstance(obj, datetime.datetime | datetime.date):
        return obj.isoformat()
    if isinstance(obj, bytes):
        return obj.decode("utf-8", "replace")
    return obj


def dumps(obj: Any) -> str:
    return json.dumps(to_jsonable(obj), indent=2, default=str)


@contextlib.contextmanager
def progress(console: Console, description: str) -> Iterator[Progress | None]:
    """A transient spinner with elapsed time for one long step (to stderr's console)."""
    if not console.is_terminal:  # nothing to animate in a pipe or a log
        yield None
        return
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as p:
        p.add_task(description, total=None)
        yield p
