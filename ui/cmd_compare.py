"""``decodescope compare A B``: side by side per layer kind, per layer and per op, with a verdict."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import typer

from decodescope.analysis import compare as cmp
from decodescope.analysis import metrics
from decodescope.analysis.schema import Run
from decodescope.ui.cli import app, console
from decodescope.ui.cmd_import import SCHEME_HELP, load_with_progress
from decodescope.ui.cmd_report import HEADERS, chunk_note, knobs_of, run_summary
from decodescope.ui.render import arrow_table, dumps

_SIDE = ["kernels", "span_us"]


def _cols(prefix_keys: list[str], ms: list[str]) -> list[str]:
    out = list(prefix_keys)
    for m in ms:
        out += [f"a_{m}", f"b_{m}", f"{m}_delta"]
    return [*out, "ratio"]


def _skew_pair(ak, bk) -> pa.Table:
    """Per layer: the ranks' start and end skew of A and of B (medians over steps; null on a
    side with one rank)."""
    sides = []
    for k in (ak, bk):
        t = metrics.skew_table(k) if len(metrics.ranks_of(k)) > 1 else None
        sides.append({} if t is None else {r["layer"]: r for r in t.to_pylist()})
    layers = sorted(set(sides[0]) | set(sides[1]))

    def col(side: int, m: str) -> list:
        return [sides[side].get(lyr, {}).get(m) for lyr in layers]

    kinds = [(sides[0].get(lyr) or sides[1].get(lyr) or {}).get("layer_kind") for lyr in layers]
    return pa.table(
        {
            "layer": pa.array(layers, pa.int32()),
            "layer_kind": pa.array(kinds, pa.string()),
            **{
                f"{s}_{m}": pa.array(col(i, m), pa.float64())
                for m in ("start_skew_us", "end_skew_us", "span_all_us")
                for i, s in enumerate("ab")
            },
        }
    )


def knob_lines(a: Run, b: Run) -> list[str]:
    """The kernel knobs (``DECODESCOPE_*`` set at capture) that differ between A and B, one line
    per side, each knob as ``K=V`` or ``K unset``; [] where both sides have the same knobs."""
    ka, kb = knobs_of(a.meta), knobs_of(b.meta)
    if ka == kb:
        return []
    diff = sorted(k for k in set(ka) | set(kb) if ka.get(k) != kb.get(k))

    def side(knobs: dict[str, str]) -> str:
        set_ = [f"{k}={knobs[k]}" for k in diff if k in knobs]
        unset = [k for k in diff if k not in knobs]
        return ", ".join(set_ + [f"{k} unset" for k in unset])

    return [f"knobs that differ: A {side(ka)}", f"                  B {side(kb)}"]


SHAPE_FIELDS = ("preset", "tp_shape", "tp_world", "batch", "tokens_per_seq")


def shape_lines(a: Run, b: Run) -> list[str]:
    """One line naming the step shapes where A and B were captured at different ones (preset,
    tp_shape, tp_world, batch, tokens per sequence; fields a side does not record are left out):
    their layers then do different work, and the ratios are not a speedup; and a line each where
    they ran on different GPUs or in different graph modes. [] where they agree."""
    diff = [
        f
        for f in SHAPE_FIELDS
        if getattr(a.meta, f, None) is not None
        and getattr(b.meta, f, None) is not None
        and getattr(a.meta, f) != getattr(b.meta, f)
    ]
    out = []
    ga, gb = a.meta.gpu, b.meta.gpu
    if ga and gb and ga != gb:
        out.append(f"different GPUs (ratios compare different hardware): A {ga}; B {gb}")
    ma, mb = a.meta.graph_mode, b.meta.graph_mode
    if ma and mb and ma != mb:  # eager launches vs a CUDA graph's replay: launch gaps differ
        out.append(f"different graph modes (ratios include launch overhead): A {ma}; B {mb}")
    if not diff:
        return out

    def side(run: Run) -> str:
        return ", ".join(f"{f} {getattr(run.meta, f)}" for f in diff)

    return [
        f"different step shapes (ratios compare different work): A {side(a)}; B {side(b)}",
        *out,
    ]


def chunk_lines(a: Run, b: Run) -> list[str]:
    """A line per side whose step ran in sequence chunks (:func:`.cmd_report.chunk_note`): its
    layers' spans then hold every chunk's launches, so a comparison with a one-pass run is a
    comparison of 4-8 passes over the weights with one."""
    return [
        f"{side} ran in {note}"
        for side, run in (("A", a), ("B", b))
        if (note := chunk_note(run.meta))
    ]


def compare_data(a: Run, b: Run) -> dict[str, Any]:
    ak, bk = a.kernels, b.kernels
    kinds = cmp.compare_kinds(ak, bk)
    extra: dict[str, Any] = {}
    if len(metrics.ranks_of(ak)) > 1 or len(metrics.ranks_of(bk)) > 1:
        # several ranks on a side: layer kinds per rank (rank 0 of A against rank 0 of B, ...)
        # and the skew between ranks per layer
        extra["rank_kinds"] = cmp._side_by_side(
            metrics.rank_kind_table(ak), metrics.rank_kind_table(bk), ["rank", "layer_kind"],
            ("kernels", "span_us", "busy_us", "gaps_us", "kernel_sum_us"),
        )  # fmt: skip
        extra["skew"] = _skew_pair(ak, bk)
    return {
        "a": run_summary(a),
        "b": run_summary(b),
        "knobs_differ": knob_lines(a, b),
        "chunked": chunk_lines(a, b),
        "shapes_differ": shape_lines(a, b),
        "verdict": cmp.verdicts(kinds),
        "kinds": kinds,
        "layers": cmp.compare_layers(ak, bk),
        "ops": cmp.compare_ops(ak, bk),
        "fused": cmp.fused_coverage(ak, bk),
        "only_one_side": cmp.only_one_side(ak, bk),
        **extra,
    }


@app.command("compare")
def compare(
    a: Path = typer.Argument(..., help="run A (run folder, trace or DATASET@RUN_ID)"),
    b: Path = typer.Argument(..., help="run B (run folder, trace or DATASET@RUN_ID)"),
    json_out: bool = typer.Option(False, "--json", help="print JSON instead of tables"),
    top: int = typer.Option(20, "--top", min=0, help="rows of the one-side kernel list"),
    scheme: Path | None = typer.Option(None, "--scheme", help=SCHEME_HELP),
) -> None:
    """Compare run A with run B: kernels and span per layer kind, layer and op; ratio = A/B time."""
    run_a = load_with_progress(a, scheme)
    run_b = load_with_progress(b, scheme)
    if json_out:
        typer.echo(dumps(compare_data(run_a, run_b)))
        return
    print_compare(run_a, run_b, top=top, a_label=str(a), b_label=str(b))


def print_compare(
    run_a: Run, run_b: Run, *, top: int = 20, a_label: str = "A", b_label: str = "B"
) -> None:
    """Print the comparison tables of run A and run B (what ``compare`` shows)."""
    a, b = a_label, b_label
    data = compare_data(run_a, run_b)
    console.print(
        f"A: {a}  ({data['a']['run_id']}, {data['a']['kernels']} kernels)", highlight=False
    )
    console.print(
        f"B: {b}  ({data['b']['run_id']}, {data['b']['kernels']} kernels)", highlight=False
    )
    for line in shape_lines(run_a, run_b):
        console.print(f"[yellow]{line}[/]", highlight=False, soft_wrap=True)
    for line in knob_lines(run_a, run_b) + chunk_lines(run_a, run_b):
        console.print(line, highlight=False, soft_wrap=True)
    if not data["verdict"]:
        console.print(
            "[yellow]no kernel is attributed to a layer on either side[/]: nothing to compare per "
            "layer; kernels present on one side only follow.",
            soft_wrap=True,
        )
    for line in data["verdict"]:
        console.print(f"[bold]{line}[/]", highlight=False)
    if data["kinds"].num_rows:
        console.print(
            arrow_table(
                data["kinds"],
                "per layer kind (ratio = A span / B span: speedup of B)",
                _cols(
                    ["layer_kind", "a_layers", "b_layers"],
                    [*_SIDE, "share_us", "busy_us", "gaps_us"],
                ),
                HEADERS,
            )
        )
        if "rank_kinds" in data:
            console.print(
                arrow_table(
                    data["rank_kinds"],
                    "per layer kind and rank (ratio = A span / B span)",
                    _cols(["rank", "layer_kind", "a_layers", "b_layers"], _SIDE),
                    HEADERS,
                )
            )
            console.print(
                arrow_table(
                    data["skew"],
                    "skew between ranks per layer (median over steps; start/end skew = latest "
                    "minus earliest rank's layer start/end)",
                    ["layer", "layer_kind", "a_start_skew_us", "b_start_skew_us",
                     "a_end_skew_us", "b_end_skew_us", "a_span_all_us", "b_span_all_us"],
                    HEADERS,
                )
            )  # fmt: skip
        console.print(
            arrow_table(
                data["layers"], "per layer", _cols(["rank", "layer", "layer_kind"], _SIDE), HEADERS
            )
        )
        console.print(
            arrow_table(
                data["ops"],
                "per op (per layer-step medians)",
                _cols(
                    ["layer_kind", "block", "op"],
                    ["kernels", "span_us", "kernel_sum_us", "share_us"],
                ),
                HEADERS,
            )
        )
    if data["fused"].num_rows:
        console.print(arrow_table(data["fused"], "fused ops of B and the ops of A they cover"))
    console.print(
        arrow_table(
            data["only_one_side"],
            "kernels present on one side only",
            ["side", "name", "calls", "total_us", "ops"],
            HEADERS,
            limit=top,
            max_width={"name": 80, "ops": 40},
        )
    )
