"""``decodescope demo``: the main job on the bundled real H200 data, no GPU needed.

With the bundled results dataset (``results/``: runs of ``decodescope bench`` on the H200) it
prints the reference-style table (standard vs specialized per layer kind, bytes floor,
projection) and the layer-by-layer comparison of the batch-1 pair. Without it, it reports the
bundled H200 captures under ``data/runs/``.
"""

from __future__ import annotations

from pathlib import Path

import typer

from decodescope.ui.cli import app, console
from decodescope.ui.render import Fitted

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "results"
RUNS = REPO / "data" / "runs"


def without_vllm(meta) -> bool:
    """Whether a standard run recorded that it ran without vLLM's compiled ops (its workload
    config has ``op_impl`` and no ``vllm_ops``: the GPU machine lacked them, so the project's
    own stand-ins ran, e.g. a torch ``moe_align`` of some 30 launches). Such a run is not the
    vLLM baseline. Runs that record nothing (older ones, imports) are taken as they are."""
    if meta.backend != "standard":
        return False
    wl = (meta.config or {}).get("workload") or {}
    return bool(wl.get("op_impl")) and not wl.get("vllm_ops")


def _pairs(runs) -> dict[tuple, dict[str, object]]:
    """(preset, tp_shape, tp_world, batch, tokens_per_seq) -> {backend: run}, the newest standard
    and specialized run among the runs of the defaults (a run captured with kernel knobs,
    ``config_json["knobs"]``, measured other kernels: it stays in the dataset, out of these
    tables; imported traces of other tools have no pair). The standard side is the newest run
    with vLLM's compiled ops where a setup has one (:func:`without_vllm`): a newer run without
    them stays in the dataset, out of these tables, and is shown only where no run with them
    exists (then ``cmd_bench.ops_line`` and the README table say so)."""
    from decodescope.ui.cmd_report import knobs_of

    out: dict[tuple, dict[str, object]] = {}
    for r in sorted(runs, key=lambda r: str(r.meta.created_at)):
        m = r.meta
        if knobs_of(m) or m.backend not in ("standard", "specialized"):
            continue  # imported traces of other tools (backend "other") have no pair to show
        key = (m.preset, m.tp_shape, m.tp_world or 1, m.batch, m.tokens_per_seq or 1)
        have = out.get(key, {}).get(m.backend)
        if have is not None and without_vllm(m) and not without_vllm(have.meta):
            continue  # keep the vLLM baseline
        out.setdefault(key, {})[m.backend] = r
    return out


@app.command("demo")
def demo(
    results: Path = typer.Option(RESULTS, help="Results dataset to show."),
    runs: Path = typer.Option(RUNS, help="Run folders to fall back on."),
) -> None:
    """Show the bundled H200 results: standard vs specialized, layer by layer."""
    from decodescope import tracer
    from decodescope.tracer.dataset import is_dataset, read_runs
    from decodescope.ui import cmd_bench

    if results != RESULTS and not is_dataset(results):  # asked for by name: say what is wrong
        from decodescope.ui.cli import UsageError

        why = "does not exist" if not results.exists() else "is not a results dataset"
        raise UsageError(
            f"{results}: {why} (one made by `decodescope bench --out` or `decodescope export`)"
        )
    if is_dataset(results):
        from decodescope.ui.cli import err_console
        from decodescope.ui.render import progress

        with progress(err_console, f"reading {results}"):
            all_runs = read_runs(results)
        pairs = _pairs(all_runs)
        title = "Bundled H200 results" if results == RESULTS else "Results"
        if pairs:
            console.print(f"[bold]{title}[/] ({results}, {len(all_runs)} runs)")
        elif results != RESULTS:
            from decodescope.ui.cli import UsageError

            raise UsageError(
                f"{results}: no runs of `decodescope bench` (standard or specialized backend, "
                f"without kernel knobs) among its {len(all_runs)} run(s); `decodescope report "
                f"{results}@RUN_ID` shows any one of them"
            )
        setups = sorted({k[:3] for k in pairs}, key=lambda s: (str(s[0]), s[1] or 0, s[2]))
        for preset, tp, tpw in setups:
            rows = []
            for (p_, tp_, tpw_, batch, tps), by in sorted(pairs.items(), key=lambda kv: str(kv[0])):
                if (p_, tp_, tpw_) != (preset, tp, tpw):
                    continue
                for backend, run in by.items():
                    rows.extend(cmd_bench.kind_rows(run, backend, batch, tps))
            if not rows:
                continue
            m = next(r.meta for r in all_runs if (r.meta.preset, r.meta.tp_shape) == (preset, tp))
            line = f"{m.gpu} x{tpw}, tp_shape {tp}, tp_world {tpw}, {preset}"
            console.print(Fitted(cmd_bench._layer_table(rows, line), keys=3))
            prows = cmd_bench.projections(rows, 6.0)
            if prows:
                console.print(Fitted(cmd_bench._projection_table(prows, line), keys=2))
        if pairs:
            console.print(Fitted(cmd_bench._reference_table()))
            both = [(k, by) for k, by in pairs.items() if {"standard", "specialized"} <= set(by)]
            # the reference's figure is one layer at batch 1: show that pair, TP8 shapes first
            both.sort(key=lambda kv: (kv[0][3] or 0, kv[0][2], kv[0][1] != 8, kv[0][4], str(kv[0])))
            if both:
                from decodescope.ui.cmd_compare import print_compare

                (preset, tp, _tpw, batch, tps), by = both[0]
                console.rule(
                    f"layer by layer, {preset} tp_shape {tp} batch {batch}: "
                    "A = standard, B = specialized"
                )
                print_compare(
                    by["standard"],
                    by["specialized"],
                    top=10,
                    a_label="standard",
                    b_label="specialized",
                )
                _print_op_floors(by["specialized"], f"{preset} tp_shape {tp} batch {batch}")
            return
    folders = sorted(p for p in runs.glob("*") if tracer.store.is_run_dir(p))
    if not folders:
        console.print(f"no bundled data under {results} or {runs}")
        raise typer.Exit(1)
    from decodescope.ui.cmd_report import print_report

    console.print(f"[bold]Bundled H200 captures[/] ({runs}): {', '.join(p.name for p in folders)}")
    graph = next((p for p in folders if "graph" in p.name), folders[0])
    print_report(tracer.load(graph), top=10)
    eager = next((p for p in folders if "eager" in p.name), None)
    if eager is not None and eager != graph:
        from decodescope.ui.cmd_compare import print_compare

        console.rule(f"A = {eager.name}, B = {graph.name}")
        print_compare(tracer.load(eager), tracer.load(graph), top=10)


def _print_op_floors(run, where: str) -> None:
    """The specialized run's ops against the floors of their own bytes (``report``'s op
    table): what of each layer's time its bytes do not explain."""
    from decodescope.analysis import metrics
    from decodescope.ui.cmd_report import HEADERS
    from decodescope.ui.op_floors import op_floors
    from decodescope.ui.render import arrow_table

    ops, why = op_floors(run, metrics.op_table(run.kernels))
    if "op_floor_us" not in ops.column_names:
        if why:
            console.print(f"[yellow]{why}[/]", soft_wrap=True)
        return
    console.print(
        arrow_table(
            ops,
            f"specialized, {where}: each op's share against the bytes floor of its own part of "
            "the layer (above zero: time its bytes do not explain)",
            ["layer_kind", "block", "op", "kernels", "share_us", "op_floor_us",
             "share_over_floor_us"],
            HEADERS,
            max_width={"op": 40},
        )
    )  # fmt: skip
