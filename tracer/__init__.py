"""Capture and import: everything that produces a run.

``load(path)`` reads a run folder, a Kineto / PyTorch-profiler JSON trace (``.json`` or
``.json.gz``) or an Nsight Systems SQLite export, recognised by content, or one run of a results
dataset as ``DATASET@RUN_ID`` (a unique prefix of the id will do), and returns a
:class:`~decodescope.analysis.schema.Run`. ``range(name)`` is the NVTX range API the workloads
use; it imports without CUPTI or a GPU.
"""

from __future__ import annotations

import os
from pathlib import Path

from decodescope.analysis.attribution import attribute
from decodescope.analysis.naming import Scheme
from decodescope.analysis.schema import Run
from decodescope.tracer.errors import TraceError
from decodescope.tracer.ranges import current_path, range
from decodescope.tracer.store import is_run_dir, read_run, write_run

__all__ = [
    "Run",
    "TraceError",
    "current_path",
    "dataset_ref",
    "detect",
    "drop_backwards",
    "load",
    "range",
    "read_run",
    "read_scheme",
    "write_run",
]

_GZIP = b"\x1f\x8b"
_SQLITE = b"SQLite format 3\x00"


def detect(path: str | os.PathLike[str]) -> str:
    """Name the format of ``path`` from its content: ``run``, ``kineto`` or ``nsys``."""
    p = Path(path)
    if not p.exists():
        raise TraceError(p, "no such file or directory")
    if not p.is_dir() and not p.is_file():
        # a pipe (``<(zcat t.json.gz)``), a device, a socket: reading its head here would use up
        # bytes the importer never sees, and a pipe nobody writes to would block for ever
        raise TraceError(
            p, "not a regular file (a pipe or a device): save the trace to a file and give that"
        )
    if p.is_dir():
        if is_run_dir(p):
            return "run"
        from decodescope.tracer.dataset import is_dataset

        if is_dataset(p):  # a results dataset holds many runs: name one
            raise TraceError(p, f"is a results dataset, not one run: name one as {p}@RUN_ID")
        hint = _traces_in(p)
        raise TraceError(
            p, "is a directory but not a decodescope run folder (no runs.parquet)" + hint
        )
    try:
        with open(p, "rb") as f:
            head = f.read(4096)  # JSON may open with whitespace
    except OSError as e:
        raise TraceError(p, f"cannot read: {e.strerror or e}") from None
    if not head:
        raise TraceError(p, "empty file")
    if head.startswith(_SQLITE):
        return "nsys"
    if head.startswith(_GZIP):
        return "kineto"
    stripped = head.lstrip(b"\xef\xbb\xbf \t\r\n")
    if stripped.startswith((b"{", b"[")):
        return "kineto"
    if p.suffix.lower() in (".nsys-rep", ".qdrep"):  # Nsight Systems' own report format
        raise TraceError(
            p,
            "an Nsight Systems report, which decodescope does not read: export it to SQLite "
            f"first (nsys export --type sqlite {p}) and give the .sqlite file",
        )
    raise TraceError(
        p,
        "unrecognised format: expected a Kineto JSON trace (.json/.json.gz), an Nsight Systems SQLite export or a run folder",
    )


_TRACE_SUFFIXES = (".json", ".json.gz", ".sqlite")


def _traces_in(folder: Path) -> str:
    """A hint naming the trace files in ``folder`` (a profiler's output folder, such as vLLM's
    VLLM_TORCH_PROFILER_DIR with one trace per rank), or "" where it holds none."""
    try:
        names = sorted(
            e.name for e in folder.iterdir() if e.name.endswith(_TRACE_SUFFIXES) and e.is_file()
        )
    except OSError:
        return ""
    if not names:
        return ""
    more = f" and {len(names) - 1} more" if len(names) > 1 else ""
    return f"; it holds {len(names)} trace file(s) ({names[0]}{more}): give one of them"


def dataset_ref(path: str | os.PathLike[str]) -> tuple[Path, str] | None:
    """``(dataset, run id)`` where ``path`` names no file but reads ``DATASET@RUN`` with a
    results dataset before the last ``@`` (``RUN``: a run id or a unique prefix of one);
    otherwise None. A run it cannot resolve is a one-line :class:`TraceError`."""
    text = os.fspath(path)
    if "@" not in text or Path(text).exists():
        return None
    from decodescope.tracer import dataset as tds

    root, want = text.rsplit("@", 1)
    ds = Path(root)
    if not tds.is_dataset(ds):
        return None
    ids = sorted(tds.run_ids(ds))
    if want in ids:
        return ds, want
    hits = [i for i in ids if i.startswith(want)] if want else []
    if len(hits) == 1:
        return ds, hits[0]
    if hits:
        raise TraceError(ds, f"run {want!r} is ambiguous: {len(hits)} runs start with it "
                             f"({', '.join(hits[:3])}{', ...' if len(hits) > 3 else ''})")  # fmt: skip
    raise TraceError(ds, f"no run {want!r} in this dataset ({len(ids)} runs)")


def load(path: str | os.PathLike[str], *, scheme: Scheme | None = None, **options) -> Run:
    """Load any supported trace or run folder as a :class:`Run` (format detected from content),
    or one run of a results dataset (``DATASET@RUN_ID``, :func:`dataset_ref`).

    Imported traces come back attributed (:func:`decodescope.analysis.attribution.attribute`)
    with ``scheme`` (default: ``analysis/naming.toml``); a run folder (or dataset run) keeps the
    range paths and steps it was written with, and gets layer, kind, block and op from them.
    An imported trace without a usable GPU kernel is a :class:`TraceError` saying so (and what
    was skipped): there is nothing to report.
    """
    ref = dataset_ref(path)
    if ref is not None:
        from decodescope.tracer import dataset as tds

        return attribute(tds.read_runs(ref[0], [ref[1]])[0], scheme)
    kind = detect(path)
    if kind == "run":
        # attribution fills only what is missing (a capture's range paths and steps are kept)
        return attribute(read_run(path), scheme)
    if kind == "kineto":
        from decodescope.tracer.kineto import load_kineto

        raw = load_kineto(path, **options)
    else:
        from decodescope.tracer.nsys import load_nsys

        raw = load_nsys(path, **options)
    raw = drop_backwards(raw)
    if raw.kernels.num_rows == 0:
        raise TraceError(path, _no_kernels(raw, kind))
    return attribute(raw, scheme)


def _no_kernels(run: Run, kind: str) -> str:
    """Why an imported trace gives no run: it holds no GPU kernel, or none that could be used
    (then how many were skipped, and why: nothing is dropped silently)."""
    skipped: dict[str, int] = {}
    o = run.overheads
    if o.num_rows:
        for r in o.select(["kind", "detail", "count"]).to_pylist():
            detail = r["detail"] or ""
            if r["kind"] == "skipped_events" and detail.startswith("kernel"):
                skipped[detail] = skipped.get(detail, 0) + int(r["count"] or 0)
    if skipped:
        n = sum(skipped.values())
        why = "; ".join(f"{c} {d}" for d, c in sorted(skipped.items(), key=lambda x: -x[1])[:3])
        return f"no usable GPU kernel: all {n} kernel record(s) were skipped ({why})"
    if kind == "nsys":
        return (
            "no GPU kernels: the kernel table (CUPTI_ACTIVITY_KIND_KERNEL) is empty "
            "(was the report captured with --trace=cuda while kernels ran?)"
        )
    return (
        "no GPU kernels: the trace holds no kernel events (cat 'kernel'); was it recorded with "
        "torch.profiler's ProfilerActivity.CUDA while kernels ran?"
    )


def drop_backwards(run: Run) -> Run:
    """The run without the kernels, memops and ranges that end before they start (a negative
    duration: a corrupt record that would count as a negative busy time and a negative minimum),
    each table's count kept as a ``skipped_events`` overheads row and in ``dropped_records``:
    nothing is dropped silently. Both importers read such records as they find them."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from decodescope.analysis.schema import from_pydict

    kept: dict[str, pa.Table] = {}
    rows: list[tuple[str, int]] = []
    for name, what in (("kernels", "kernel"), ("memops", "memop"), ("ranges", "range")):
        t = getattr(run, name)
        if t.num_rows == 0:
            continue
        back = pc.fill_null(pc.less(t["end_ns"], t["start_ns"]), False)
        n = int(pc.sum(back).as_py() or 0)
        if n:
            kept[name] = t.filter(pc.invert(back))
            rows.append((f"{what}: ends before it starts (negative duration)", n))
    if not rows:
        return run
    extra = from_pydict(
        {
            "run_id": [run.run_id] * len(rows),
            "rank": [0] * len(rows),
            "kind": ["skipped_events"] * len(rows),
            "count": [n for _, n in rows],
            "detail": [why for why, _ in rows],
        },
        "overheads",
    )
    dropped = (run.meta.dropped_records or 0) + sum(n for _, n in rows)
    return run.replace(
        meta=run.meta.replace(dropped_records=dropped),
        overheads=pa.concat_tables([run.overheads, extra]),
        **kept,
    )


def read_scheme(path: str | os.PathLike[str]) -> Scheme:
    """A naming scheme from a TOML file (format: ``analysis/naming.toml``)."""
    p = Path(path)
    try:
        text = p.read_text("utf-8")
    except FileNotFoundError:
        raise TraceError(p, "no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise TraceError(p, f"cannot read naming scheme: {e}") from None
    try:
        return Scheme.from_toml(text)
    except ValueError as e:
        raise TraceError(p, str(e)) from None
