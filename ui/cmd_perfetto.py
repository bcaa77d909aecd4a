"""``decodescope perfetto RUN --out trace.json``: a Chrome-trace JSON for ui.perfetto.dev."""

from __future__ import annotations

from pathlib import Path

import typer

from decodescope.ui.cli import app, console, err_console
from decodescope.ui.render import progress


@app.command("perfetto")
def perfetto_cmd(
    run: Path = typer.Argument(
        ..., help="A run folder, Kineto JSON, nsys SQLite export or DATASET@RUN_ID."
    ),
    out: Path = typer.Option(
        ..., "--out", "-o", help="Chrome-trace JSON to write (.json or .json.gz)."
    ),
) -> None:
    """Export a run as Chrome-trace JSON: kernels per stream, ranges on CPU and GPU tracks."""
    from decodescope.tracer.chrome import write_chrome_trace
    from decodescope.ui.cmd_import import load_with_progress

    r = load_with_progress(run)
    with progress(err_console, f"writing {out}"):
        n = write_chrome_trace(r, out)
    console.print(f"{n} events -> {out} (open it in https://ui.perfetto.dev)", highlight=False)
