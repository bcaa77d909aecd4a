"""``decodescope export RUN... --to DATASET`` and ``decodescope query DATASET "SQL"``."""

from __future__ import annotations

from pathlib import Path

import typer

from decodescope.analysis.schema import TABLES
from decodescope.tracer import dataset as tds
from decodescope.tracer.errors import TraceError
from decodescope.ui.cli import UsageError, app, console, err_console
from decodescope.ui.cmd_import import load_with_progress
from decodescope.ui.render import arrow_table, dumps, progress


@app.command("export")
def export(
    runs: list[Path] = typer.Argument(..., help="run folders or traces to append"),
    to: Path = typer.Option(..., "--to", help="results dataset folder (created if missing)"),
    replace: bool = typer.Option(False, help="overwrite runs the dataset already holds"),
) -> None:
    """Append runs to a Parquet results dataset (Hive partitions gpu=/preset=/backend=/run_id=)."""
    loaded = [load_with_progress(p) for p in runs]
    ids = [r.run_id for r in loaded]
    dup = {i for i in ids if ids.count(i) > 1}
    if dup:
        raise UsageError(f"the same run given twice: {', '.join(sorted(dup))}")
    if not replace and to.is_dir():
        have = tds.run_ids(to) & set(ids)
        if have:
            raise TraceError(to, f"already holds run(s) {', '.join(sorted(have))} (pass --replace)")
    for path, run in zip(runs, loaded, strict=True):
        with progress(err_console, f"appending {path}"):
            where = tds.append_run(run, to, replace=replace)
        console.print(f"{path} -> {where}", highlight=False, soft_wrap=True)


def _connect(dataset: Path):
    import duckdb

    if not tds.is_dataset(dataset):
        raise TraceError(dataset, "not a decodescope dataset (no runs/ partitions)")
    con = duckdb.connect()
    for name in TABLES:
        glob = (dataset / name).as_posix().replace("'", "''") + "/**/*.parquet"
        if (dataset / name).is_dir() and any((dataset / name).rglob("*.parquet")):
            con.execute(
                f"CREATE VIEW {name} AS SELECT * FROM read_parquet('{glob}', "
                "hive_partitioning = true, hive_types_autocast = false, union_by_name = true)"
            )
    return con


@app.command("query")
def query(
    dataset: Path = typer.Argument(..., help="results dataset folder"),
    sql: str = typer.Argument(
        ..., help="SQL over the views runs, kernels, ranges, memops, overheads"
    ),
    json_out: bool = typer.Option(False, "--json", help="print JSON rows instead of a table"),
    csv_out: bool = typer.Option(False, "--csv", help="print CSV (header + all rows) instead"),
    limit: int = typer.Option(200, "--limit", min=1, help="rows to print in the table"),
) -> None:
    """Run DuckDB SQL over a results dataset (views: runs, kernels, ranges, memops, overheads)."""
    import duckdb

    if json_out and csv_out:
        raise UsageError("--json and --csv: pick one")

    con = _connect(dataset)
    try:
        rel = con.sql(sql)
        if rel is None:  # a statement without rows (CREATE VIEW ...)
            return
        fetch = getattr(rel, "to_arrow_table", None) or rel.arrow
        result = fetch()
    except duckdb.Error as e:
        raise UsageError(f"query failed: {' '.join(str(e).split())}") from None
    if hasattr(result, "read_all"):  # a RecordBatchReader
        result = result.read_all()
    if json_out:
        typer.echo(dumps(result))
        return
    if csv_out:
        import io

        import pyarrow.csv as pacsv

        buf = io.BytesIO()
        pacsv.write_csv(result, buf)
        typer.echo(buf.getvalue().decode(), nl=False)
        return
    console.print(arrow_table(result, limit=limit))
