"""`decodescope bench` and `decodescope capture` on a machine without a GPU: bad options, output
paths and a missing NVIDIA driver are one line (exit 2) before any capture child starts or any
folder is written; a bench job that fails makes the exit code 1. Captures are stand-ins that
serve a committed H200 run (results/); the driver check is pointed at a library that no machine
has, so that the tests run the same with or without a GPU."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import tempfile
from pathlib import Path

import pytest
from cli_helpers import Result, cli

import decodescope.tracer.capture as cap
from decodescope.tracer import write_run
from decodescope.tracer.dataset import read_runs, run_ids
from decodescope.ui import cmd_capture
from decodescope.ui.cli import UsageError

RESULTS = Path(__file__).resolve().parent.parent / "results"
NO_DRIVER = "no CUDA driver found"


def one_line_error(p: Result, *needles: str) -> str:
    assert p.returncode == 2, (p.stdout, p.stderr)
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def no_driver(monkeypatch):
    """The driver check without a driver, on any machine; no override set."""
    monkeypatch.delenv(cmd_capture.SKIP_GPU_CHECK_ENV, raising=False)
    monkeypatch.setattr(cmd_capture, "CUDA_DRIVER_LIB", "libdecodescope-no-such-driver.so.1")


@pytest.fixture
def tmpdir_(tmp_path, monkeypatch) -> Path:
    """A private temporary folder, to see what a command leaves there."""
    d = tmp_path / "tmpdir"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    return d


@pytest.fixture(scope="module")
def h200_run():
    rid = next(r for r in sorted(run_ids(RESULTS)) if r.startswith("standard-"))
    (run,) = read_runs(RESULTS, [rid])
    return run


@pytest.fixture
def captures(monkeypatch, h200_run) -> list[dict]:
    """Bench's capture replaced by a stand-in that writes the committed run; the specs asked."""
    asked: list[dict] = []

    def fake_capture(spec, out, timeout, echo=True, **kw):
        asked.append(spec)
        write_run(h200_run, out, overwrite=True)
        return cap.CaptureResult(run=h200_run, out=out, ok=True, message=None, returncode=0)

    monkeypatch.setattr(cap, "run_capture", fake_capture)
    monkeypatch.setenv(cmd_capture.SKIP_GPU_CHECK_ENV, "1")  # stand-ins start no child
    return asked


def test_bench_without_a_driver_stops_before_any_job(no_driver, tmp_path, tmpdir_):
    """No NVIDIA driver: one line naming libcuda's problem, no job started, no folder made."""
    line = one_line_error(
        cli("bench", "--batch", "1,8", "--runs-dir", tmp_path / "runs", "--out", tmp_path / "ds"),
        NO_DRIVER,
        "bench needs an NVIDIA GPU",
    )
    assert "libdecodescope-no-such-driver.so.1" in line
    assert not (tmp_path / "runs").exists() and not (tmp_path / "ds").exists()
    assert list(tmpdir_.iterdir()) == []


def test_capture_without_a_driver_writes_no_run(no_driver, tmp_path, tmpdir_, monkeypatch):
    """capture --workload without a driver: one line, no ./runs/ run and no child folder."""
    monkeypatch.chdir(tmp_path)
    one_line_error(cli("capture", "--workload", "toy"), NO_DRIVER, "capture needs an NVIDIA GPU")
    assert not (tmp_path / "runs").exists() and list(tmpdir_.iterdir()) == []


def test_driver_check_override(no_driver, monkeypatch):
    """DECODESCOPE_SKIP_GPU_CHECK=1 skips the check (CPU tests with stand-in captures), and is
    never recorded as a kernel knob."""
    with pytest.raises(UsageError, match=NO_DRIVER):
        cmd_capture.require_cuda_driver("bench")
    monkeypatch.setenv(cmd_capture.SKIP_GPU_CHECK_ENV, "1")
    cmd_capture.require_cuda_driver("bench")
    assert cmd_capture.SKIP_GPU_CHECK_ENV not in cap.kernel_knobs()


def test_driver_check_names_libcuda_where_it_is_missing(monkeypatch):
    """On a machine without libcuda.so.1 (this CPU machine) the real check says so."""
    try:
        ctypes.CDLL("libcuda.so.1")
        pytest.skip("this machine has an NVIDIA driver")
    except OSError:
        pass
    monkeypatch.delenv(cmd_capture.SKIP_GPU_CHECK_ENV, raising=False)
    with pytest.raises(UsageError, match=r"no CUDA driver found \(libcuda\.so\.1"):
        cmd_capture.require_cuda_driver("capture")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--preset", "nope"], "unknown preset 'nope'"),
        (["--tp-shape", "3"], "--tp-shape 3"),
        (["--tp-world", "3"], "'--tp-world'"),
        (["--tp-world", "0"], "'--tp-world'"),
        (["--backends", "standard,vllm"], "unknown backend 'vllm'; known: standard, specialized"),
        (["--backends", "standard,,specialized"], "--backends"),
        (["--layers", "kda,moe"], "--layers: unknown layer kind 'moe'"),
        (["--allreduce", "ring"], "--allreduce must be one of nccl, oneshot"),
        (["--spec-allreduce", "ring"], "--spec-allreduce must be one of fused, nccl"),
        (["--replays", "0"], "'--replays'"),
        (["--warmup", "-1"], "'--warmup'"),
        (["--timeout", "0"], "--timeout must be > 0"),
        (["--acceptance", "0"], "--acceptance must be > 0"),
        (["--batch", "1,,2"], "--batch"),
        (["--batch", "0"], "--batch expects positive integers"),
        (["--spec-verify", "9"], "--spec-verify"),
        (["--verify-only"], "--verify-only needs --spec-verify K"),
    ],
)
def test_bench_bad_options_are_one_line_before_the_driver_check(no_driver, args, needle):
    """Each bad bench option: one line naming it, found before the driver check."""
    line = one_line_error(cli("bench", *args), needle)
    assert NO_DRIVER not in line


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--steps", "0"], "'--steps'"),
        (["--warmup", "-1"], "'--warmup'"),
        (["--timeout", "0"], "--timeout must be > 0"),
        (["--tp-world", "0"], "'--tp-world'"),
        (["--out", "/proc/nope/run"], "--out /proc/nope/run: cannot create the folder /proc/nope"),
    ],
)
def test_capture_bad_options_are_one_line_before_the_driver_check(no_driver, args, needle):
    """Each bad capture option: one line naming it, found before the driver check."""
    line = one_line_error(cli("capture", "--workload", "toy", *args), needle)
    assert NO_DRIVER not in line


def test_capture_unknown_workload_lists_the_registered_ones(no_driver):
    """--workload of no registered name: one line with the names there are."""
    line = one_line_error(cli("capture", "--workload", "nope"), "no workload named 'nope'")
    assert "standard" in line and "specialized" in line and "toy" in line


def test_capture_out_under_a_file(no_driver, tmp_path):
    """--out whose parent is a file: one line before the child, the file untouched."""
    f = tmp_path / "afile"
    f.write_text("keep")
    one_line_error(cli("capture", "-w", "toy", "--out", f / "run"), f"{f} is not a folder")
    assert f.read_text() == "keep"


def test_capture_of_a_program_that_does_not_exist(tmpdir_):
    """capture -- nonexistentprog: one line, exit 2, no capture folder left in $TMPDIR; a path
    that is no executable file too."""
    one_line_error(cli("capture", "--", "nonexistentprog"), "'nonexistentprog' not found on PATH")
    one_line_error(cli("capture", "--", "/no/such/prog", "x"), "/no/such/prog: no such file")
    one_line_error(cli("capture", "--", str(tmpdir_)), "not an executable file")
    assert list(tmpdir_.iterdir()) == []


def test_run_capture_of_a_program_that_cannot_start_leaves_no_folder(tmpdir_):
    """tracer's run_capture itself: a program that cannot start is a one-line TraceError and
    its child folder is removed."""
    from decodescope.tracer.errors import TraceError

    with pytest.raises(TraceError, match="nonexistentprog: cannot start it") as e:
        cap.run_capture({"program": True}, out=None, command=["nonexistentprog"])
    assert "\n" not in str(e.value) and list(tmpdir_.iterdir()) == []


def test_bench_out_is_checked_before_the_first_capture(captures, tmp_path):
    """bench --out: a file, a folder of other things, a folder that cannot be made: one line
    each, no capture asked for, nothing touched."""
    f = tmp_path / "afile"
    f.write_text("keep")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("keep")
    one_line_error(cli("bench", "--batch", "1", "--out", f), "exists and is not a folder")
    one_line_error(cli("bench", "--batch", "1", "--out", other), "neither empty nor a results")
    one_line_error(cli("bench", "--out", f / "ds"), f"{f} is not a folder")
    one_line_error(cli("bench", "--out", "/proc/nope/ds"), "cannot create the folder /proc/nope")
    assert captures == [] and f.read_text() == "keep" and len(list(other.iterdir())) == 1


def test_bench_verify_only_runs_the_verify_step_alone(captures, tmp_path):
    """--spec-verify 7 --verify-only: every job is the 1+7-token step (both backends, each
    batch); without --verify-only the one-token steps run too."""
    p = cli("bench", "--batch", "2,4", "--spec-verify", "7", "--verify-only",
            "--runs-dir", tmp_path / "r1")  # fmt: skip
    assert p.returncode == 0, p.stderr
    asked = [(s["workload"], s["opts"]["batch"], s["opts"]["tokens_per_seq"]) for s in captures]
    assert sorted(asked) == sorted((b, n, 8) for b in ("standard", "specialized") for n in (2, 4))
    captures.clear()
    p = cli("bench", "--batch", "2", "--spec-verify", "7", "--runs-dir", tmp_path / "r2")
    assert p.returncode == 0, p.stderr
    assert sorted(s["opts"]["tokens_per_seq"] for s in captures) == [1, 1, 8, 8]


def test_bench_json_is_checked_before_the_first_capture(captures, tmp_path):
    """bench --json: an existing folder or a file in a folder that cannot be made: one line."""
    one_line_error(cli("bench", "--json", tmp_path), "is a folder, not a file")
    one_line_error(cli("bench", "--json", "/proc/nope/b.json"), "cannot create the folder")
    one_line_error(cli("bench", "--runs-dir", "/proc/nope/r"), "--runs-dir /proc/nope/r")
    assert captures == []


def test_bench_a_failed_append_is_a_failure_line_and_exit_1(captures, tmp_path, monkeypatch):
    """append_run failing on a write: a `failed:` line per run, the tables still printed, exit 1,
    no traceback."""
    import decodescope.tracer.dataset as ds

    def broken(run, dataset, replace=False):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ds, "append_run", broken)
    p = cli("bench", "--batch", "1", "--out", tmp_path / "ds", "--runs-dir", tmp_path / "r")
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert len(captures) == 2 and "Per layer" in p.stdout
    assert p.stderr.count("not appended to") == 2 and "No space left on device" in p.stderr
    assert "0 run(s) appended" in p.stdout


def test_bench_exits_1_when_one_job_failed(captures, tmp_path, monkeypatch, h200_run):
    """One backend fails, the other succeeds: its table, the failure line, exit 1; all jobs
    succeed: exit 0."""
    ok = cap.run_capture

    def half(spec, out, timeout, echo=True, **kw):
        res = ok(spec, out, timeout, echo)
        if spec["workload"] == "specialized":
            return dataclasses.replace(res, ok=False, message="the capture child was killed")
        return res

    monkeypatch.setattr(cap, "run_capture", half)
    p = cli("bench", "--batch", "1", "--runs-dir", tmp_path / "r1")
    assert p.returncode == 1 and "Per layer" in p.stdout
    assert "failed: specialized-kimi-k3-tp8-b1-t1: the capture child was killed" in p.stderr
    monkeypatch.setattr(cap, "run_capture", ok)
    p = cli("bench", "--batch", "1", "--runs-dir", tmp_path / "r2", "--out", tmp_path / "ds")
    assert p.returncode == 0 and "failed:" not in p.stderr, p.stderr
    assert "2 run(s) appended" in p.stdout and (tmp_path / "ds" / "runs").is_dir()


def test_bench_json_that_cannot_be_written_at_the_end(captures, tmp_path, monkeypatch):
    """--json whose folder became a file while bench ran: one error line after the tables, exit
    1, no traceback, no temporary file left."""
    where = tmp_path / "j"
    ok = cap.run_capture

    def then_break(spec, out, timeout, echo=True, **kw):
        with contextlib.suppress(FileNotFoundError):
            where.rmdir()
        where.write_text("now a file")
        return ok(spec, out, timeout, echo)

    monkeypatch.setattr(cap, "run_capture", then_break)
    p = cli("bench", "--batch", "1", "--json", where / "b.json", "--runs-dir", tmp_path / "r")
    assert p.returncode == 1 and "Traceback" not in p.stderr and "Per layer" in p.stdout
    assert f"error: --json {where / 'b.json'}: cannot write it" in p.stderr
    assert sorted(x.name for x in tmp_path.iterdir()) == ["j", "r"]


def test_default_capture_folder_name_needs_no_quoting():
    """The default ``runs/NAME-TIME`` folder of a program capture takes the program's name as a
    shell takes it unquoted (``python -c "print(1)"`` used to give ``runs/print(1)-...``)."""
    from decodescope.ui.cmd_capture import _folder_name

    assert _folder_name("print(1)") == "print_1"
    assert _folder_name("train.py") == "train.py" and _folder_name("()") == "capture"


NO_VLLM = Path(__file__).resolve().parent.parent / "notes/gpu-logs/s39/std_no_vllm"


def test_bench_require_vllm_ops(captures, tmp_path, monkeypatch):
    """--require-vllm-ops: without vllm or VLLM_OPS_DIR, one line before any capture (the
    standard path would not be the vLLM baseline); specialized alone needs none. With a
    source there but a standard run that ran without the ops (the real session-39 run of a
    machine without them), that job is a failure line, kept out of --out, exit 1."""
    from decodescope.kernels import vllm_ops

    monkeypatch.delenv("VLLM_OPS_DIR", raising=False)
    monkeypatch.setattr(vllm_ops, "vllm_installed", lambda: False)
    one_line_error(cli("bench", "--batch", "1", "--require-vllm-ops"), "--require-vllm-ops",
                   "vllm is not installed and VLLM_OPS_DIR is not set")  # fmt: skip
    assert captures == []
    d = tmp_path / "ops"
    d.mkdir()
    (d / vllm_ops.LIBS[0]).write_bytes(b"")
    monkeypatch.setenv("VLLM_OPS_DIR", str(d))
    line = one_line_error(cli("bench", "--batch", "1", "--require-vllm-ops"), "lacks")
    assert vllm_ops.LIBS[1] in line and captures == []
    p = cli("bench", "--batch", "1", "--backends", "specialized", "--require-vllm-ops",
            "--runs-dir", tmp_path / "r0")  # fmt: skip
    assert p.returncode == 0, p.stderr
    (d / vllm_ops.LIBS[1]).write_bytes(b"")  # both there: the check passes
    (no_ops,) = read_runs(NO_VLLM, ["standard-20261205T023411-a8683b"])

    def fake(spec, out, timeout, echo=True, **kw):
        write_run(no_ops, out, overwrite=True)
        return cap.CaptureResult(run=no_ops, out=out, ok=True, message=None, returncode=0)

    monkeypatch.setattr(cap, "run_capture", fake)
    p = cli("bench", "--batch", "32", "--spec-verify", "7", "--verify-only", "--backends",
            "standard", "--require-vllm-ops", "--out", tmp_path / "ds",
            "--runs-dir", tmp_path / "r1")  # fmt: skip
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert "WITHOUT vLLM's compiled ops" in p.stderr and "(--require-vllm-ops)" in p.stderr
    assert not (tmp_path / "ds" / "runs").exists() or run_ids(tmp_path / "ds") == []
