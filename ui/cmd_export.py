"""``decodescope export RUN... --to DATASET`` and ``decodescope query DATASET "SQL"``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import typer
from rich.markup import escape as rich_escape

from decodescope.analysis.schema import TABLES, Run
from decodescope.tracer import dataset as tds
from decodescope.tracer.errors import TraceError
from decodescope.ui.cli import UsageError, app, console, err_console
from decodescope.ui.cmd_import import load_with_progress
from decodescope.ui.render import arrow_table, dumps, progress, to_jsonable


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
    # all or nothing: a run that cannot be written takes the runs appended before it back out
    current: list[Run] = []
    try:
        with progress(err_console, f"appending {len(loaded)} run(s) to {to}"):
            wheres = tds.append_runs(loaded, to, replace=replace, on_run=current.append)
    except (OSError, pa.ArrowException) as e:
        rid = current[-1].run_id if current else "?"
        why = getattr(e, "strerror", None) or str(e)
        raise TraceError(to, f"cannot append run {rid}: {why}; nothing was exported") from None
    for path, where in zip(runs, wheres, strict=True):
        console.print(f"{path} -> {where}", highlight=False, soft_wrap=True)


def _connect(dataset: Path):
    """An in-memory DuckDB with a view per dataset table, then locked down: it reads files under
    ``dataset`` only and cannot change that (no COPY elsewhere, ATTACH, INSTALL, http)."""
    import duckdb

    if not tds.is_dataset(dataset):
        raise TraceError(dataset, "not a decodescope dataset (no runs/ partitions)")
    root = dataset.resolve()
    con = duckdb.connect()
    for name in TABLES:
        glob = (root / name).as_posix().replace("'", "''") + "/**/*.parquet"
        if (root / name).is_dir() and any((root / name).rglob("*.parquet")):
            try:
                con.execute(
                    f"CREATE VIEW {name} AS SELECT * FROM read_parquet('{glob}', "
                    "hive_partitioning = true, hive_types_autocast = false, union_by_name = true)"
                )
            except duckdb.Error as e:  # a damaged file: name it (DuckDB reads every footer here)
                raise _unreadable(root / name, e) from None
    con.execute("SET allowed_directories = ?", [[root.as_posix() + "/"]])
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")
    return con


def _unreadable(table_dir: Path, error: Exception) -> TraceError:
    """A one-line error naming the first Parquet file under ``table_dir`` that cannot be read
    (a truncated, empty or foreign file), else the table folder with DuckDB's message."""
    import pyarrow.parquet as pq

    for f in sorted(table_dir.rglob("*.parquet")):
        try:
            pq.read_metadata(f)
        except (pa.ArrowException, OSError) as e:
            return TraceError(f, f"not a readable Parquet file ({e})")
    return TraceError(table_dir, f"unreadable dataset table: {error}")


# Statements that only read: SELECT covers WITH, FROM, VALUES, DESCRIBE, SHOW and SUMMARIZE.
# EXPLAIN only plans; EXPLAIN ANALYZE runs the statement, so it is checked apart.
_READ_ONLY = ("SELECT", "EXPLAIN")
_EXPLAIN_ANALYZE = re.compile(r"\s*explain\s+analy[sz]e\s(.*)", re.IGNORECASE | re.DOTALL)


def _check_read_only(con, sql: str) -> None:
    """A one-line UsageError for any statement that is not a query (the dataset folder stays
    readable to DuckDB, so COPY ... TO there would otherwise write into it)."""
    for st in con.extract_statements(sql):
        kind = st.type.name
        if kind == "EXPLAIN" and re.search(r"\banaly[sz]e\b", st.query, re.IGNORECASE):
            kind = "EXPLAIN ANALYZE"  # runs the statement it explains: allowed for a SELECT
            inner = _EXPLAIN_ANALYZE.match(st.query)
            inner_kinds = [s.type.name for s in con.extract_statements(inner[1])] if inner else []
            if inner_kinds == ["SELECT"]:
                continue
        elif kind in _READ_ONLY:
            continue
        raise UsageError(
            f"query is read-only: {kind} statements are not allowed "
            "(SELECT, WITH, DESCRIBE, SHOW, SUMMARIZE and EXPLAIN are)"
        )


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
        _check_read_only(con, sql)
        rel = con.sql(sql)
        if rel is None:  # no statement (only comments): nothing to print
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
        pacsv.write_csv(_flat_for_csv(result), buf)
        typer.echo(buf.getvalue().decode(), nl=False)
        return
    # the header says the real column name, as --json and --csv do (the name to use in SQL);
    # a name the result repeats (SELECT 1 a, 2 a) gets a column key of its own
    names = result.column_names
    keys: list[str] = []
    taken = set(names)
    for c in names:
        k, n = c, 0
        while k in keys or (k != c and k in taken):
            n += 1
            k = f"{c}#{n}"
        taken.add(k)
        keys.append(k)
    headers = {k: rich_escape(c) for k, c in zip(keys, names, strict=True)}
    console.print(arrow_table(result.rename_columns(keys), limit=limit, headers=headers))


def _csv_writable(typ: pa.DataType) -> bool:
    """Types pyarrow's CSV writer takes as they are."""
    t = pa.types
    if t.is_dictionary(typ):
        return _csv_writable(typ.value_type)
    return any(
        f(typ)
        for f in (
            t.is_null, t.is_boolean, t.is_integer, t.is_floating, t.is_decimal, t.is_string,
            t.is_large_string, t.is_date, t.is_time, t.is_timestamp, t.is_duration,
        )
    )  # fmt: skip


def _flat_for_csv(table: pa.Table) -> pa.Table:
    """``table`` with each column the CSV writer cannot take (LIST, MAP, STRUCT, BLOB, INTERVAL,
    ...) as text: nested values as JSON (maps as objects), so that a row stays one CSV row."""
    for i, field in enumerate(table.schema):
        if _csv_writable(field.type):
            continue
        cells = []
        for v in table.column(i).to_pylist(maps_as_pydicts="lossy"):
            j = to_jsonable(v)
            cells.append(j if j is None or isinstance(j, str) else json.dumps(j, default=str))
        table = table.set_column(i, field.name, pa.array(cells, pa.string()))
    return table
