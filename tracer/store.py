"""A run on disk: a folder of Parquet files, one per table, written whole or not at all."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from decodescope.analysis.schema import SCHEMA_VERSION, TABLES, Run, RunMeta, SchemaError, conform
from decodescope.tracer.errors import TraceError

RUN_FILES = {name: f"{name}.parquet" for name in TABLES}


def is_run_dir(path: str | os.PathLike[str]) -> bool:
    p = Path(path)
    return p.is_dir() and (p / RUN_FILES["runs"]).is_file()


def write_run(run: Run, out: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
    """Write ``run`` as a folder ``out``: into a temporary sibling first, renamed when complete."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise TraceError(out, "already exists (pass overwrite to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        for name, table in run.tables().items():
            pq.write_table(table, tmp / RUN_FILES[name], compression="zstd")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def read_run(path: str | os.PathLike[str]) -> Run:
    """Read a run folder written by :func:`write_run`."""
    p = Path(path)
    if not is_run_dir(p):
        raise TraceError(p, f"not a decodescope run folder (no {RUN_FILES['runs']})")
    tables: dict[str, pa.Table] = {}
    for name, fname in RUN_FILES.items():
        f = p / fname
        if not f.is_file():
            raise TraceError(p, f"run folder lacks {fname}")
        try:
            t = pq.read_table(f)
        except (pa.ArrowException, OSError) as e:
            raise TraceError(f, f"unreadable Parquet: {e}") from None
        version = (t.schema.metadata or {}).get(b"decodescope.schema_version")
        if version is not None and int(version) > SCHEMA_VERSION:
            raise TraceError(
                f,
                f"schema version {int(version)} is newer than this decodescope's {SCHEMA_VERSION}",
            )
        try:
            tables[name] = conform(t, name)
        except SchemaError as e:
            raise TraceError(f, str(e)) from None
    try:
        meta = RunMeta.from_table(tables["runs"])
    except SchemaError as e:
        raise TraceError(p / RUN_FILES["runs"], str(e)) from None
    return Run(
        meta=meta,
        kernels=tables["kernels"],
        ranges=tables["ranges"],
        memops=tables["memops"],
        overheads=tables["overheads"],
    )
