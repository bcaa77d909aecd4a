"""Rich tables and JSON from Arrow tables: the one place that decides how a figure is printed."""

from __future__ import annotations

import contextlib
import datetime
import json
import math
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

__all__ = ["arrow_table", "to_jsonable", "dumps", "progress", "fmt"]

LIST_ITEMS = 4  # list cells show this many items, then "+N more"


def fmt(value: Any, column: str = "") -> str:
    """One cell: integers plain, microseconds to 1 decimal, ratios as "1.88x", shares as %."""
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if column in ("ratio", "efficiency", "share_efficiency"):
            return f"{value:.2f}x"
        if column in ("share",) or column.endswith("_pct"):
            return f"{value * 100:.1f}%" if column == "share" else f"{value:+.1f}%"
        if column.endswith("_delta"):
            return f"{value:+.1f}" if not value.is_integer() else f"{value:+.0f}"
        if value.is_integer() and abs(value) < 1e15:
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
) -> Table:
    """A rich Table of (some columns of) an Arrow table; numbers right-aligned."""
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
        )
    rows = t.select(cols).to_pylist()
    shown = rows if limit is None else rows[:limit]
    for r in shown:
        rt.add_row(*[Text(fmt(r[c], c)) for c in cols])
    if limit is not None and len(rows) > limit:
        rt.caption = f"{len(rows) - limit} more rows not shown"
    return rt


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
