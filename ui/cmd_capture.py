"""``decodescope capture``: profile a registered workload or any Python program under CUPTI.

Also the checks that ``capture`` and ``bench`` share, made before any capture child starts or
any folder is written: :func:`require_cuda_driver` (an NVIDIA driver to capture on) and
:func:`folder_problem` (a folder that can be made and written).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import tempfile
from pathlib import Path

import typer

from decodescope.ui.cli import UsageError, app, console, err_console

SKIP_GPU_CHECK_ENV = "DECODESCOPE_SKIP_GPU_CHECK"
CUDA_DRIVER_LIB = "libcuda.so.1"


def require_cuda_driver(command: str) -> None:
    """One line (:class:`UsageError`) where no NVIDIA driver can be loaded, before ``command``
    (``capture``, ``bench``) starts any child or writes any folder: without it every capture
    child fails the same way, after minutes of building. Cheap: loads ``libcuda.so.1`` with
    ``ctypes`` (no ``cuInit``, no torch in the parent).

    Skipped where ``DECODESCOPE_SKIP_GPU_CHECK=1`` (tests on CPU machines that drive the command
    with stand-in captures; a real capture child that then finds no driver fails as before, run
    by run).
    """
    if os.environ.get(SKIP_GPU_CHECK_ENV) == "1":
        return
    try:
        ctypes.CDLL(CUDA_DRIVER_LIB)
    except OSError as e:
        why = " ".join(str(e).split()) or CUDA_DRIVER_LIB
        raise UsageError(f"no CUDA driver found ({why}): {command} needs an NVIDIA GPU") from None


def folder_problem(folder: Path) -> str | None:
    """Why ``folder`` (there or to be made) cannot be made or written into, or None. Makes the
    missing folders and a scratch folder inside, then removes all it made: nothing is left."""
    made: list[Path] = []
    d = Path(folder)
    while not os.path.lexists(d) and d != d.parent:
        made.append(d)
        d = d.parent
    if not d.is_dir():
        return f"{d} is not a folder"
    try:
        for m in reversed(made):
            try:
                m.mkdir()
            except OSError as e:
                return f"cannot create the folder {m} ({e.strerror or e})"
        os.rmdir(tempfile.mkdtemp(prefix=".decodescope-probe-", dir=folder))
    except OSError as e:
        return f"cannot write into {folder} ({e.strerror or e})"
    finally:
        for m in made:  # deepest first
            with contextlib.suppress(OSError):
                m.rmdir()
    return None


def program_problem(command: list[str]) -> str | None:
    """Why the program of ``capture -- PROG ARGS`` cannot be started, or None: a path that is
    no executable file, or a name that is not on PATH (``python`` is this interpreter)."""
    prog = command[0]
    if os.sep not in prog:
        if prog in ("python", "python3") or shutil.which(prog):
            return None
        return f"program {prog!r} not found on PATH"
    p = Path(prog)
    if not p.exists():
        return f"program {prog}: no such file"
    if not p.is_file() or not os.access(p, os.X_OK):
        return f"program {prog}: not an executable file"
    return None


def workload_problem(name: str) -> str | None:
    """Why ``--workload NAME`` names no registered workload (with the registered names), or
    None: the capture child's own lookup (tracer.child), made in the parent before it starts."""
    from decodescope.tracer.child import _find_workload

    try:
        _find_workload(name)
    except LookupError as e:
        return str(e)
    return None


def _parse_opts(opts: list[str]) -> dict[str, object]:
    out: dict[str, object] = {}
    for o in opts:
        k, sep, v = o.partition("=")
        if not sep or not k:
            raise UsageError(f"--opt expects key=value, got {o!r}")
        out[k] = int(v) if v.lstrip("-").isdigit() else v
    return out


CAPTURE_HELP = (
    "Capture a workload (--workload NAME) or a program (-- python prog.py args...).\n\n"
    "Options, the program, the workload name and --out are checked first, then that an NVIDIA "
    "driver is there (DECODESCOPE_SKIP_GPU_CHECK=1 skips that check), all before the capture "
    "child starts."
)


def _folder_name(text: str) -> str:
    """``text`` as a folder name a shell takes unquoted (``print(1)`` -> ``print_1``)."""
    import re

    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_.") or "capture"


@app.command(
    "capture",
    help=CAPTURE_HELP,
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def capture_cmd(
    ctx: typer.Context,
    workload: str | None = typer.Option(None, "--workload", "-w", help="A registered workload."),
    opt: list[str] = typer.Option([], "--opt", help="Workload option key=value (repeatable)."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Run folder to write."),
    timeout: float = typer.Option(
        600.0, "--timeout", help="Stop the child after this many seconds."
    ),
    graph: bool = typer.Option(
        False, "--graph/--eager", help="Capture one CUDA graph and replay it."
    ),
    steps: int = typer.Option(20, "--steps", min=1, help="Steps (eager) or replays (graph)."),
    warmup: int = typer.Option(3, "--warmup", min=0, help="Warm-up steps, not recorded."),
    modules: bool = typer.Option(False, "--modules", help="Wrap nn.Module forwards in ranges."),
    tp_world: int = typer.Option(
        1,
        "--tp-world",
        min=1,
        help="GPUs (ranks) that really run: one capture child per rank, merged into one run "
        "with a rank column (workloads only; option tp_world is set to it).",
    ),
) -> None:
    """Capture a workload (--workload NAME) or a program (-- python prog.py args...).
    (``CAPTURE_HELP``, what ``--help`` shows)."""
    from decodescope.tracer.capture import run_capture

    command = list(ctx.args)
    if command and command[0] == "--":
        command = command[1:]
    if bool(workload) == bool(command):
        raise UsageError(
            "give either --workload NAME or a program after --, e.g. -- python prog.py"
        )
    if tp_world > 1 and not workload:
        raise UsageError("--tp-world > 1 captures a workload (--workload NAME), not a program")
    if not timeout > 0:
        raise UsageError(f"--timeout must be > 0 seconds, got {timeout:g}")
    if workload:
        spec = {
            "workload": workload,
            "opts": _parse_opts(opt),
            "graph": graph,
            "steps": steps,
            "warmup": warmup,
        }
        why = workload_problem(workload)
        if why:
            raise UsageError(f"--workload: {why}")
    else:
        spec = {"modules": modules, "program": True}
        why = program_problem(command)
        if why:
            raise UsageError(why)
    if out is None:
        import time

        out = (
            Path("runs") / f"{_folder_name(workload or Path(command[-1]).stem)}-"
            f"{time.strftime('%Y%m%d-%H%M%S')}"
        )
    if out.exists() or out.is_symlink():  # a capture replaces only a run (or an empty) folder:
        from decodescope.tracer.store import why_not_replaceable  # say so before it runs

        why = why_not_replaceable(out)
        if why:
            raise UsageError(f"{out}: {why}; --out replaces only a run folder or an empty folder")
    why = folder_problem(out.absolute().parent)  # the run is written beside it, then renamed
    if why:
        raise UsageError(f"--out {out}: {why}")
    require_cuda_driver("capture")
    if tp_world > 1:
        from decodescope.tracer.distributed import run_distributed_capture

        res = run_distributed_capture(spec, tp_world, out=out, timeout=timeout)
    else:
        res = run_capture(spec, out=out, timeout=timeout, command=command or None)
    run = res.run
    ov = {r["kind"]: r["count"] for r in run.overheads.to_pylist() if r["count"] is not None}
    steps_seen = len({s for s in run.kernels.column("step").to_pylist() if s is not None})
    console.print(
        f"run [bold]{run.run_id}[/] -> {res.out}\n"
        f"  {run.kernels.num_rows} kernels, {run.memops.num_rows} memops, {run.ranges.num_rows} ranges, "
        f"{steps_seen} steps, graph mode {run.meta.graph_mode}\n"
        f"  dropped CUPTI records: {run.meta.dropped_records or 0}; graph kernels without a node path: "
        f"{ov.get('graph_kernels_unmapped', 0)}",
        highlight=False,
    )
    if tp_world > 1:
        per = run.kernels.group_by("rank").aggregate([("start_ns", "count")]).to_pylist()
        counts = ", ".join(f"rank {r['rank']}: {r['start_ns_count']}" for r in per)
        console.print(f"  tp_world {run.meta.tp_world}: kernels {counts}", highlight=False)
    if res.message:
        err_console.print(
            f"[bold yellow]partial:[/] {res.message}", highlight=False, soft_wrap=True
        )
        raise typer.Exit(1)
