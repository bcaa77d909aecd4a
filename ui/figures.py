"""Plotly figures for the dashboard: pure functions, tables in, figures (or strings) out.

Every function here takes tables the analysis already computed (``decodescope.analysis.metrics``
and ``compare``, docs/internal-api.md) or rows of the ``kernels`` table, selects and lays them out,
and returns a :class:`plotly.graph_objects.Figure`. Nothing here reads files, touches Streamlit
or computes a metric of its own; the dashboard (``ui/dashboard.py``) wires them to the page.
Tables may be Arrow tables or pandas frames.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import pandas as pd
import plotly.graph_objects as go
import pyarrow as pa
from plotly.subplots import make_subplots

from decodescope.analysis import timeline as tl

# the per-layer metrics of DESIGN.md section 7, as the analysis names them, with their labels
METRICS: dict[str, str] = {
    "kernels": "kernels",
    "span_us": "span (us)",
    "busy_us": "busy (us)",
    "gaps_us": "gaps (us)",
    "kernel_sum_us": "kernel-sum (us)",
    "share_us": "share of the step (us)",
}
SIDE_COLORS = ("#1f77b4", "#ff7f0e")  # A, B
REGRESSION_COLOR = "#d62728"
# one colour per op; enough distinct hues for the ~25 ops of a decoder layer
OP_PALETTE = [
    "#4e79a7",
    "#f28e2b",
    "#e15759",
    "#76b7b2",
    "#59a14f",
    "#edc948",
    "#b07aa1",
    "#ff9da7",
    "#9c755f",
    "#bab0ac",
    "#1f77b4",
    "#aec7e8",
    "#ffbb78",
    "#98df8a",
    "#ff9896",
    "#c5b0d5",
    "#c49c94",
    "#f7b6d2",
    "#dbdb8d",
    "#9edae5",
    "#17becf",
    "#bcbd22",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
]
FUSED_SEP = "+"


def frame(table: pa.Table | pd.DataFrame | None) -> pd.DataFrame:
    """A pandas frame of ``table`` (dictionary columns decoded); an empty frame for ``None``."""
    if table is None:
        return pd.DataFrame()
    if isinstance(table, pd.DataFrame):
        return table
    cols = {}
    for name in table.column_names:
        col = table.column(name)
        if pa.types.is_dictionary(col.type):
            col = col.cast(col.type.value_type)
        cols[name] = col
    return pa.table(cols).to_pandas() if cols else pd.DataFrame()


def _empty(message: str, height: int = 240) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_layout(height=height, xaxis_visible=False, yaxis_visible=False)
    return fig


def _fmt(v: Any, digits: int = 0) -> str:
    if v is None or (isinstance(v, float) and v != v):
        return "-"
    if digits == 0:
        return f"{round(float(v)):,}"
    return f"{float(v):,.{digits}f}"


def kind_title(kind: Any) -> str:
    """ "KDA layer", "MLA layer", "dense layer"; "Layer" for the default kind of other models."""
    if kind is None or kind == "" or kind == "layer":
        return "Layer"
    k = str(kind)
    return f"{k.upper() if k in ('kda', 'mla') else k} layer"


# ---- headline -------------------------------------------------------------------------------


def headline(
    kinds_a: pa.Table | pd.DataFrame,
    kinds_b: pa.Table | pd.DataFrame | None = None,
    labels: Sequence[str] = ("A", "B"),
) -> list[str]:
    """One line per layer kind from two ``metrics.kind_table`` results.

    ``"KDA layer: 23 kernels / 130 us vs 13 / 69 us (1.88x)"``; with one side only,
    ``"KDA layer: 23 kernels / 130 us"``. Medians over the layers of each kind.
    """
    a = frame(kinds_a)
    b = frame(kinds_b) if kinds_b is not None else pd.DataFrame()
    if a.empty and b.empty:
        return []
    kinds = list(dict.fromkeys([*a.get("layer_kind", []), *b.get("layer_kind", [])]))
    lines = []
    for kind in kinds:
        ra = a[a["layer_kind"] == kind] if not a.empty else a
        rb = b[b["layer_kind"] == kind] if not b.empty else b
        name = kind_title(kind)
        if kinds_b is None:
            r = ra.iloc[0]
            lines.append(f"{name}: {_fmt(r['kernels'])} kernels / {_fmt(r['span_us'])} us")
            continue
        side_a = (
            f"{_fmt(ra.iloc[0]['kernels'])} kernels / {_fmt(ra.iloc[0]['span_us'])} us"
            if not ra.empty
            else f"none in {labels[0]}"
        )
        side_b = (
            f"{_fmt(rb.iloc[0]['kernels'])} / {_fmt(rb.iloc[0]['span_us'])} us"
            if not rb.empty
            else f"none in {labels[1]}"
        )
        line = f"{name}: {side_a} vs {side_b}"
        if not ra.empty and not rb.empty:
            sa, sb = float(ra.iloc[0]["span_us"] or 0), float(rb.iloc[0]["span_us"] or 0)
            if sa > 0 and sb > 0:
                line += f" ({sa / sb:.2f}x)"
        lines.append(line)
    return lines


# ---- per-layer bars ---------------------------------------------------------------------------


def _layer_axis(df: pd.DataFrame) -> tuple[list[str], list[str]]:
    kinds = [str(k) if k is not None else "?" for k in df["layer_kind"]]
    layers = [str(int(x)) if x == x and x is not None else "?" for x in df["layer"]]
    return kinds, layers


def layer_bars(
    layers_a: pa.Table | pd.DataFrame,
    layers_b: pa.Table | pd.DataFrame | None = None,
    labels: Sequence[str] = ("A", "B"),
    metrics: Sequence[str] = ("kernels", "span_us"),
) -> go.Figure:
    """Per-layer bars, A beside B, one row per metric, layers grouped by kind on the x axis.

    Inputs are ``metrics.layer_table`` results of one rank (one row per layer: median over
    steps, with ``{metric}_min`` / ``{metric}_max`` drawn as error bars where present).
    """
    sides = [(labels[0], frame(layers_a), SIDE_COLORS[0])]
    if layers_b is not None:
        sides.append((labels[1], frame(layers_b), SIDE_COLORS[1]))
    sides = [(lab, df, c) for lab, df, c in sides if not df.empty]
    if not sides:
        return _empty("no layers: no kernel of these runs is attributed to a layer")
    fig = make_subplots(
        rows=len(metrics),
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.08,
        subplot_titles=[METRICS.get(m, m) for m in metrics],
    )
    for row, metric in enumerate(metrics, start=1):
        for label, df, color in sides:
            df = df.sort_values(["layer_kind", "layer"], na_position="last")
            kinds, layers = _layer_axis(df)
            err = None
            if f"{metric}_min" in df and f"{metric}_max" in df:
                err = dict(
                    type="data",
                    symmetric=False,
                    array=(df[f"{metric}_max"] - df[metric]).clip(lower=0).tolist(),
                    arrayminus=(df[metric] - df[f"{metric}_min"]).clip(lower=0).tolist(),
                    thickness=1,
                    width=2,
                )
            fig.add_trace(
                go.Bar(
                    name=label,
                    x=[kinds, layers],
                    y=df[metric].tolist(),
                    marker_color=color,
                    error_y=err,
                    legendgroup=label,
                    showlegend=row == 1,
                    hovertemplate=(
                        f"{label}<br>layer %{{x}}<br>{METRICS.get(metric, metric)}: "
                        "%{y:,.1f}<extra></extra>"
                    ),
                ),
                row=row,
                col=1,
            )
    for row, metric in enumerate(metrics, start=1):
        fig.update_yaxes(title_text=METRICS.get(metric, metric), row=row, col=1)
    fig.update_xaxes(title_text="layer (kind, index)", row=len(metrics), col=1)
    fig.update_layout(
        barmode="group",
        height=260 * len(metrics) + 80,
        margin=dict(t=40, b=60, l=70, r=20),
        legend=dict(orientation="h", y=1.06, x=0),
    )
    return fig


def rank_spans(
    layers: pa.Table | pd.DataFrame,
    skew: pa.Table | pd.DataFrame | None = None,
    label: str = "A",
) -> go.Figure:
    """A run of several ranks: per layer, one bar per rank (span, median over steps, min/max as
    error bars) and, in a second row, the skew between the ranks (start and end skew, medians).

    Inputs: ``metrics.layer_table`` over all ranks and ``metrics.skew_table``."""
    df = frame(layers)
    if df.empty:
        return _empty("no layers: no kernel of this run is attributed to a layer")
    sk = frame(skew) if skew is not None else pd.DataFrame()
    rows = 2 if not sk.empty else 1
    fig = make_subplots(
        rows=rows, cols=1, shared_xaxes=True, vertical_spacing=0.1,
        subplot_titles=[f"{label}: layer span per rank (us)", "skew between ranks (us)"][:rows],
    )  # fmt: skip
    ranks = sorted({int(r) for r in df["rank"].fillna(0)})
    for i, r in enumerate(ranks):
        d = df[df["rank"].fillna(0) == r].sort_values(["layer_kind", "layer"], na_position="last")
        kinds, lay = _layer_axis(d)
        fig.add_trace(
            go.Bar(
                name=f"rank {r}", x=[kinds, lay], y=d["span_us"].tolist(),
                marker_color=OP_PALETTE[i % len(OP_PALETTE)],
                error_y=dict(
                    type="data", symmetric=False,
                    array=(d["span_us_max"] - d["span_us"]).clip(lower=0).tolist(),
                    arrayminus=(d["span_us"] - d["span_us_min"]).clip(lower=0).tolist(),
                    thickness=1, width=2,
                ),
                hovertemplate=f"rank {r}<br>layer %{{x}}<br>span %{{y:,.1f}} us<extra></extra>",
            ),
            row=1, col=1,
        )  # fmt: skip
    if not sk.empty:
        sk = sk.sort_values(["layer_kind", "layer"], na_position="last")
        kinds, lay = _layer_axis(sk)
        for m, name, color in (
            ("start_skew_us", "start skew", REGRESSION_COLOR),
            ("end_skew_us", "end skew", "#7f7f7f"),
        ):
            fig.add_trace(
                go.Scatter(
                    name=name, x=[kinds, lay], y=sk[m].tolist(), mode="markers+lines",
                    marker_color=color,
                    hovertemplate=f"{name}<br>layer %{{x}}<br>%{{y:,.2f}} us<extra></extra>",
                ),
                row=2, col=1,
            )  # fmt: skip
    fig.update_yaxes(title_text="span (us)", row=1, col=1)
    if rows == 2:
        fig.update_yaxes(title_text="skew (us)", row=2, col=1)
    fig.update_xaxes(title_text="layer (kind, index)", row=rows, col=1)
    fig.update_layout(
        barmode="group",
        height=300 * rows + 60,
        margin=dict(t=40, b=40, l=60, r=20),
        legend=dict(orientation="h", y=1.06, x=0),
    )
    return fig


# ---- stacked per-op bars ----------------------------------------------------------------------


def _op_colors(ops_a: pd.DataFrame, ops_b: pd.DataFrame) -> dict[str, str]:
    """A colour per plain op label (``block.op``; A's first, in order); a fused op takes the
    colour of its first op."""
    plain: list[str] = []
    fused: list[tuple[str, str]] = []
    for df in (ops_a, ops_b):
        for _, r in df.iterrows():
            label = _op_label(r.get("block"), r.get("op"))
            parts = str(r.get("op")).split(FUSED_SEP)
            if len(parts) > 1:
                fused.append((label, _op_label(r.get("block"), parts[0])))
            for part in parts:
                part_label = _op_label(r.get("block"), part)
                if part_label not in plain:
                    plain.append(part_label)
    colors = {op: OP_PALETTE[i % len(OP_PALETTE)] for i, op in enumerate(plain)}
    for label, first in fused:
        colors[label] = colors[first]
    return colors


def _op_label(block: Any, op: Any) -> str:
    op = "(none)" if op is None or op != op else str(op)
    if block is None or block != block or op.startswith(f"{block}."):
        return op
    return f"{block}.{op}"


def op_stack(
    ops_a: pa.Table | pd.DataFrame,
    ops_b: pa.Table | pd.DataFrame | None = None,
    labels: Sequence[str] = ("A", "B"),
    metric: str = "kernel_sum_us",
    coverage: pa.Table | pd.DataFrame | None = None,
) -> go.Figure:
    """Stacked per-op bars: for each layer kind one bar per side, one segment per op.

    Inputs are ``metrics.op_table`` results. A fused op of B (named ``x+y+z``) is one hatched
    segment whose hover lists the ops of A it swallowed (from ``compare.fused_coverage`` where
    given, else from its name); each plain op keeps one colour across both sides.
    """
    a = frame(ops_a)
    b = frame(ops_b) if ops_b is not None else pd.DataFrame()
    if a.empty and b.empty:
        return _empty("no ops: no kernel of these runs is attributed to an op")
    cov = frame(coverage)
    covers: dict[str, str] = {}
    if not cov.empty:
        op_col = "b_op" if "b_op" in cov else "op"
        cov_col = next((c for c in ("covers", "a_ops", "covered") if c in cov), None)
        if cov_col:
            for _, r in cov.iterrows():
                val = r[cov_col]
                if isinstance(val, list | tuple) or hasattr(val, "tolist"):
                    val = ", ".join(str(v) for v in list(val))
                covers[str(r[op_col])] = str(val)
    colors = _op_colors(a, b)
    sides = [(labels[0], a)] + ([(labels[1], b)] if ops_b is not None else [])
    kinds = list(dict.fromkeys([*a.get("layer_kind", []), *b.get("layer_kind", [])]))
    fig = go.Figure()
    shown: set[str] = set()
    for label, df in sides:
        if df.empty:
            continue
        for _, r in df.iterrows():
            op = str(r["op"]) if r["op"] is not None else "(none)"
            name = _op_label(r.get("block"), r["op"])
            fused = FUSED_SEP in op
            hover = f"{label}: {name}<br>{METRICS.get(metric, metric)}: {_fmt(r[metric], 1)}"
            if "kernels" in r and metric != "kernels":
                hover += f"<br>kernels: {_fmt(r['kernels'], 1)}"
            if fused:
                swallowed = covers.get(op) or ", ".join(op.split(FUSED_SEP))
                hover += f"<br>fused: covers {swallowed}"
            fig.add_trace(
                go.Bar(
                    x=[[str(r["layer_kind"])], [label]],
                    y=[r[metric]],
                    name=name,
                    legendgroup=name,
                    showlegend=name not in shown,
                    marker=dict(
                        color=colors.get(name, "#999999"),
                        pattern_shape="/" if fused else "",
                        line=dict(width=0.5, color="white"),
                    ),
                    hovertemplate=hover + "<extra></extra>",
                )
            )
            shown.add(name)
    fig.update_layout(
        barmode="stack",
        height=520,
        margin=dict(t=30, b=40, l=60, r=20),
        yaxis_title=METRICS.get(metric, metric),
        xaxis_title="layer kind · run" if len(kinds) > 1 else "run",
        legend=dict(font=dict(size=10), traceorder="normal"),
    )
    if len(kinds) > 1:
        fig.update_xaxes(type="multicategory")
    return fig


# ---- kernel timeline --------------------------------------------------------------------------


def layer_kernels(
    kernels: pa.Table, layer: int | None, step: int | None, rank: int | None = None
) -> pd.DataFrame:
    """The kernels of one layer in one step (and rank), in start order, with ``t0_us`` and
    ``dur_us`` relative to the layer's first kernel start. ``layer=None`` takes the whole step;
    ``step=None`` takes kernels with no step (traces without step ranges). The selection is
    :func:`analysis.timeline.select`'s, as ``decodescope timeline`` and the view's sums make it."""
    out = frame(tl.select(kernels, layer, step, rank))
    if out.empty:
        return out
    out = out.sort_values("start_ns").copy()
    if out.empty:
        return out
    t0 = out["start_ns"].min()
    out["t0_us"] = (out["start_ns"] - t0) / 1e3
    out["dur_us"] = (out["end_ns"] - out["start_ns"]) / 1e3
    return out


def _dims(r: pd.Series, prefix: str) -> str:
    vals = [r.get(f"{prefix}_{c}") for c in "xyz"]
    if all(v is None or v != v for v in vals):
        return "-"
    return "(" + ", ".join("-" if v is None or v != v else str(int(v)) for v in vals) + ")"


def timeline(
    kernels_a: pa.Table,
    kernels_b: pa.Table | None,
    layer: int | None,
    step: int | None,
    labels: Sequence[str] = ("A", "B"),
    rank: int | None = None,
    step_b: int | None | str = "same",
) -> go.Figure:
    """Gantt of one layer's kernels in one step (``layer=None``: the whole step), A above B, on
    one time axis that starts at each side's first kernel of the layer; one lane per stream.
    ``step_b`` is B's step where the two runs number their steps differently (default: ``step``).
    Hover: name, op, grid, block, registers, duration."""
    sb = step if step_b == "same" else step_b
    sides = [(labels[0], layer_kernels(kernels_a, layer, step, rank), SIDE_COLORS[0])]
    if kernels_b is not None:
        sides.append((labels[1], layer_kernels(kernels_b, layer, sb, rank), SIDE_COLORS[1]))
    if all(df.empty for _, df, _ in sides):
        where = "the step" if layer is None else f"layer {layer}"
        return _empty(f"no kernels in {where}, step {step}")
    fig = go.Figure()
    lanes: list[str] = []
    for label, df, color in sides:
        if df.empty:
            continue
        df = df.assign(lane=[f"{label} · stream {s}" for s in df["stream"]])
        lanes += [ln for ln in dict.fromkeys(df["lane"]) if ln not in lanes]
        custom = [
            [
                str(r["name"]),
                _op_label(r.get("block"), r.get("op")),
                _dims(r, "grid"),
                _dims(r, "block"),
                _fmt(r.get("registers")),
                f"{r['dur_us']:.2f}",
                f"{r['t0_us']:.2f}",
            ]
            for _, r in df.iterrows()
        ]
        fig.add_trace(
            go.Bar(
                name=label,
                orientation="h",
                y=df["lane"].tolist(),
                x=df["dur_us"].tolist(),
                base=df["t0_us"].tolist(),
                marker=dict(color=color, line=dict(width=0.5, color="black")),
                customdata=custom,
                hovertemplate=(
                    "<b>%{customdata[0]}</b><br>op: %{customdata[1]}<br>grid: %{customdata[2]}"
                    "<br>block: %{customdata[3]}<br>registers: %{customdata[4]}"
                    "<br>duration: %{customdata[5]} us<br>start: +%{customdata[6]} us"
                    "<extra>" + label + "</extra>"
                ),
            )
        )
    fig.update_layout(
        barmode="overlay",
        height=140 + 50 * len(lanes),
        margin=dict(t=30, b=40, l=140, r=20),
        xaxis_title=f"us from the {'step' if layer is None else 'layer'}'s first kernel start",
        yaxis=dict(
            categoryorder="array", categoryarray=list(reversed(lanes)), title="run · CUDA stream"
        ),
        legend=dict(orientation="h", y=1.08, x=0),
    )
    return fig


# ---- history ----------------------------------------------------------------------------------


def history(
    points: pa.Table | pd.DataFrame,
    metric: str = "span_us",
    x: str = "created_at",
    baseline: str | None = None,
    regressions: Sequence[str] = (),
) -> go.Figure:
    """A metric over a results dataset's runs: one line per (backend, layer kind).

    ``points`` has one row per (run, layer kind): ``run_id``, ``x`` (a date or commit),
    ``backend``, ``layer_kind``, optionally ``setup`` (one line per setup too) and the metric (a ``metrics.kind_table`` row per run, with the
    run's metadata). The run ``baseline`` is ringed; runs in ``regressions`` are red crosses.
    """
    df = frame(points)
    if df.empty or metric not in df:
        return _empty("no history: the dataset holds no runs with this metric")
    # in time order whatever the x axis: commit hashes sorted as text are in no order at all
    order = [c for c in ("created_at", "run_id") if c in df]
    df = df.sort_values(order or x, kind="stable")
    fig = go.Figure()
    regressed = set(regressions)
    keys = [k for k in ("setup", "backend", "layer_kind") if k in df]
    for key, g in df.groupby(keys, dropna=False, sort=True):
        name = " · ".join(str(k) for k in key if k == k and k not in (None, ""))
        hover_x = g["git_commit"] if "git_commit" in g else g["run_id"]
        fig.add_trace(
            go.Scatter(
                x=g[x].tolist(),
                y=g[metric].tolist(),
                mode="lines+markers",
                name=name,
                customdata=list(zip(g["run_id"], hover_x, strict=True)),
                hovertemplate=(
                    f"{name}<br>%{{x}}<br>{METRICS.get(metric, metric)}: %{{y:,.1f}}"
                    "<br>run %{customdata[0]}<br>commit %{customdata[1]}<extra></extra>"
                ),
            )
        )
    if baseline is not None:
        b = df[df["run_id"] == baseline]
        if not b.empty:
            fig.add_trace(
                go.Scatter(
                    x=b[x].tolist(),
                    y=b[metric].tolist(),
                    mode="markers",
                    name="baseline",
                    marker=dict(size=16, symbol="circle-open", color="black", line_width=2),
                    hoverinfo="skip",
                )
            )
            for v in b[metric]:
                fig.add_hline(y=float(v), line_dash="dot", line_color="#888888")
    r = df[df["run_id"].isin(regressed)]
    if not r.empty:
        fig.add_trace(
            go.Scatter(
                x=r[x].tolist(),
                y=r[metric].tolist(),
                mode="markers",
                name="regression",
                marker=dict(size=13, symbol="x", color=REGRESSION_COLOR),
                hoverinfo="skip",
            )
        )
    fig.update_layout(
        height=420,
        margin=dict(t=30, b=40, l=60, r=20),
        yaxis_title=METRICS.get(metric, metric),
        xaxis_title={
            "created_at": "run created",
            "git_commit": "git commit (in run order)",
        }.get(x, x),
    )
    if x != "created_at":  # categories in the order of the runs, not of first trace
        fig.update_xaxes(
            type="category", categoryorder="array", categoryarray=list(dict.fromkeys(df[x]))
        )
    return fig


# ---- export -----------------------------------------------------------------------------------


def to_html(fig: go.Figure) -> str:
    """A self-contained HTML page of ``fig`` (plotly.js inlined: it opens offline)."""
    return fig.to_html(include_plotlyjs=True, full_html=True)


def to_png(fig: go.Figure, width: int = 1400, height: int | None = None) -> bytes:
    """``fig`` as PNG through kaleido (needs a Chromium; raises if kaleido cannot run)."""
    return fig.to_image(format="png", width=width, height=height or fig.layout.height or 600)


def table_bytes(table: pa.Table | pd.DataFrame, fmt: str) -> bytes:
    """``table`` as ``csv`` or ``parquet`` bytes, for a download."""
    if fmt == "csv":
        return frame(table).to_csv(index=False).encode()
    if fmt == "parquet":
        import pyarrow.parquet as pq

        t = (
            table
            if isinstance(table, pa.Table)
            else pa.Table.from_pandas(table, preserve_index=False)
        )
        buf = io.BytesIO()
        pq.write_table(t, buf)
        return buf.getvalue()
    raise ValueError(f"unknown table format {fmt!r} (csv | parquet)")
