"""``decodescope check RUN --baseline RUN_OR_DATASET --max-regression PCT``: exit 1 on a
regression (with the reasons), 0 otherwise."""

from __future__ import annotations

from pathlib import Path

import typer

from decodescope.analysis import dataset as layout
from decodescope.analysis import regress
from decodescope.analysis.schema import RunMeta
from decodescope.tracer import dataset as tds
from decodescope.tracer.errors import TraceError
from decodescope.ui.cli import UsageError, app, console
from decodescope.ui.cmd_import import SCHEME_HELP, load_with_progress
from decodescope.ui.cmd_report import knobs_of
from decodescope.ui.render import arrow_table, dumps


def _baseline(
    path: Path, run, scheme: Path | None, allow_mismatch: bool = False, last: int | None = None
) -> tuple[list, str, list[dict], list[str]]:
    """The baseline kernels tables, a description of where they came from, the kernel knobs of
    each baseline run, and the lines that say how a baseline run's setup differs from the run's
    (a dataset's baseline runs are chosen with the run's setup, the ``last`` newest of them
    where given; a baseline run of another setup is refused unless ``allow_mismatch``)."""
    if last is not None and not tds.is_dataset(path):
        raise UsageError(f"{path}: --last chooses among a dataset's runs; this is one run")
    if tds.is_dataset(path):
        runs = tds.read_table(path, "runs").to_pylist()
        # a partial run (its capture did not finish) is no baseline: left out, and said so
        partial = layout.select_baseline([r for r in runs if r.get("partial")], run.meta)
        ids = layout.select_baseline([r for r in runs if not r.get("partial")], run.meta)
        if not ids:
            keys = ", ".join(f"{k}={getattr(run.meta, k)}" for k in layout.BASELINE_KEYS)
            itself = any(r.get("run_id") == run.meta.run_id for r in runs)
            why = (
                f" (it holds run {run.meta.run_id} itself, which is never its own baseline: "
                "export another run of the same setup)"
                if itself
                else ""
            )
            if partial:
                why += f" ({len(partial)} partial run(s) of that setup left out)"
            raise UsageError(f"{path}: no baseline run with the same {keys}{why}")
        idset = set(ids)
        knobs = {
            r["run_id"]: knobs_of(
                RunMeta(run_id=r["run_id"], source="", config_json=r.get("config_json"))
            )
            for r in runs
            if r.get("run_id") in idset
        }
        # the runs captured with the run's own kernel knobs (the defaults: none), where there are
        # any: the dataset's knob A/Bs measured other kernels; else the runs of the defaults (a
        # knob run against the defaults is that knob's A/B), else all; the note names the knobs
        mine = knobs_of(run.meta)
        same = [i for i in ids if knobs.get(i) == mine]
        defaults = [i for i in ids if not knobs.get(i)]
        chosen = same or defaults or ids
        what = (
            ("with the run's kernel knobs" if mine else "of the default kernels")
            if same
            else ("of the default kernels" if defaults else "with other kernel knobs")
        )
        n_setup = len(chosen)
        if last is not None and last < len(chosen):  # the newest: a baseline of recent history
            when = {r["run_id"]: str(r.get("created_at") or "") for r in runs}
            chosen = sorted(chosen, key=lambda i: (when.get(i, ""), i))[-last:]
            what += f", the {last} newest of {n_setup}"
        kernels = tds.read_table(path, "kernels", chosen)
        have = set(kernels["run_id"].cast("string").unique().to_pylist())
        empty = [i for i in chosen if i not in have]
        if empty:  # a runs row without kernels (a damaged dataset or an empty capture): said
            raise TraceError(
                path / "kernels",
                f"baseline run {empty[0]} has no kernel rows (its kernels partition is missing, "
                "or the capture recorded none"
                + (f"; {len(empty) - 1} more run(s) too" if len(empty) > 1 else "")
                + "): re-export the run, or remove it from the dataset",
            )
        origin = f"dataset {path} ({len(chosen)} run(s) {what}: median of their figures)"
        if partial:
            origin += f"; {len(partial)} partial run(s) of the setup left out"
        return [kernels], origin, [knobs[i] for i in chosen], []
    base = load_with_progress(path, scheme)
    _refuse_partial(path, base, "baseline run")
    diffs = layout.setup_differences(run.meta, base.meta)
    if diffs and not allow_mismatch:  # another setup's figures say nothing of a regression
        raise UsageError(
            f"{path}: baseline run {base.run_id} ran another setup than run {run.run_id} "
            f"({'; '.join(diffs)}): not compared (--allow-setup-mismatch compares anyway)"
        )
    from decodescope.ui.cmd_compare import SHAPE_FIELDS, shape_lines

    shape = [  # a baseline of another step shape (A = the run, B = the baseline): say so
        ln.replace(": A ", ": run ", 1).replace("; B ", "; baseline ", 1)
        for ln in shape_lines(run, base)
    ]
    other = [d for d in diffs if d.split(":", 1)[0] not in (*SHAPE_FIELDS, "gpu", "graph_mode")]
    if other:  # what shape_lines does not say (workload, backend)
        shape.append("different setups (the figures compare different work): " + "; ".join(other))
    return [base.kernels], f"run {base.run_id}", [knobs_of(base.meta)], shape


def _refuse_partial(path: Path, run, what: str) -> None:
    """A partial run (a capture that crashed or hung: ``partial`` in its record) measured only
    part of its steps, maybe none of some layers: neither checked nor a baseline."""
    if run.meta.partial:
        raise UsageError(
            f"{path}: {what} {run.run_id} is partial (its capture did not finish): not compared"
        )


def knob_difference(current: dict[str, str], baselines: list[dict[str, str]]) -> str | None:
    """One line naming the kernel knobs that differ between the run and a baseline run (a
    regression check across different knobs compares different kernels), or None."""
    diffs = []
    for b in baselines:
        for k in sorted(set(current) | set(b)):
            if current.get(k) != b.get(k):
                d = f"{k}: run {current.get(k, 'unset')}, baseline {b.get(k, 'unset')}"
                if d not in diffs:
                    diffs.append(d)
    return "kernel knobs differ (" + "; ".join(diffs) + ")" if diffs else None


def share_lines(by_span: regress.CheckResult, by_share: regress.CheckResult) -> list[str]:
    """A line per layer kind whose span regressed while its share of the step did not: under
    programmatic dependent launch a layer's first kernel can become resident (and wait) before
    the previous layer ends, which its span counts and the step does not pay."""
    share = {r["layer_kind"]: r for r in by_share.table.to_pylist()}
    out = []
    for r in by_span.table.to_pylist():
        s = share.get(r["layer_kind"])
        if r["status"] != "regression" or s is None or s["status"] != "ok":
            continue
        if r["span_us_change_pct"] is None or s["share_us_change_pct"] is None:
            continue
        if r["span_us_change_pct"] <= 0:  # the kernel count regressed, not the span
            continue
        out.append(
            f"{regress.noun(r['layer_kind'])}: span {r['span_us_change_pct']:+.1f}% but share "
            f"{s['share_us_change_pct']:+.1f}% ({s['baseline_share_us']:.1f} -> "
            f"{s['run_share_us']:.1f} us): the span counts the time its first kernel overlaps "
            "the previous layer; `--metric share` checks what the step pays"
        )
    return out


CHECK_METRICS = regress.TIME_METRICS


@app.command("check")
def check(
    run: Path = typer.Argument(..., help="the run to check (run folder, trace or DATASET@RUN_ID)"),
    baseline: Path = typer.Option(..., "--baseline", help="baseline run folder, trace or dataset"),
    max_regression: float = typer.Option(
        ..., "--max-regression", min=0, help="allowed increase in percent (time and kernels)"
    ),
    max_kernel_increase: float | None = typer.Option(
        None, "--max-kernel-increase", min=0, help="allowed kernel-count increase in percent"
    ),
    metric: str = typer.Option(
        "span",
        "--metric",
        help="the time figure checked beside the kernel count: span (DESIGN's layer span), share "
        "(the layer's share of the step: a path under programmatic dependent launch starts a "
        "layer's first kernel before the previous layer ends, which its span counts) or both",
    ),
    allow_mismatch: bool = typer.Option(
        False,
        "--allow-setup-mismatch",
        help="check against a baseline run of another setup (workload, preset, backend, batch, "
        "tokens per sequence, tp_shape, tp_world, GPU, graph mode) instead of refusing it; the "
        "differences are printed as notes",
    ),
    last: int | None = typer.Option(
        None,
        "--last",
        min=1,
        help="against a dataset: only its N newest runs of the run's setup form the baseline "
        "(default: all of them, the whole history)",
    ),
    json_out: bool = typer.Option(False, "--json", help="print JSON instead of tables"),
    scheme: Path | None = typer.Option(None, "--scheme", help=SCHEME_HELP),
) -> None:
    """Compare a run with a baseline per layer kind; exit 1 if span (or share) or kernel count
    regressed, 0 if not, 2 on bad input or a baseline of another setup.

    Noise: each figure is a median (per layer kind, over its layers and the run's replayed
    steps); against a dataset, the baseline is the median over all its runs of the run's setup
    (kernel knobs as described in the baseline line), so one slow baseline run does not move it;
    ``--last N`` keeps the N newest of them, so that an old slow period does not hide a
    regression against the recent runs.
    A figure regresses when it exceeds baseline x (1 + PCT / 100): pick PCT above the
    run-to-run spread of the figure on your GPU (two runs of one commit in results/ differ by
    under 1% per layer kind on the H200)."""
    if metric not in CHECK_METRICS:
        raise UsageError(f"--metric {metric!r}: expected one of {tuple(CHECK_METRICS)}")
    current = load_with_progress(run, scheme)
    _refuse_partial(run, current, "run")
    bases, origin, base_knobs, shape_note = _baseline(
        baseline, current, scheme, allow_mismatch, last
    )
    from decodescope.analysis import metrics

    for what, kern in (("the baseline", bases[0]), ("the run", current.kernels)):
        if metrics.kind_table(kern).num_rows == 0:  # nothing per layer: no check to make
            where = baseline if what == "the baseline" else run
            raise UsageError(
                f"{where}: {what} has no per-layer figures (no kernel attributed to a layer): "
                "nothing to check"
            )
    result = regress.check(
        current,
        bases,
        max_regression,
        (*CHECK_METRICS[metric], "kernels"),
        max_kernel_increase_pct=max_kernel_increase,
    )
    knob_note = knob_difference(knobs_of(current.meta), base_knobs)
    share_notes = (
        share_lines(result, regress.check(current, bases, max_regression, ("share_us",)))
        if metric == "span"
        else []
    )
    if json_out:
        typer.echo(
            dumps(
                {
                    "ok": result.ok,
                    "reasons": result.reasons,
                    "baseline": origin,
                    "knobs_note": knob_note,
                    "shape_note": shape_note[0] if shape_note else None,
                    "setup_notes": shape_note,  # every line (shape, GPU, other setup fields)
                    "share_notes": share_notes,
                    "table": result.table,
                }
            )
        )
    else:
        console.print(f"baseline: {origin}", highlight=False, soft_wrap=True)
        for note in ([knob_note] if knob_note else []) + shape_note + share_notes:
            console.print(f"[yellow]note[/]: {note}", highlight=False, soft_wrap=True)
        console.print(arrow_table(result.table, "per layer kind: run vs baseline"))
        if result.ok:
            console.print(f"[green]ok[/]: no regression above {max_regression:g}%")
        else:
            console.print("[bold red]regression[/]:")
            for r in result.reasons:
                console.print(f"  - {r}", highlight=False, soft_wrap=True)
    raise typer.Exit(0 if result.ok else 1)
