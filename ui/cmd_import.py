"""``decodescope import TRACE --out DIR``: read a trace (or run folder), attribute it, write a run."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path

import pyarrow.compute as pc
import typer

from decodescope import tracer
from decodescope.analysis.schema import UNATTRIBUTED, Run
from decodescope.ui.cli import app, console, err_console
from decodescope.ui.render import progress

SCHEME_HELP = "naming scheme TOML (patterns from range names to layer/op; see analysis/naming.toml)"


class Backend(StrEnum):
    """The values ``runs.backend`` takes (analysis/schema.py); any other is refused, exit 2."""

    standard = "standard"
    specialized = "specialized"
    other = "other"


def load_with_progress(path: str | Path, scheme: Path | None = None, **options) -> Run:
    """``tracer.load`` behind a spinner on stderr (the output stays clean for --json)."""
    sch = tracer.read_scheme(scheme) if scheme is not None else None
    with progress(err_console, f"reading {path}"):
        return tracer.load(path, scheme=sch, **options)


def attributed_counts(run: Run) -> tuple[int, int, int]:
    """(kernels, attributed to a range, attributed to a layer)."""
    k = run.kernels
    n = k.num_rows
    if n == 0:
        return 0, 0, 0
    paths = k["range_path"].cast("string")
    in_range = n - int(
        pc.sum(pc.equal(pc.fill_null(paths, UNATTRIBUTED), UNATTRIBUTED)).as_py() or 0
    )
    in_layer = n - k["layer"].null_count
    return n, in_range, in_layer


def kernels_without_launch(run: Run) -> int:
    """Kernels whose launch (the runtime / driver API record of their correlation id) is not in
    the trace: they cannot be placed in a CPU range, only in a GPU one, and are most often
    unattributed (a trace cut at its start, or recorded without the CUDA runtime API)."""
    k = run.kernels
    return k["launch_start_ns"].null_count if k.num_rows else 0


@app.command("import")
def import_(
    trace: Path = typer.Argument(..., help="Kineto JSON(.gz), Nsight Systems SQLite or run folder"),
    out: Path = typer.Option(..., "--out", "-o", help="run folder to write"),
    run_id: str | None = typer.Option(None, help="run id (default: derived from the content)"),
    workload: str | None = typer.Option(None, help="record the workload name"),
    backend: Backend | None = typer.Option(None, case_sensitive=False, help="record the backend"),
    preset: str | None = typer.Option(None, help="record the model preset"),
    notes: str | None = typer.Option(None, help="free-text notes kept with the run"),
    overwrite: bool = typer.Option(
        False, help="replace --out if it is a run folder (or an empty folder)"
    ),
    scheme: Path | None = typer.Option(None, "--scheme", help=SCHEME_HELP),
) -> None:
    """Import a trace as a run folder (one Parquet file per table). Nothing is left on error."""
    options = {"run_id": run_id} if run_id else {}
    run = load_with_progress(trace, scheme, **options)
    changes = {
        k: v
        for k, v in (
            ("workload", workload),
            ("backend", backend.value if backend is not None else None),
            ("preset", preset),
            ("notes", notes),
        )
        if v is not None
    }
    if changes:
        run = run.replace(meta=run.meta.replace(**changes))
    with progress(err_console, f"writing {out}"):
        tracer.write_run(run, out, overwrite=overwrite)
    n, in_range, in_layer = attributed_counts(run)
    no_launch = kernels_without_launch(run)
    launch_note = f", {no_launch} without a launch record" if no_launch else ""
    console.print(
        f"wrote {out}: run {run.run_id}, {n} kernels ({in_range} in a range, {in_layer} in a layer"
        f"{launch_note}), {run.ranges.num_rows} ranges, {run.memops.num_rows} memops",
        highlight=False,
        soft_wrap=True,
    )
    from decodescope.ui.cmd_report import skipped_records

    skipped = skipped_records(run)
    if skipped:  # nothing dropped silently: say it here, not only in the report
        total = sum(n for _, n in skipped)
        why = "; ".join(f"{n} {reason}" for reason, n in skipped[:4])
        more = f"; {len(skipped) - 4} more reasons" if len(skipped) > 4 else ""
        err_console.print(
            f"[yellow]note[/]: {total} record(s) of {trace} not imported ({why}{more}); "
            f"`decodescope report {out}` lists them",
            highlight=False,
            soft_wrap=True,
        )
