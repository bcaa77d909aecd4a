"""Results datasets on disk: append runs as Hive partitions, read them back (layout:
:mod:`decodescope.analysis.dataset`)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from decodescope.analysis import dataset as layout
from decodescope.analysis.schema import TABLES, Run, RunMeta, SchemaError, conform
from decodescope.tracer.errors import TraceError

__all__ = ["append_run", "append_runs", "is_dataset", "read_table", "read_runs", "run_ids"]


def is_dataset(path: str | os.PathLike[str]) -> bool:
    """A folder holding ``runs/`` with at least one partition file."""
    p = Path(path)
    return p.is_dir() and (p / "runs").is_dir() and any((p / "runs").rglob("*.parquet"))


def _run_dirs(root: Path, meta: RunMeta) -> dict[str, Path]:
    rel = layout.partition_path(meta)
    return {name: root / name / rel for name in TABLES}


def run_ids(path: str | os.PathLike[str]) -> set[str]:
    root = Path(path)
    out: set[str] = set()
    for f in (
        (root / "runs").rglob(f"run_id=*/{layout.PART_FILE}") if (root / "runs").is_dir() else []
    ):
        rid = layout.decode_value(f.parent.name.split("=", 1)[1])
        if rid is not None:
            out.add(rid)
    return out


def _check_root(root: Path) -> None:
    if root.exists() and not root.is_dir():
        raise TraceError(root, "exists and is not a folder: a dataset is a folder")
    if root.is_dir() and any(root.iterdir()) and not (root / "runs").is_dir():
        raise TraceError(root, "is a non-empty folder but not a decodescope dataset (no runs/)")


def _partitions_of(root: Path, run_id: str) -> list[Path]:
    """Every partition folder of ``run_id`` in every table, wherever its gpu, preset and backend
    placed it (a run re-exported with other metadata lives under other partition values)."""
    out = []
    for name in TABLES:
        sub = root / name
        if not sub.is_dir():
            continue
        for p in sub.glob("*/*/*/run_id=*"):
            if p.is_dir() and layout.decode_value(p.name.split("=", 1)[1]) == run_id:
                out.append(p)
    return out


class _Append:
    """Appends runs all or nothing: each table is written to a temporary name and renamed; a
    replaced run's folders are moved aside (``DATASET/.replaced-*``, which no reader sees) and
    dropped only once every run is in; on failure what was written goes, what was moved aside
    comes back, and folders this append made and left empty are removed."""

    def __init__(self, root: Path, replace: bool) -> None:
        _check_root(root)
        self.root, self.replace = root, replace
        self.made_root = not root.exists()
        self.written: list[Path] = []
        self.parents: list[Path] = []  # the folders partitions went into (made here, maybe)
        self.moved: list[tuple[Path, Path]] = []  # (where it was, where it went)
        self.aside: Path | None = None

    def add(self, run: Run) -> Path:
        root = self.root
        dirs = _run_dirs(root, run.meta)
        old = _partitions_of(root, run.run_id)
        if old and not self.replace and any(p.is_relative_to(root / "runs") for p in old):
            raise TraceError(root, f"already holds run {run.run_id!r} (pass replace to overwrite)")
        for p in old:
            if self.aside is None:
                self.aside = Path(tempfile.mkdtemp(prefix=".replaced-", dir=root))
            dest = self.aside / str(len(self.moved))
            os.replace(p, dest)
            self.moved.append((p, dest))
        tables = run.tables()
        for name in ["kernels", "ranges", "memops", "overheads", "runs"]:  # runs last
            target = dirs[name]
            self.parents.append(target.parent)
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
            try:
                t = layout.strip_partitions(tables[name])
                pq.write_table(t, tmp / layout.PART_FILE, compression="zstd")
                os.replace(tmp, target)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            self.written.append(target)
        return dirs["runs"]

    def commit(self) -> None:
        if self.aside is not None:
            shutil.rmtree(self.aside, ignore_errors=True)
        for was, _ in self.moved:  # a replaced run's partition folders, if now empty
            self._prune(was.parent)

    def rollback(self) -> None:
        for d in reversed(self.written):
            shutil.rmtree(d, ignore_errors=True)
        for was, now in reversed(self.moved):
            with contextlib.suppress(OSError):
                was.parent.mkdir(parents=True, exist_ok=True)
                os.replace(now, was)
        if self.aside is not None:
            shutil.rmtree(self.aside, ignore_errors=True)
        for d in self.parents:  # the partition folders this append made, now empty
            self._prune(d)
        if self.made_root:
            self._prune(self.root / "runs")
            for name in TABLES:
                with contextlib.suppress(OSError):
                    (self.root / name).rmdir()
            with contextlib.suppress(OSError):
                self.root.rmdir()

    def _prune(self, d: Path) -> None:
        while d != self.root and self.root in d.parents:
            try:
                d.rmdir()
            except OSError:
                return
            d = d.parent


def append_run(run: Run, dataset: str | os.PathLike[str], *, replace: bool = False) -> Path:
    """Append one run: each table into its partition folder (temporary name, then renamed);
    ``runs`` last, so a run is listed only once all its tables are there. ``replace`` swaps out
    the run of the same id wherever it lies. On failure nothing of this run is left behind, and
    a run it was replacing is back as it was."""
    return append_runs([run], dataset, replace=replace)[0]


def append_runs(
    runs: Iterable[Run],
    dataset: str | os.PathLike[str],
    *,
    replace: bool = False,
    on_run: Callable[[Run], object] | None = None,
) -> list[Path]:
    """Append runs all or nothing (as :func:`append_run` each; ``on_run`` is called with each
    run before it is written): on failure the runs appended before the one that failed are
    removed again and the dataset is as it was."""
    job = _Append(Path(dataset), replace)
    out = []
    try:
        for r in runs:
            if on_run is not None:
                on_run(r)
            out.append(job.add(r))
    except BaseException:
        job.rollback()
        raise
    job.commit()
    return out


def _partitioning() -> ds.Partitioning:
    fields = [pa.field(k, pa.string()) for k in layout.PARTITIONS]
    return ds.HivePartitioning(pa.schema(fields), null_fallback=layout.NULL_PARTITION)


def read_table(
    path: str | os.PathLike[str], table: str, run_ids: Sequence[str] | None = None
) -> pa.Table:
    """One table of the dataset, partition columns restored, conformed to the run schema.
    ``run_ids`` limits it to those runs."""
    root = Path(path)
    if not is_dataset(root):
        raise TraceError(root, "not a decodescope dataset (no runs/ partitions)")
    if table not in TABLES:
        raise ValueError(f"unknown table {table!r}")
    sub = root / table
    if not sub.is_dir():
        return TABLES[table].empty_table()
    try:
        d = ds.dataset(
            sub,
            format="parquet",
            partitioning=_partitioning(),
            schema=_read_schema(table),
            exclude_invalid_files=False,
            ignore_prefixes=[".", "_"],
        )
        flt = None
        if run_ids is not None:
            flt = pc.field("run_id").isin(list(run_ids))
        t = d.to_table(filter=flt)
    except (pa.ArrowException, OSError) as e:
        raise TraceError(sub, f"unreadable dataset table: {e}") from None
    keep = [c for c in t.column_names if c in TABLES[table].names]
    try:
        return conform(t.select(keep), table)
    except SchemaError as e:
        raise TraceError(sub, str(e)) from None


def _read_schema(table: str) -> pa.Schema:
    """The file schema plus the partition columns, as plain strings."""
    fs = layout.file_schema(table)
    fields = list(fs)
    fields += [pa.field(k, pa.string()) for k in layout.PARTITIONS]
    return pa.schema(fields)


def _rows_by_run(t: pa.Table) -> dict[str, np.ndarray]:
    """Each run id's row indices in ``t``, in the table's order: one pass over the column (a
    filter per run would read the whole table once per run)."""
    if t.num_rows == 0:
        return {}
    enc = t["run_id"].cast(pa.string()).combine_chunks().dictionary_encode()
    codes = enc.indices.to_numpy(zero_copy_only=False)
    order = np.argsort(codes, kind="stable")
    bounds = np.concatenate(([0], np.cumsum(np.bincount(codes, minlength=len(enc.dictionary)))))
    return {rid: order[bounds[i]:bounds[i + 1]]
            for i, rid in enumerate(enc.dictionary.to_pylist())}  # fmt: skip


def _take(t: pa.Table, idx: np.ndarray | None) -> pa.Table:
    return t.slice(0, 0) if idx is None else t.take(idx)


def read_runs(path: str | os.PathLike[str], run_ids: Sequence[str] | None = None) -> list[Run]:
    """Whole runs from a dataset (all of them, or those of ``run_ids``)."""
    tables = {name: read_table(path, name, run_ids) for name in TABLES}
    runs_t = tables["runs"]
    # one chunk per column: ``take`` on a table of one chunk per file resolves chunks per row
    tables = {name: t.combine_chunks() for name, t in tables.items()}
    rows = {name: _rows_by_run(t) for name, t in tables.items()}
    out = []
    for rid in runs_t["run_id"].cast(pa.string()).to_pylist():
        sel = {name: _take(t, rows[name].get(rid)) for name, t in tables.items()}
        meta = RunMeta.from_table(sel["runs"])
        out.append(
            Run(
                meta=meta,
                kernels=sel["kernels"],
                ranges=sel["ranges"],
                memops=sel["memops"],
                overheads=sel["overheads"],
            )
        )
    return out
