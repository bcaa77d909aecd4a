"""``decodescope report RUN_OR_TRACE``: per layer kind, per layer, per op, top kernels."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import typer

from decodescope.analysis import metrics
from decodescope.analysis.schema import Run
from decodescope.ui.cli import app, console
from decodescope.ui.cmd_import import (
    SCHEME_HELP,
    attributed_counts,
    kernels_without_launch,
    load_with_progress,
)
from decodescope.ui.op_floors import op_floors
from decodescope.ui.render import arrow_table, dumps

LAYER_COLS = ["kernels", "span_us", "busy_us", "gaps_us", "kernel_sum_us", "share_us"]
HEADERS = {
    "layer_kind": "kind",
    "span_us": "span us",
    "busy_us": "busy us",
    "gaps_us": "gaps us",
    "kernel_sum_us": "kernel-sum us",
    "share_us": "share us",
    "span_us_min": "span min",
    "span_us_max": "span max",
    "total_us": "total us",
    "median_us": "median us",
    "min_us": "min us",
    "max_us": "max us",
    "kernel_names": "kernel names",
    "floor_us": "bytes floor us",
    "efficiency": "span / floor",
    "share_efficiency": "share / floor",
    "op_floor_us": "bytes floor us",
    "share_over_floor_us": "share - floor us",
    "compute_floor_us": "compute floor us",
    "bound": "bound",
    "roof_floor_us": "roof floor us",
    "share_roof": "share / roof",
}


def _floor_cols(kinds: pa.Table) -> list[str]:
    """The bytes-floor columns, where the run measured them (our own captures), and the roof
    floor's where it measured its GEMM rate too (:func:`with_roof`)."""
    if kinds.num_rows and kinds["floor_us"].null_count < kinds.num_rows:
        roof = ["roof_floor_us", "share_roof"] if "roof_floor_us" in kinds.column_names else []
        return ["floor_us", "efficiency", "share_efficiency", *roof]
    return []


def with_roof(kinds: pa.Table, ops: pa.Table) -> pa.Table:
    """The per-kind table with ``roof_floor_us``, each op's larger floor (bytes or compute,
    :func:`decodescope.ui.op_floors.op_floors`) summed over the kind's ops, and ``share_roof``
    = share / that: a floor no kernel of these ops can beat, tighter than the bytes floor where
    the ops' GEMMs are bound by compute (the verify steps' 256-512 rows). Unchanged where the
    ops have no compute floors (no GEMM rate recorded)."""
    if "roof_floor_us" not in ops.column_names or "layer_kind" not in kinds.column_names:
        return kinds
    sums: dict[str, float] = {}
    for kind, roof in zip(ops["layer_kind"].to_pylist(), ops["roof_floor_us"].to_pylist(),
                          strict=True):  # fmt: skip
        if kind is not None and roof is not None:
            sums[kind] = sums.get(kind, 0.0) + roof
    roof = [sums.get(k) for k in kinds["layer_kind"].to_pylist()]
    share = [s / r if s is not None and r else None
             for s, r in zip(kinds["share_us"].to_pylist(), roof, strict=True)]  # fmt: skip
    return kinds.append_column("roof_floor_us", pa.array(roof, pa.float64())).append_column(
        "share_roof", pa.array(share, pa.float64()))  # fmt: skip


def dropped_records(run: Run) -> int:
    """Records the source dropped: the run's own count plus overheads rows of that kind."""
    n = run.meta.dropped_records or 0
    o = run.overheads
    if o.num_rows:
        kinds = o["kind"].cast(pa.string())
        mask = pc.fill_null(pc.match_substring(kinds, "dropped"), False)
        n += int(pc.sum(pc.fill_null(o.filter(mask)["count"], 0)).as_py() or 0)
    return n


def overhead_summary(run: Run) -> list[dict[str, Any]]:
    """Per overheads kind: its rows and their summed count; the records an importer skipped or
    did not import (``SKIP_KINDS``) one row per reason, the reason as ``detail``."""
    o = run.overheads
    if o.num_rows == 0:
        return []
    t = o.select(["kind", "detail", "count"]).cast(
        pa.schema([("kind", pa.string()), ("detail", pa.string()), ("count", pa.int64())])
    )
    skip = pc.fill_null(pc.is_in(t["kind"], pa.array(SKIP_KINDS)), False)
    t = t.set_column(1, "detail", pc.if_else(skip, t["detail"], pa.scalar(None, pa.string())))
    g = t.group_by(["kind", "detail"], use_threads=False).aggregate(
        [("count", "sum"), ("kind", "count")]
    )
    return [
        {"kind": r["kind"], "detail": r["detail"], "records": r["kind_count"],
         "count": r["count_sum"]}
        for r in g.to_pylist()
    ]  # fmt: skip


SKIP_KINDS = ("skipped_events", "unknown_category")


def skipped_records(run: Run) -> list[tuple[str, int]]:
    """(reason, count) of the records an importer skipped or did not import, most first."""
    rows = [(r["detail"] or r["kind"], int(r["count"] or 0)) for r in overhead_summary(run)
            if r["kind"] in SKIP_KINDS]  # fmt: skip
    return sorted(rows, key=lambda x: -x[1])


def _ops_of(run: Run) -> str | None:
    from decodescope.ui.cmd_bench import impl_line

    line = impl_line(run)
    return line.split(": ", 1)[1] if line else None


def knobs_of(meta) -> dict[str, str]:
    """The kernel knobs a capture recorded: ``config_json["knobs"]`` (every capture since
    bbfddcf) and the specialized workload's own ``kernel_env`` (older runs), without the
    capture's handshake variables and empty values; {} for none or a trace."""
    from decodescope.tracer.capture import NOT_KNOBS

    try:
        cfg = meta.config
    except ValueError:
        return {}
    out: dict[str, str] = {}
    wl = cfg.get("workload")
    for k in ((wl or {}).get("kernel_env") if isinstance(wl, dict) else None, cfg.get("knobs")):
        if isinstance(k, dict):
            out.update({str(a): str(b) for a, b in k.items()})
    return {
        a: b
        for a, b in sorted(out.items())
        if b.strip() and a not in NOT_KNOBS and not a.startswith("DECODESCOPE_CAPTURE_")
    }


def chunk_note(meta) -> str | None:
    """How a run's step was split where its workload ran the layers in sequence chunks (the
    specialized kernels take at most ``MAX_STEP_TOKENS`` tokens per launch, so a larger step runs
    each layer once per chunk, reading its weights each time), e.g. ``"4 chunks of 8 sequences
    (256 tokens per step): launches and weight reads x4"``, or where the experts ran once over
    all tokens (``chunks.experts = "once"``) what ran per chunk and that the experts did not
    (with ``chunks.token_ops = "once"``: only the decode kernels per chunk; ``chunks.dense =
    "once"``: a dense layer's MLP once over all tokens too);
    None for one chunk, a trace or a run that does not record it."""
    try:
        wl = meta.config.get("workload")
    except ValueError:
        return None
    ch = wl.get("chunks") if isinstance(wl, dict) else None
    if not isinstance(ch, dict):
        return None
    try:
        n, per = int(ch["chunks"]), int(ch["sequences"])
    except (KeyError, TypeError, ValueError):
        return None
    if n <= 1:
        return None
    tps = meta.tokens_per_seq or 1
    head = f"{n} chunks of {per} sequences ({n * per * tps} tokens per step): "
    if ch.get("experts") == "once" and ch.get("token_ops") == "once":  # session 21 on
        dense = ", the dense MLP" if ch.get("dense") == "once" else ""  # session 22 on
        if ch.get("decode") == "once":  # DECODESCOPE_CHUNK_DECODE=once (session 22 on)
            return (
                f"one pass over the step's {n * per * tps} tokens: every kernel once over all of "
                f"them, none per sequence chunk (the decode kernels over all {n * per} sequences; "
                f"the projections, the MoE front/back{dense}, the experts)"
            )
        return head + (
            f"the decode kernels x{n}; the projections, the MoE front/back{dense} and the "
            "experts once over all tokens"
        )
    if ch.get("experts") == "once":  # session 20 on: the MoE experts once over all tokens
        return head + (
            f"attention and MoE front/back launches and their weight reads x{n}, the experts "
            "once over all tokens"
        )
    return head + f"launches and weight reads x{n}"


def run_summary(run: Run) -> dict[str, Any]:
    m = run.meta
    n, in_range, in_layer = attributed_counts(run)
    knobs = knobs_of(m)
    return {
        "run_id": m.run_id,
        "source": m.source,
        "source_path": m.source_path,
        "workload": m.workload,
        "backend": m.backend,
        "preset": m.preset,
        "batch": m.batch,
        "tp_shape": m.tp_shape,
        "tp_world": m.tp_world,
        "graph_mode": m.graph_mode,
        "gpu": m.gpu,
        "copy_bw_tbs": m.copy_bw_tbs,
        "gemm_tflops": m.gemm_tflops,
        "git_commit": m.git_commit,
        "created_at": str(m.created_at) if m.created_at else None,
        "cuda": m.cuda,
        "torch": m.torch,
        "kernels": n,
        "kernels_in_range": in_range,
        "kernels_in_layer": in_layer,
        "kernels_unattributed": n - in_range,
        # why many are unattributed: their launch is not in the trace (None: every one has it)
        "kernels_without_launch": kernels_without_launch(run) or None,
        "ranges": run.ranges.num_rows,
        "memops": run.memops.num_rows,
        "dropped_records": dropped_records(run),
        "ops": _ops_of(run),
        "knobs": ", ".join(f"{a}={b}" for a, b in knobs.items()) or None,
        "chunks": chunk_note(m),
        "partial": m.partial,
        "notes": m.notes or None,
        "overheads": overhead_summary(run),
    }


def report_data(run: Run, top: int) -> dict[str, Any]:
    k = run.kernels
    multi = len(metrics.ranks_of(k)) > 1
    kinds = metrics.rank_kind_table(k) if multi else metrics.kind_table(k)
    ops, why = op_floors(run, metrics.op_table(k))
    kinds = metrics.with_floor(kinds, run.meta.layer_bytes, run.meta.copy_bw_tbs)
    out = {
        "run": run_summary(run),
        "kinds": kinds if multi else with_roof(kinds, ops),  # the ops' rows span all ranks
        "layers": metrics.layer_table(k),
        "ops": ops,
        "kernels": metrics.kernel_table(k).slice(0, top),
    }
    if why:
        out["op_floors"] = why
    if multi:  # several ranks: layer kinds per rank, and how far apart the ranks ran
        out["skew"] = metrics.skew_table(k)
    return out


SKEW_HEADERS = {
    "start_skew_us": "start skew us",
    "end_skew_us": "end skew us",
    "span_all_us": "span all ranks us",
    "span_rank_max_us": "longest rank span us",
    "start_skew_us_min": "start skew min",
    "start_skew_us_max": "start skew max",
}


def print_meta(summary: dict[str, Any], title: str = "run") -> None:
    shown = {k: v for k, v in summary.items() if v is not None and k != "overheads"}
    rows = pa.table({"field": list(shown), "value": [str(v) for v in shown.values()]})
    console.print(arrow_table(rows, title=title))
    if summary.get("overheads"):
        t = pa.Table.from_pylist(summary["overheads"])
        cols = ["kind", *(["detail"] if t["detail"].null_count < t.num_rows else []), "records",
                "count"]  # fmt: skip
        console.print(arrow_table(t, title="overheads", columns=cols))


@app.command("report")
def report(
    source: Path = typer.Argument(
        ..., help="run folder, Kineto JSON(.gz), Nsight Systems SQLite or DATASET@RUN_ID"
    ),
    json_out: bool = typer.Option(False, "--json", help="print JSON instead of tables"),
    top: int = typer.Option(15, "--top", min=0, help="how many kernels to list (by total time)"),
    scheme: Path | None = typer.Option(None, "--scheme", help=SCHEME_HELP),
) -> None:
    """Per-layer-kind and per-layer tables, ops and the top kernels of one run or trace."""
    run = load_with_progress(source, scheme)
    if json_out:
        typer.echo(dumps(report_data(run, top)))
        return
    print_report(run, top=top)


def print_report(run: Run, *, top: int = 15) -> None:
    """Print the tables of one run (what ``report`` shows)."""
    data = report_data(run, top)
    print_meta(data["run"])
    if data["layers"].num_rows == 0:
        why = (
            "the run holds no kernel records (a partial capture, or a trace of CPU work only)"
            if run.kernels.num_rows == 0
            else "the trace has no layer ranges that the naming scheme (analysis/naming.toml) "
            "recognises; only the kernel table follows"
        )
        console.print(f"[yellow]no kernel is attributed to a layer[/]: {why}.", soft_wrap=True)
    else:
        per_rank = "skew" in data
        console.print(
            arrow_table(
                data["kinds"],
                "per layer kind"
                + (", per rank" if per_rank else "")
                + " (median over layers of the per-step medians)",
                [*(["rank"] if per_rank else []), "layer_kind", "layers", "steps", *LAYER_COLS,
                 *_floor_cols(data["kinds"])],
                HEADERS,
            )
        )  # fmt: skip
        console.print(
            arrow_table(
                data["layers"],
                "per layer (median over steps; span min/max)",
                ["rank", "layer", "layer_kind", "steps", *LAYER_COLS, "span_us_min", "span_us_max"],
                HEADERS,
            )
        )
        if "skew" in data:
            console.print(
                arrow_table(
                    data["skew"],
                    "skew between ranks per layer (median over steps; start/end skew = latest "
                    "minus earliest rank's layer start/end)",
                    ["layer", "layer_kind", "steps", "start_skew_us", "start_skew_us_min",
                     "start_skew_us_max", "end_skew_us", "span_all_us", "span_rank_max_us"],
                    {**HEADERS, **SKEW_HEADERS},
                )
            )  # fmt: skip
        floors = "op_floor_us" in data["ops"].column_names
        compute = "compute_floor_us" in data["ops"].column_names
        console.print(
            arrow_table(
                data["ops"],
                "per op (per layer-step medians"
                + ("; the bytes floor of the op's own part of the layer's bytes" if floors else "")
                + ("; the compute floor of its tensor-core FLOPs at the GEMM rate measured beside "
                   f"the run, {data['run']['gemm_tflops']:.0f} TFLOP/s" if compute else "")
                + ")",
                ["layer_kind", "block", "op", "layer_steps", "kernels", "span_us", "kernel_sum_us",
                 "share_us", *(["op_floor_us", "share_over_floor_us"] if floors else []),
                 *(["compute_floor_us", "bound"] if compute else [])],
                HEADERS,
            )
        )  # fmt: skip
        if data.get("op_floors"):
            console.print(f"[yellow]{data['op_floors']}[/]", soft_wrap=True)
        elif floors and not compute:
            console.print("[dim]this run recorded no GEMM rate (captured before decodescope "
                          "measured one beside its copy bandwidth): the ops' compute floors are "
                          "left out[/]", soft_wrap=True)  # fmt: skip
    console.print(
        arrow_table(
            data["kernels"],
            f"top {top} kernels by total time",
            ["name", "calls", "total_us", "median_us", "min_us", "max_us", "share", "ops"],
            HEADERS,
            max_width={"name": 80, "ops": 40},
        )
    )
