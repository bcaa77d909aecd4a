"""``decodescope capture``: profile a registered workload or any Python program under CUPTI."""

from __future__ import annotations

from pathlib import Path

import typer

from decodescope.ui.cli import UsageError, app, console, err_console


def _parse_opts(opts: list[str]) -> dict[str, object]:
    out: dict[str, object] = {}
    for o in opts:
        k, sep, v = o.partition("=")
        if not sep or not k:
            raise UsageError(f"--opt expects key=value, got {o!r}")
        out[k] = int(v) if v.lstrip("-").isdigit() else v
    return out


@app.command(
    "capture",
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
    steps: int = typer.Option(20, "--steps", help="Steps (eager) or replays (graph)."),
    warmup: int = typer.Option(3, "--warmup", help="Warm-up steps, not recorded."),
    modules: bool = typer.Option(False, "--modules", help="Wrap nn.Module forwards in ranges."),
    tp_world: int = typer.Option(
        1,
        "--tp-world",
        help="GPUs (ranks) that really run: one capture child per rank, merged into one run "
        "with a rank column (workloads only; option tp_world is set to it).",
    ),
) -> None:
    """Capture a workload (--workload NAME) or a program (-- python prog.py args...)."""
    from decodescope.tracer.capture import run_capture

    command = list(ctx.args)
    if command and command[0] == "--":
        command = command[1:]
    if bool(workload) == bool(command):
        raise UsageError(
            "give either --workload NAME or a program after --, e.g. -- python prog.py"
        )
    if tp_world < 1:
        raise UsageError(f"--tp-world must be >= 1, got {tp_world}")
    if tp_world > 1 and not workload:
        raise UsageError("--tp-world > 1 captures a workload (--workload NAME), not a program")
    if workload:
        spec = {
            "workload": workload,
            "opts": _parse_opts(opt),
            "graph": graph,
            "steps": steps,
            "warmup": warmup,
        }
    else:
        spec = {"modules": modules, "program": True}
    if out is None:
        import time

        out = (
            Path("runs") / f"{workload or Path(command[-1]).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
        )
    if out.exists() or out.is_symlink():  # a capture replaces only a run (or an empty) folder:
        from decodescope.tracer.store import why_not_replaceable  # say so before it runs

        why = why_not_replaceable(out)
        if why:
            raise UsageError(f"{out}: {why}; --out replaces only a run folder or an empty folder")
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
