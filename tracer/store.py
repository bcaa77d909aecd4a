"""A run on disk: a folder of Parquet files, one per table, written whole or not at all."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
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
    """Write ``run`` as a folder ``out``: into a temporary sibling first, renamed when complete.

    With ``overwrite`` an existing ``out`` is replaced only when it is a run folder or an empty
    folder; anything else (a file, a folder of other things) is refused, never deleted. The folder
    gets the usual mode for new folders (``0o777`` less the umask). Every failure is a
    :class:`TraceError` naming ``out``; nothing is left behind, and a run being replaced stays
    in place until the new one is complete.
    """
    out = Path(out)
    dest = Path(os.path.abspath(out))  # "." or "x/.." have no name to put a sibling beside
    if os.path.lexists(dest):
        if not overwrite:
            raise TraceError(out, "already exists (pass --overwrite to replace it)")
        why_not = why_not_replaceable(dest)
        if why_not:
            raise TraceError(
                out, f"{why_not}; --overwrite only replaces a run folder or an empty folder"
            )
    made = _make_parents(out, dest.parent)
    try:
        tmp = _make_sibling(out, dest, "tmp")
        try:
            for name, table in run.tables().items():
                pq.write_table(table, tmp / RUN_FILES[name], compression="zstd")
            _move_into_place(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    except OSError as e:
        _remove_empty(made)
        raise TraceError(out, f"cannot write the run folder: {e.strerror or e}") from None
    except BaseException:
        _remove_empty(made)
        raise
    return out


def why_not_replaceable(p: Path) -> str | None:
    """Why ``p`` must not be replaced by a run, or ``None`` for a run folder or an empty folder."""
    if p.is_symlink():
        return "is a symbolic link, not a run folder"
    if not p.is_dir():
        return "is a file, not a run folder"
    try:
        entries = list(p.iterdir())
    except OSError as e:
        return f"cannot be listed ({e.strerror or e})"
    if not entries:
        return None
    if not is_run_dir(p):
        return f"is a folder that is not a decodescope run folder (no {RUN_FILES['runs']})"
    dirs = sorted(e.name for e in entries if e.is_dir())
    if dirs:
        return f"holds {dirs[0]}/, which no run folder has"
    try:
        names = pq.read_schema(p / RUN_FILES["runs"]).names
    except (pa.ArrowException, OSError):
        names = []
    if "run_id" not in names:
        return f"has a {RUN_FILES['runs']} that is not a decodescope runs table"
    return None


def _make_parents(out: Path, parent: Path) -> list[Path]:
    """Create ``parent`` and the folders above it that are missing; the ones made, deepest first."""
    missing = []
    d = parent
    while not os.path.lexists(d) and d != d.parent:
        missing.append(d)
        d = d.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        _remove_empty(missing)
        if isinstance(e, FileExistsError):
            raise TraceError(out, f"{parent} is a file, not a folder") from None
        raise TraceError(out, f"cannot create the folder {parent}: {e.strerror or e}") from None
    return missing


def _make_sibling(out: Path, dest: Path, kind: str) -> Path:
    """A new, unused name beside ``dest``; created as an empty folder when ``kind`` is "tmp".

    ``os.mkdir`` (unlike ``tempfile.mkdtemp``, whose folders are 0700) applies the umask.
    """
    for _ in range(100):
        p = dest.parent / f".{dest.name}.{secrets.token_hex(4)}.{kind}"
        if kind != "tmp":
            if not os.path.lexists(p):
                return p
            continue
        try:
            os.mkdir(p)
        except FileExistsError:
            continue
        except OSError as e:
            raise TraceError(out, f"cannot write into {dest.parent}: {e.strerror or e}") from None
        return p
    raise TraceError(out, f"cannot find an unused temporary name in {dest.parent}")


def _move_into_place(tmp: Path, dest: Path) -> None:
    """Rename ``tmp`` to ``dest``; an existing ``dest`` is moved aside first and removed after."""
    if not os.path.lexists(dest):
        os.replace(tmp, dest)
        return
    old = _make_sibling(dest, dest, "old")
    os.replace(dest, old)
    try:
        os.replace(tmp, dest)
    except BaseException:
        os.replace(old, dest)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _remove_empty(folders: list[Path]) -> None:
    for d in folders:
        with contextlib.suppress(OSError):
            d.rmdir()


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
