"""Bad input: every failure is one clean TraceError (one line, naming the file), and through the
CLI exit code 2, one line on stderr, no traceback, no output folder left behind.

The property-based tests start from real traces (a slice of a real Kineto trace, a real Nsight
Systems export) and mutate them: truncate, flip bytes, delete keys, change the types of fields.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import random
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decodescope import tracer
from decodescope.tracer.errors import TraceError
from decodescope.tracer.kineto import KERNEL_CATS, load_kineto

TRACES = Path(__file__).parent / "data" / "traces"
KINETO_GZ = TRACES / "kineto_b200_vllm_tp8_rank0_prefill_eager__TraceLens.json.gz"
NSYS_SMALL = TRACES / "nsys_rtx3080_tiny_full_schema3.24__nsys-ai_mock.sqlite"


# ---------------------------------------------------------------------------------------------
# the bad files


def _empty(d: Path) -> Path:
    p = d / "empty.json"
    p.write_bytes(b"")
    return p


def _truncated_gzip(d: Path) -> Path:
    data = KINETO_GZ.read_bytes()
    p = d / "truncated.json.gz"
    p.write_bytes(data[: len(data) // 2])
    return p


def _json_cut_in_half(d: Path) -> Path:
    text = gzip.decompress(KINETO_GZ.read_bytes())
    p = d / "half.json"
    p.write_bytes(text[: len(text) // 2])
    return p


def _json_object_not_a_trace(d: Path) -> Path:
    p = d / "object.json"
    p.write_text('{"a": 1}')
    return p


def _json_list_of_numbers(d: Path) -> Path:
    p = d / "numbers.json"
    p.write_text("[1, 2, 3]")
    return p


def _trace_events_not_a_list(d: Path) -> Path:
    p = d / "events.json"
    p.write_text('{"traceEvents": 5}')
    return p


def _random_bytes(d: Path) -> Path:
    p = d / "random.bin"
    p.write_bytes(random.Random(0).randbytes(4096))
    return p


def _random_bytes_behind_gzip_magic(d: Path) -> Path:
    p = d / "random.json.gz"
    p.write_bytes(b"\x1f\x8b\x08\x00" + random.Random(1).randbytes(4096))
    return p


def _gzip_of_random_bytes(d: Path) -> Path:
    p = d / "garbage.json.gz"
    p.write_bytes(gzip.compress(random.Random(2).randbytes(4096)))
    return p


def _sqlite_without_kernel_tables(d: Path) -> Path:
    p = d / "other.sqlite"
    con = sqlite3.connect(p)
    con.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, text TEXT)")
    con.execute("INSERT INTO notes (text) VALUES ('not an nsys export')")
    con.commit()
    con.close()
    return p


def _nsys_report(d: Path) -> Path:
    """Synthetic: Nsight Systems' own report format, which only ``nsys export`` reads (no real
    one among the traces: its bytes here are random, the name is what a user hands over)."""
    p = d / "profile.nsys-rep"
    p.write_bytes(b"\x00\x01NSYS" + random.Random(3).randbytes(4096))
    return p


def _directory(d: Path) -> Path:
    p = d / "a_folder"
    p.mkdir()
    (p / "something.txt").write_text("hello")
    return p


def _missing(d: Path) -> Path:
    return d / "does_not_exist.json"


def _kineto_without_kernels(d: Path) -> Path:
    """The real vLLM trace with its kernel events taken out: CPU ops, launches, memcpys left."""
    trace = json.loads(gzip.decompress(KINETO_GZ.read_bytes()))
    trace["traceEvents"] = [e for e in trace["traceEvents"] if e.get("cat") not in KERNEL_CATS]
    p = d / "no_kernels.json"
    p.write_text(json.dumps(trace))
    return p


def _kineto_every_kernel_unusable(d: Path) -> Path:
    """The real vLLM trace with a ``ts`` no kernel can have ("NaN") on every kernel event."""
    trace = json.loads(gzip.decompress(KINETO_GZ.read_bytes()))
    for e in trace["traceEvents"]:
        if e.get("cat") in KERNEL_CATS:
            e["ts"] = "NaN"
    p = d / "bad_kernels.json"
    p.write_text(json.dumps(trace))
    return p


def _nsys_empty_kernel_table(d: Path) -> Path:
    """The real RTX 3080 export with its kernel table emptied (ranges, memcpys, overheads kept)."""
    p = d / "no_kernels.sqlite"
    shutil.copyfile(NSYS_SMALL, p)
    os.chmod(p, 0o644)
    con = sqlite3.connect(p)
    con.execute("DELETE FROM CUPTI_ACTIVITY_KIND_KERNEL")
    con.commit()
    con.close()
    return p


def _named_pipe(d: Path) -> Path:
    """Synthetic: a FIFO nobody writes to (what ``<(zcat t.json.gz)`` hands over is a pipe too);
    reading it would block for ever."""
    p = d / "pipe.json"
    os.mkfifo(p)
    return p


BAD: dict[str, Callable[[Path], Path]] = {
    "empty file": _empty,
    "truncated gzip": _truncated_gzip,
    "JSON cut in half": _json_cut_in_half,
    "JSON object that is not a trace": _json_object_not_a_trace,
    "JSON list of numbers": _json_list_of_numbers,
    "traceEvents not a list": _trace_events_not_a_list,
    "random bytes": _random_bytes,
    "random bytes behind a gzip header": _random_bytes_behind_gzip_magic,
    "gzip of random bytes": _gzip_of_random_bytes,
    "SQLite without kernel tables": _sqlite_without_kernel_tables,
    "Nsight Systems report not exported": _nsys_report,
    "directory": _directory,
    "missing file": _missing,
    "Kineto trace without GPU kernels": _kineto_without_kernels,
    "Kineto trace whose every kernel is unusable": _kineto_every_kernel_unusable,
    "nsys export with an empty kernel table": _nsys_empty_kernel_table,
    "named pipe": _named_pipe,
}
# the raw importers return these as runs without kernels; tracer.load (and the CLI) refuse them
NO_KERNELS = (
    "Kineto trace without GPU kernels",
    "Kineto trace whose every kernel is unusable",
    "nsys export with an empty kernel table",
)


def _assert_clean(err: TraceError, path: Path) -> None:
    msg = str(err)
    assert "\n" not in msg
    assert str(path) in msg
    assert len(msg) > len(str(path)) + 5  # it says what is wrong, too


@pytest.mark.parametrize("case", list(BAD))
def test_load_raises_one_line_trace_error(case: str, tmp_path: Path) -> None:
    path = BAD[case](tmp_path)
    with pytest.raises(TraceError) as info:
        tracer.load(path)
    _assert_clean(info.value, path)


@pytest.mark.parametrize(
    "case",
    [c for c in BAD if c not in ("SQLite without kernel tables", *NO_KERNELS)],
)
def test_load_kineto_raises_one_line_trace_error(case: str, tmp_path: Path) -> None:
    path = BAD[case](tmp_path)
    with pytest.raises(TraceError) as info:
        load_kineto(path)
    _assert_clean(info.value, path)


def test_messages_say_what_is_wrong(tmp_path: Path) -> None:
    def problem(case: str) -> str:
        with pytest.raises(TraceError) as info:
            tracer.load(BAD[case](tmp_path / case.replace(" ", "_")))
        return info.value.problem

    for case in BAD:
        (tmp_path / case.replace(" ", "_")).mkdir()
    assert "empty" in problem("empty file")
    assert "gzip" in problem("truncated gzip")
    assert "JSON" in problem("JSON cut in half")
    assert "traceEvents" in problem("JSON object that is not a trace")
    assert "no such file" in problem("missing file")
    assert "directory" in problem("directory")
    assert "nsys export --type sqlite" in problem("Nsight Systems report not exported")
    assert "no GPU kernels" in problem("Kineto trace without GPU kernels")
    assert "no GPU kernels" in problem("nsys export with an empty kernel table")
    # what was skipped is counted in the message: nothing is dropped silently
    unusable = problem("Kineto trace whose every kernel is unusable")
    assert "all 768 kernel record(s) were skipped" in unusable and "bad ts or dur" in unusable
    assert "not a regular file" in problem("named pipe")


# ---------------------------------------------------------------------------------------------
# through the CLI: `decodescope import BAD --out DIR`


def _cli(*args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "decodescope"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "decodescope.ui.cli"]
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=120, env=env)


def _run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    from decodescope.ui.cli import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    return info.value.code, capsys.readouterr().err


@pytest.mark.parametrize("case", list(BAD))
def test_cli_import_fails_cleanly(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = BAD[case](tmp_path)
    out = tmp_path / "out" / "run"
    code, err = _run_main(["import", str(path), "--out", str(out)], capsys)
    assert code == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert path.name in lines[0]
    assert not out.exists()
    leftovers = list((tmp_path / "out").iterdir()) if (tmp_path / "out").exists() else []
    assert leftovers == [], leftovers


def test_a_folder_of_traces_names_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A profiler's output folder (vLLM writes one trace per rank into VLLM_TORCH_PROFILER_DIR)
    handed over whole: one line that names a trace in it to give instead; nothing written."""
    folder = tmp_path / "profiles"
    folder.mkdir()
    shutil.copyfile(KINETO_GZ, folder / "rank0.pt.trace.json.gz")
    shutil.copyfile(HF_QWEN, folder / "rank1.pt.trace.json.gz")
    out = tmp_path / "out"
    code, err = _run_main(["import", str(folder), "--out", str(out)], capsys)
    line = _one_error_line(code, err, folder)
    assert "2 trace file(s) (rank0.pt.trace.json.gz and 1 more): give one of them" in line
    assert not out.exists()


@pytest.mark.parametrize("case", [*NO_KERNELS, "named pipe"])
def test_cli_report_fails_cleanly(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``report`` on a trace without a usable GPU kernel (or on a pipe): one line, exit 2, and no
    empty tables."""
    path = BAD[case](tmp_path)
    code, err = _run_main(["report", str(path)], capsys)
    assert code == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and path.name in lines[0] and "Traceback" not in err, err


@pytest.mark.parametrize("case", ["JSON cut in half", "SQLite without kernel tables"])
def test_cli_binary_fails_cleanly(case: str, tmp_path: Path) -> None:
    """The installed console script itself: exit 2, one stderr line, no traceback."""
    path = BAD[case](tmp_path)
    out = tmp_path / "run"
    proc = _cli("import", str(path), "--out", str(out))
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert str(path) in lines[0]
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


# ---------------------------------------------------------------------------------------------
# property-based: mutations of real traces fail only with TraceError


def _kineto_slice() -> dict:
    """A small slice of a real Kineto trace (vLLM on B200): every category it holds, up to 40
    events each, with the trace's own metadata (deviceProperties, distributedInfo, base time)."""
    full = json.loads(gzip.decompress(KINETO_GZ.read_bytes()))
    seen: dict = {}
    keep = []
    for e in full["traceEvents"]:
        k = e.get("cat")
        if seen.get(k, 0) < 40:
            seen[k] = seen.get(k, 0) + 1
            keep.append(e)
    out = {k: v for k, v in full.items() if k != "traceEvents"}
    out["traceEvents"] = keep
    return out


SLICE = _kineto_slice()
SLICE_BYTES = json.dumps(SLICE).encode()
SLICE_GZ = gzip.compress(SLICE_BYTES, mtime=0)
# the same text as two gzip members one after the other (what `cat a.gz b.gz` makes)
SLICE_GZ2 = gzip.compress(SLICE_BYTES[:5000], mtime=0) + gzip.compress(SLICE_BYTES[5000:], mtime=0)

# CI runs 40 fixed examples per property (deterministic, fast on 2 cores); a longer random search:
# DECODESCOPE_FUZZ_EXAMPLES=2000 pytest tests/test_bad_input.py
_FUZZ = int(os.environ.get("DECODESCOPE_FUZZ_EXAMPLES", "0"))
PROPERTY = settings(
    max_examples=_FUZZ or 40,
    deadline=None,
    derandomize=not _FUZZ,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# values of every JSON type, including ones no field of a trace should hold
ODD_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
    st.lists(st.integers(), max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=3),
)
KEYS = ["ph", "cat", "name", "pid", "tid", "ts", "dur", "args", "id"]
ARG_KEYS = [
    "correlation",
    "stream",
    "device",
    "grid",
    "block",
    "registers per thread",
    "shared memory",
    "bytes",
]


def _load_bytes(data: bytes, suffix: str = ".json"):
    """Load ``data`` as a file through tracer.load and through load_kineto; only TraceError may
    escape; returns the raw run or None."""
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / f"trace{suffix}"
        p.write_bytes(data)
        raw = None
        try:
            raw = load_kineto(p)
        except TraceError as e:
            _assert_clean(e, p)
        try:
            tracer.load(p)
        except TraceError as e:
            _assert_clean(e, p)
        return raw


def test_the_slice_itself_loads() -> None:
    run = _load_bytes(SLICE_BYTES)
    assert run is not None and run.kernels.num_rows == 40


@PROPERTY
@given(cut=st.integers(min_value=0, max_value=len(SLICE_BYTES) - 1))
def test_kineto_truncated_anywhere(cut: int) -> None:
    _load_bytes(SLICE_BYTES[:cut])


@PROPERTY
@given(data=st.sampled_from([SLICE_GZ, SLICE_GZ2]), where=st.floats(0, 1, exclude_max=True))
def test_kineto_gzip_truncated_anywhere(data: bytes, where: float) -> None:
    _load_bytes(data[: int(where * len(data))], ".json.gz")


def test_kineto_two_gzip_members_load() -> None:
    run = _load_bytes(SLICE_GZ2, ".json.gz")
    assert run is not None and run.kernels.num_rows == 40


@PROPERTY
@given(
    flips=st.lists(
        st.tuples(st.integers(0, len(SLICE_BYTES) - 1), st.integers(0, 255)), min_size=1, max_size=8
    )
)
def test_kineto_bytes_flipped(flips: list[tuple[int, int]]) -> None:
    data = bytearray(SLICE_BYTES)
    for pos, value in flips:
        data[pos] = value
    _load_bytes(bytes(data))


@PROPERTY
@given(
    gz=st.sampled_from([SLICE_GZ, SLICE_GZ2]),
    flips=st.lists(
        st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), min_size=1, max_size=4
    ),
)
def test_kineto_gzip_bytes_flipped(gz: bytes, flips: list[tuple[float, int]]) -> None:
    data = bytearray(gz)
    for where, value in flips:
        data[int(where * len(data))] = value
    _load_bytes(bytes(data), ".json.gz")


_EVENT = st.integers(min_value=0, max_value=len(SLICE["traceEvents"]) - 1)


@PROPERTY
@given(
    edits=st.lists(
        st.tuples(
            _EVENT,
            st.sampled_from(KEYS + [f"args.{k}" for k in ARG_KEYS]),
            st.booleans(),
            ODD_VALUES,
        ),
        min_size=1,
        max_size=12,
    )
)
def test_kineto_keys_deleted_or_retyped(edits: list) -> None:
    """Delete keys of events (or of their args) or give them values of another type: the trace
    loads or fails with TraceError, and no kernel event disappears without being counted."""
    trace = json.loads(SLICE_BYTES)
    events = trace["traceEvents"]
    for i, key, delete, value in edits:
        target = events[i]
        if key.startswith("args."):
            target = target.get("args")
            key = key[5:]
            if not isinstance(target, dict):
                continue
        if delete:
            target.pop(key, None)
        else:
            target[key] = value
    run = _load_bytes(json.dumps(trace).encode())
    if run is None:
        return
    kernel_events = sum(
        1
        for e in events
        if isinstance(e, dict) and isinstance(e.get("cat"), str) and e["cat"] in KERNEL_CATS
    )
    skipped = sum(
        r["count"]
        for r in run.overheads.to_pylist()
        if r["kind"] == "skipped_events" and r["detail"].startswith("kernel")
    )
    assert run.kernels.num_rows + skipped == kernel_events


@PROPERTY
@given(
    top=st.sampled_from(
        [
            "traceEvents",
            "deviceProperties",
            "distributedInfo",
            "baseTimeNanoseconds",
            "schemaVersion",
        ]
    ),
    value=ODD_VALUES,
    event=st.one_of(st.none(), ODD_VALUES),
)
def test_kineto_top_level_retyped(top: str, value, event) -> None:
    trace = json.loads(SLICE_BYTES)
    trace[top] = value
    if event is not None and isinstance(trace.get("traceEvents"), list):
        trace["traceEvents"].insert(3, event)  # an event that is not an object
    _load_bytes(json.dumps(trace).encode())


# ---------------------------------------------------------------------------------------------
# nsys mutations (the loader is tracer/nsys.py; run with: pytest tests/test_bad_input.py -k nsys)

NSYS_BYTES = NSYS_SMALL.read_bytes()


def _nsys_tables() -> list[tuple[str, list[str]]]:
    con = sqlite3.connect(f"file:{NSYS_SMALL}?mode=ro", uri=True)
    try:
        names = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        return [(t, [r[1] for r in con.execute(f'PRAGMA table_info("{t}")')]) for t in names]
    finally:
        con.close()


NSYS_TABLES = _nsys_tables()


def _load_sqlite(
    data: bytes | None = None, mutate: Callable[[sqlite3.Connection], None] | None = None
) -> None:
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "export.sqlite"
        if data is not None:
            p.write_bytes(data)
        else:
            shutil.copyfile(NSYS_SMALL, p)
            os.chmod(p, 0o644)
        if mutate is not None:
            con = sqlite3.connect(p)
            try:
                # what SQLite itself refuses (a key column, NOT NULL, INTEGER PRIMARY KEY) is skipped
                with contextlib.suppress(sqlite3.IntegrityError, sqlite3.OperationalError):
                    mutate(con)
                con.commit()
            finally:
                con.close()
        try:
            tracer.load(p)
        except TraceError as e:
            _assert_clean(e, p)


@PROPERTY
@given(cut=st.integers(min_value=1, max_value=len(NSYS_BYTES) - 1))
def test_nsys_truncated_anywhere(cut: int) -> None:
    _load_sqlite(NSYS_BYTES[:cut])


@PROPERTY
@given(
    flips=st.lists(
        st.tuples(st.integers(100, len(NSYS_BYTES) - 1), st.integers(0, 255)),
        min_size=1,
        max_size=16,
    )
)
def test_nsys_bytes_flipped(flips: list[tuple[int, int]]) -> None:
    data = bytearray(NSYS_BYTES)
    for pos, value in flips:
        data[pos] = value
    _load_sqlite(bytes(data))


@PROPERTY
@given(
    table=st.sampled_from(range(len(NSYS_TABLES))),
    action=st.sampled_from(["drop_table", "drop_column", "retype", "null", "delete_rows"]),
    column=st.integers(min_value=0, max_value=50),
    value=st.one_of(
        st.none(),
        st.integers(-(2**63), 2**63 - 1),
        st.floats(allow_nan=False),
        st.text(max_size=8),
        st.binary(max_size=8),
    ),
)
def test_nsys_tables_dropped_or_retyped(table: int, action: str, column: int, value) -> None:
    name, cols = NSYS_TABLES[table]
    col = cols[column % len(cols)] if cols else None

    def mutate(con: sqlite3.Connection) -> None:
        if action == "drop_table":
            con.execute(f'DROP TABLE "{name}"')
        elif action == "drop_column" and col is not None:
            con.execute(f'ALTER TABLE "{name}" DROP COLUMN "{col}"')
        elif action == "retype" and col is not None:
            con.execute(
                f'UPDATE "{name}" SET "{col}" = ? WHERE rowid IN (SELECT rowid FROM "{name}" LIMIT 3)',
                (value,),
            )
        elif action == "null" and col is not None:
            con.execute(f'UPDATE "{name}" SET "{col}" = NULL')
        elif action == "delete_rows":
            con.execute(f'DELETE FROM "{name}"')

    _load_sqlite(mutate=mutate)


@pytest.mark.parametrize(
    ("where", "value"),
    [
        ("baseTimeNanoseconds", "--5"),
        ("baseTimeNanoseconds", "²"),
        ("baseTimeNanoseconds", 2**80),
        ("tid", "²"),
        ("tid", 2**70),
        ("args.device", True),
        ("args.stream", "stream 7"),
        ("args.grid", [1, 2]),
        ("ts", "NaN"),
        ("ts", 1e300),
        ("dur", -(2**65)),
    ],
)
def test_kineto_odd_values_on_every_kernel(where: str, value) -> None:
    """Exact corners the random search may not reach, set on every kernel of the real slice."""
    trace = json.loads(SLICE_BYTES)
    if where == "baseTimeNanoseconds":
        trace[where] = value
    for e in trace["traceEvents"]:
        if e.get("cat") != "kernel" or where == "baseTimeNanoseconds":
            continue
        if where.startswith("args."):
            e["args"][where[5:]] = value
        else:
            e[where] = value
    run = _load_bytes(json.dumps(trace).encode())
    assert run is not None
    skipped = sum(r["count"] for r in run.overheads.to_pylist() if r["kind"] == "skipped_events")
    assert run.kernels.num_rows + skipped >= 40


# ---------------------------------------------------------------------------------------------
# where the run goes: `decodescope import TRACE --out DIR [--overwrite]`

HF_QWEN = TRACES / "kineto_h100_qwen1.5-0.5b_hf_eager__TraceLens.json.gz"


@pytest.fixture(scope="module")
def qwen_run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run folder of a real trace, the fast input for the CLI tests below."""
    return tracer.write_run(tracer.load(HF_QWEN), tmp_path_factory.mktemp("qwen") / "run")


def _one_error_line(code: int, err: str, names: Path) -> str:
    assert code == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert str(names) in lines[0]
    return lines[0]


def _siblings(folder: Path) -> list[str]:
    """The names in ``folder``, to see that no temporary run folder was left beside the target."""
    return sorted(p.name for p in folder.iterdir())


def test_import_overwrite_keeps_a_folder_that_is_not_a_run(
    qwen_run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--overwrite on a folder of the user's files: refused with one line, every file kept."""
    out = tmp_path / "P"
    (out / "sub").mkdir(parents=True)
    (out / "notes.txt").write_text("x\n")
    code, err = _run_main(["import", str(qwen_run_dir), "--out", str(out), "--overwrite"], capsys)
    line = _one_error_line(code, err, out)
    assert "not a decodescope run folder" in line and "--overwrite" in line
    assert (out / "notes.txt").read_text() == "x\n" and (out / "sub").is_dir()
    assert _siblings(tmp_path) == ["P"]


def test_import_overwrite_keeps_a_folder_with_runs_parquet_and_subfolders(
    qwen_run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Synthetic corner: a run folder's files plus a subfolder (no run has one) is not replaced."""
    out = tmp_path / "P"
    shutil.copytree(qwen_run_dir, out)
    (out / "mine").mkdir()
    code, err = _run_main(["import", str(qwen_run_dir), "--out", str(out), "--overwrite"], capsys)
    assert "mine/" in _one_error_line(code, err, out)
    assert (out / "mine").is_dir() and tracer.store.is_run_dir(out)


def test_import_overwrite_refuses_a_file(
    qwen_run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "file"
    out.write_text("y\n")
    code, err = _run_main(["import", str(qwen_run_dir), "--out", str(out), "--overwrite"], capsys)
    assert "is a file" in _one_error_line(code, err, out)
    assert out.read_text() == "y\n"
    assert _siblings(tmp_path) == ["file"]
    # a file where a parent folder should be
    deeper = out / "sub" / "run"
    code, err = _run_main(["import", str(qwen_run_dir), "--out", str(deeper)], capsys)
    _one_error_line(code, err, deeper)
    assert _siblings(tmp_path) == ["file"]


def test_import_overwrite_replaces_a_run_folder_or_an_empty_folder(
    qwen_run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from decodescope.ui.cli import main

    run_out, empty = tmp_path / "run", tmp_path / "empty"
    empty.mkdir()
    main(["import", str(qwen_run_dir), "--out", str(run_out), "--notes", "first"])
    (run_out / "capture-notes.txt").write_text("a capture writes this beside its tables\n")
    for out in (run_out, empty):
        main(["import", str(qwen_run_dir), "--out", str(out), "--overwrite", "--notes", "again"])
        assert tracer.read_run(out).meta.notes == "again"
    assert not (run_out / "capture-notes.txt").exists()
    assert _siblings(tmp_path) == ["empty", "run"]
    capsys.readouterr()


def test_import_refusal_names_the_overwrite_flag(
    qwen_run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    out.mkdir()
    code, err = _run_main(["import", str(qwen_run_dir), "--out", str(out)], capsys)
    assert "pass --overwrite" in _one_error_line(code, err, out)


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
def test_import_out_where_no_folder_can_be_made(
    qwen_run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """/proc takes no new folders (mkdir gives ENOENT there, even for root)."""
    for out in (Path("/proc/decodescope_qa_run"), Path("/proc/self/decodescope_qa/run")):
        code, err = _run_main(["import", str(qwen_run_dir), "--out", str(out)], capsys)
        _one_error_line(code, err, out)
        assert not out.exists()


def test_write_run_into_a_folder_without_write_permission(
    qwen_run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A parent folder without write permission: chmod where that binds (not root), else a
    synthetic PermissionError from mkdir in that folder. One TraceError naming --out."""
    run = tracer.read_run(qwen_run_dir)
    locked = tmp_path / "locked"
    locked.mkdir()
    if os.geteuid() != 0:
        locked.chmod(0o500)
    else:
        real_mkdir = os.mkdir

        def mkdir(path, *args, **kwargs):
            if Path(path).parent == locked:
                raise PermissionError(13, "Permission denied", str(path))
            return real_mkdir(path, *args, **kwargs)

        monkeypatch.setattr(os, "mkdir", mkdir)
    try:
        for out in (locked / "run", locked / "sub" / "run"):
            with pytest.raises(TraceError) as info:
                tracer.write_run(run, out)
            _assert_clean(info.value, out)
            assert "Permission denied" in str(info.value)
    finally:
        locked.chmod(0o700)
    assert _siblings(locked) == []


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_run_folder_mode_follows_the_umask(qwen_run_dir: Path, tmp_path: Path, umask: int) -> None:
    run = tracer.read_run(qwen_run_dir)
    old = os.umask(umask)
    try:
        out = tracer.write_run(run, tmp_path / "run")
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask


def test_import_backend_must_be_one_of_the_listed(
    qwen_run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from decodescope.ui.cli import main

    out = tmp_path / "run"
    code, err = _run_main(
        ["import", str(qwen_run_dir), "--out", str(out), "--backend", "bogus"], capsys
    )
    assert code == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--backend" in lines[0] and "bogus" in lines[0], err
    assert not out.exists()
    main(["import", str(qwen_run_dir), "--out", str(out), "--backend", "Specialized"])
    assert tracer.read_run(out).meta.backend == "specialized"
    capsys.readouterr()


# ---------------------------------------------------------------------------------------------
# a UTF-8 byte order mark before the JSON (plain and inside the gzip data)


def _differing_columns(a, b) -> set[tuple[str, str]]:
    ta, tb = a.tables(), b.tables()
    return {(t, c) for t in ta for c in ta[t].column_names if not ta[t][c].equals(tb[t][c])}


def test_kineto_with_a_bom_loads_like_without(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from decodescope.ui.cli import main

    text = gzip.decompress(HF_QWEN.read_bytes())
    plain, bom = tmp_path / "plain.json", tmp_path / "bom.json"
    plain.write_bytes(text)
    bom.write_bytes(b"\xef\xbb\xbf" + text)
    bom_gz = tmp_path / "bom.json.gz"
    bom_gz.write_bytes(gzip.compress(b"\xef\xbb\xbf" + text))
    base, base_gz = tracer.load(plain), tracer.load(HF_QWEN)
    assert base.kernels.num_rows == 1465
    # the same trace: only the path differs (the id hashes the trace, not its file: gzip and a
    # byte order mark leave it as it is)
    assert _differing_columns(base, tracer.load(bom)) == {("runs", "source_path")}
    assert _differing_columns(base_gz, tracer.load(bom_gz)) == {("runs", "source_path")}
    assert load_kineto(bom).run_id == load_kineto(plain).run_id == base_gz.run_id
    main(["report", str(bom)])
    main(["report", str(bom_gz)])
    assert "Traceback" not in capsys.readouterr().err


def test_cli_perfetto_out_a_folder_fails_cleanly(tmp_path: Path) -> None:
    """perfetto --out an existing folder: exit 2, one line naming it, no temporary file left."""
    (tmp_path / "folder").mkdir()
    proc = _cli("perfetto", str(KINETO_GZ), "--out", str(tmp_path / "folder"))
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert str(tmp_path / "folder") in lines[0]
    assert [p.name for p in tmp_path.iterdir()] == ["folder"]
