"""``decodescope timeline A [B]``: one layer's kernels in one step, in start order, with gaps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import typer

from decodescope.analysis import metrics, occupancy
from decodescope.analysis import timeline as tl
from decodescope.analysis.schema import Run
from decodescope.ui.cli import app, console, fail
from decodescope.ui.cmd_import import SCHEME_HELP, load_with_progress
from decodescope.ui.render import arrow_table, dumps, min_width

COLS = ["start_us", "end_us", "dur_us", "gap_us", "share_us", "op", "kernel", "grid",
        "ctas_sm", "waves", "bar"]  # fmt: skip
HEADERS = {
    "start_us": "start us",
    "end_us": "end us",
    "dur_us": "dur us",
    "gap_us": "gap us",
    "share_us": "share us",
    "ctas_sm": "CTAs/SM",
    "bar": "timeline",
}


def side(run: Run, label: str, layer: int | None, step: int | None, rank: int | None) -> dict:
    """One side's timeline: the step (default: the layer's median step), the kernels, the
    summary. A layer or step the run does not hold is a one-line error naming the run."""
    k = run.kernels
    if k.num_rows == 0:
        raise fail(f"{label} ({run.meta.run_id}): no kernel records")
    ranks = metrics.ranks_of(k)
    if rank is None:
        rank = ranks[0] if len(ranks) > 1 else None  # one GPU's timeline: the first rank
    elif rank not in ranks:
        raise fail(f"{label} ({run.meta.run_id}): no rank {rank} (ranks {ranks})")
    if layer is not None and layer not in tl.layers_of(k):
        have = tl.layers_of(k)
        where = f"layers {have[0]}..{have[-1]}" if have else "no kernel is attributed to a layer"
        raise fail(f"{label} ({run.meta.run_id}): no kernels of layer {layer} ({where})")
    steps = tl.steps_of(k, layer, rank)
    if step is None:
        step = tl.median_step(k, layer, rank)
    elif step not in steps:
        where = f"steps {steps[0]}..{steps[-1]}" if steps else "no step numbers"
        raise fail(f"{label} ({run.meta.run_id}): no kernels in step {step} ({where})")
    limits = occupancy.run_limits(run.meta.gpu, run.meta.config_json)
    t = tl.layer_timeline(k, layer, step, rank, limits)
    if t.num_rows == 0:
        raise fail(f"{label} ({run.meta.run_id}): no kernels of the layer in step {step}")
    return {"label": label, "run_id": run.meta.run_id, "layer": layer, "step": step,
            "steps": len(steps), "step_index": steps.index(step) + 1 if step in steps else None,
            "rank": rank, "ranks": len(ranks), "gpu": run.meta.gpu,
            "sms": limits.sms if limits else None, "summary": tl.summary(t),
            "kernels": t}  # fmt: skip


@app.command("timeline")
def timeline(
    a: Path = typer.Argument(..., help="run A (run folder, trace or DATASET@RUN_ID)"),
    b: Path | None = typer.Argument(None, help="run B, drawn below A on the same scale"),
    layer: int | None = typer.Option(
        None, "--layer", help="layer index (default: the first attributed layer; none: the step)"
    ),
    step: int | None = typer.Option(None, "--step", help="step (default: the layer's median)"),
    step_b: int | None = typer.Option(None, "--step-b", help="B's step (default: its median)"),
    rank: int | None = typer.Option(None, "--rank", help="rank of a multi-GPU run"),
    width: int | None = typer.Option(
        None,
        "--width",
        min=10,
        max=200,
        help="characters of the bars (default: up to 40, what the terminal leaves the table)",
    ),
    limit: int = typer.Option(200, "--limit", min=1, help="kernels per table (the sums: all)"),
    json_out: bool = typer.Option(False, "--json", help="print JSON instead of tables"),
    scheme: Path | None = typer.Option(None, "--scheme", help=SCHEME_HELP),
) -> None:
    """One layer's kernels in one step: start, end, duration, the gap to the kernels before
    (positive: a bubble; negative: resident early, as under PDL) and the share (what the kernel
    adds: the time it ends after the ones before it, its wait under PDL left out), with span,
    busy and idle; a multi-GPU run shows one rank (the first unless --rank)."""
    runs = [(load_with_progress(a, scheme), "A")]
    if b is not None:
        runs.append((load_with_progress(b, scheme), "B"))
    if layer is None:
        have = tl.layers_of(runs[0][0].kernels) if runs[0][0].kernels.num_rows else []
        layer = have[0] if have else None
    sides = [side(run, label, layer, step if label == "A" else step_b, rank) for run, label in runs]
    scale = max(s["summary"]["span_us"] for s in sides) or None
    if json_out:
        typer.echo(dumps([_jsonable(s) for s in sides]))
        return
    if width is None:
        width = bar_width([s["kernels"] for s in sides], limit)
    for s in sides:
        t = s["kernels"]
        t = t.append_column("bar", pa.array(bars(t, width, scale), pa.string()))
        where = "the whole step" if s["layer"] is None else f"layer {s['layer']}"
        rk = f", rank {s['rank']} (of {s['ranks']})" if s["rank"] is not None else ""
        console.print(
            arrow_table(
                t,
                f"{s['label']}: {s['run_id']}, {where}, {_step_label(s)}{rk}",
                COLS,
                HEADERS,
                limit=limit,
                max_width=MAX_WIDTH,
                no_wrap=("bar",),
            )
        )
        console.print(_summary_line(s["summary"]), highlight=False, soft_wrap=True)
        if t.num_rows and t["waves"].null_count == t.num_rows:
            console.print(_no_waves(s["gpu"], s["sms"]), highlight=False, soft_wrap=True)


MAX_WIDTH = {"kernel": 40, "op": 40}
BAR_MAX = 40


def bar_width(tables: list[pa.Table], limit: int) -> int:
    """Characters for the bars: what the terminal leaves beside the table's other columns at
    their narrowest (numbers whole, names at least ``TEXT_FLOOR``), at most ``BAR_MAX``, at least
    10; a bar never folds, so a wider one would push the table over the terminal's width."""
    need = 0
    for t in tables:
        rt = arrow_table(t, None, [c for c in COLS if c != "bar"], HEADERS, limit=limit,
                         max_width=MAX_WIDTH).table  # fmt: skip
        need = max(need, min_width(rt, console) + 3)  # the bar's border and padding
    return max(10, min(BAR_MAX, console.width - need))


def bars(t: pa.Table, width: int, scale_us: float | None = None) -> list[str]:
    """One text bar per kernel, ``width`` characters for ``scale_us`` (default: the span): the
    kernel's interval drawn with ``█`` on ``·``."""
    if t.num_rows == 0:
        return []
    scale = scale_us or float(t["end_us"].to_numpy().max()) or 1.0
    out = []
    for a, b in zip(t["start_us"].to_pylist(), t["end_us"].to_pylist(), strict=True):
        i = min(width - 1, int(a / scale * width))
        j = max(i + 1, min(width, int(np.ceil(b / scale * width))))
        out.append("·" * i + "█" * (j - i) + "·" * (width - j))
    return out


def _step_label(s: dict[str, Any]) -> str:
    """``step 551 (#3 of 6 steps)``: a step's number is the trace's own (a Kineto
    ProfilerStep#551), so its place among the run's steps is said beside it."""
    if s["step"] is None:
        return "no step numbers"
    if s["step_index"] is None:
        return f"step {s['step']}"
    return f"step {s['step']} (#{s['step_index']} of {s['steps']} step{'s' if s['steps'] != 1 else ''})"


def _summary_line(m: dict[str, Any]) -> str:
    return (f"{m['kernels']} kernels: span {m['span_us']:.1f} us, busy {m['busy_us']:.1f}, "
            f"idle {m['idle_us']:.1f} (bubbles), overlap {m['overlap_us']:.1f} "
            f"(kernels resident before the ones before them ended), shares {m['shares_us']:.1f} "
            "(busy after the previous layer's end)")  # fmt: skip


def _no_waves(gpu: str | None, sms: int | None) -> str:
    """Why the CTAs/SM and waves columns are empty."""
    if sms is None:
        which = repr(gpu) if gpu else "the GPU (the trace names none)"
        return (f"CTAs/SM, waves: the per-SM limits of {which} are not known (no device "
                "properties in the trace, not in analysis/occupancy.py LIMITS)")  # fmt: skip
    return "CTAs/SM, waves: the records carry no registers or block sizes"


def _jsonable(s: dict) -> dict:
    return {**{k: v for k, v in s.items() if k != "kernels"}, "kernels": s["kernels"].to_pylist()}
