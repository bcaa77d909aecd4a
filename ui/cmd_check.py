"""``decodescope check RUN --baseline RUN_OR_DATASET --max-regression PCT``: exit 1 on a
regression (with the reasons), 0 otherwise."""

from __future__ import annotations

from pathlib import Path

import typer

from decodescope.analysis import dataset as layout
from decodescope.analysis import regress
from decodescope.tracer import dataset as tds
from decodescope.ui.cli import UsageError, app, console
from decodescope.ui.cmd_import import SCHEME_HELP, load_with_progress
from decodescope.ui.render import arrow_table, dumps


def _baseline(path: Path, run, scheme: Path | None) -> tuple[list, str]:
    """The baseline kernels tables and a description of where they came from."""
    if tds.is_dataset(path):
        runs = tds.read_table(path, "runs").to_pylist()
        ids = layout.select_baseline(runs, run.meta)
        if not ids:
            keys = ", ".join(f"{k}={getattr(run.meta, k)}" for k in layout.BASELINE_KEYS)
            raise UsageError(f"{path}: no baseline run with the same {keys}")
        kernels = tds.read_table(path, "kernels", ids)
        return [kernels], f"dataset {path} ({len(ids)} run(s): median of their figures)"
    base = load_with_progress(path, scheme)
    return [base.kernels], f"run {base.run_id}"


@app.command("check")
def check(
    run: Path = typer.Argument(..., help="the run to check (run folder or trace)"),
    baseline: Path = typer.Option(..., "--baseline", help="baseline run folder, trace or dataset"),
    max_regression: float = typer.Option(
        ..., "--max-regression", min=0, help="allowed increase in percent (span and kernels)"
    ),
    max_kernel_increase: float | None = typer.Option(
        None, "--max-kernel-increase", min=0, help="allowed kernel-count increase in percent"
    ),
    json_out: bool = typer.Option(False, "--json", help="print JSON instead of tables"),
    scheme: Path | None = typer.Option(None, "--scheme", help=SCHEME_HELP),
) -> None:
    """Compare a run with a baseline per layer kind; exit 1 if span or kernel count regressed."""
    current = load_with_progress(run, scheme)
    bases, origin = _baseline(baseline, current, scheme)
    result = regress.check(
        current, bases, max_regression, max_kernel_increase_pct=max_kernel_increase
    )
    if json_out:
        typer.echo(
            dumps(
                {
                    "ok": result.ok,
                    "reasons": result.reasons,
                    "baseline": origin,
                    "table": result.table,
                }
            )
        )
    else:
        console.print(f"baseline: {origin}", highlight=False, soft_wrap=True)
        console.print(arrow_table(result.table, "per layer kind: run vs baseline"))
        if result.ok:
            console.print(f"[green]ok[/]: no regression above {max_regression:g}%")
        else:
            console.print("[bold red]regression[/]:")
            for r in result.reasons:
                console.print(f"  - {r}", highlight=False, soft_wrap=True)
    raise typer.Exit(0 if result.ok else 1)
