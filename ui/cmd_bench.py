"""``decodescope bench``: both decode paths under the same load, captured, side by side.

For each backend and batch: build the decode step (``--layers``, default ``dense,kda,mla``: K3's
dense layer 0 first, then both decoder layer kinds), capture it under a CUDA graph with the
tracer, append the run to a results dataset, then print the per-layer-kind table
(kernels, span, bytes floor, efficiency), the projected decode step of the full model and the
reference figures, each labelled with its hardware. The projection sums the measured dense span
for the model's one dense layer; a run without a dense layer (``--layers kda,mla``, the first
committed results/ runs) leaves it out and says so.

Every option, --out, --json and --runs-dir are checked before the first capture, then that an
NVIDIA driver is there (one line, exit 2). A job that fails (its capture, or appending its run to
--out) is one ``failed:`` line at the end, after the tables of the jobs that succeeded, and the
exit code is 1.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from decodescope.analysis import projection as proj
from decodescope.ui.cli import UsageError, app, console, err_console
from decodescope.ui.render import Fitted

BACKENDS = ("standard", "specialized")  # the workloads bench runs and tables side by side


def _ints(s: str, what: str) -> list[int]:
    items = [x.strip() for x in s.split(",")]
    if any(not x for x in items):
        raise UsageError(f"{what} expects comma-separated integers, got {s!r} (an empty item)")
    try:
        out = [int(x) for x in items]
    except ValueError:
        raise UsageError(f"{what} expects comma-separated integers, got {s!r}") from None
    if any(x <= 0 for x in out):
        raise UsageError(f"{what} expects positive integers, got {s!r}")
    return out


def _backends(s: str) -> list[str]:
    items = [x.strip() for x in s.split(",")]
    if any(not x for x in items):
        raise UsageError(f"--backends expects comma-separated names, got {s!r} (an empty item)")
    bad = [x for x in items if x not in BACKENDS]
    if bad:
        raise UsageError(f"--backends: unknown backend {bad[0]!r}; known: {', '.join(BACKENDS)}")
    return list(dict.fromkeys(items))


def _check_model(preset: str, tp_shape: int, layers: str, allreduce: str, spec_allreduce: str):
    """--preset / --tp-shape through kernels.config.get_config, --layers through the standard
    model's parse_layers, the all-reduce choices against the two paths' own lists."""
    from decodescope.kernels.config import get_config

    try:
        cfg = get_config(preset, tp_shape)
    except ValueError as e:
        raise UsageError(f"--preset {preset} --tp-shape {tp_shape}: {e}") from None
    from decodescope.kernels.specialized.step import ALLREDUCES
    from decodescope.kernels.standard.comm import ALLREDUCE_IMPLS
    from decodescope.kernels.standard.model import parse_layers

    try:
        parse_layers(cfg, layers)
    except ValueError as e:
        raise UsageError(f"--layers: {e}") from None
    if allreduce not in ALLREDUCE_IMPLS:
        raise UsageError(
            f"--allreduce must be one of {', '.join(ALLREDUCE_IMPLS)}, got {allreduce!r}"
        )
    if spec_allreduce not in ALLREDUCES:
        raise UsageError(
            f"--spec-allreduce must be one of {', '.join(ALLREDUCES)}, got {spec_allreduce!r}"
        )


def _check_dataset(out: Path) -> None:
    """--out: a results dataset, an empty folder or one that can be made (as append_run takes)."""
    from decodescope.ui.cmd_capture import folder_problem

    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: exists and is not a folder (a results dataset is a folder)")
    if out.is_dir():
        try:
            entries = any(out.iterdir())
        except OSError as e:
            raise UsageError(f"--out {out}: cannot be listed ({e.strerror or e})") from None
        if entries and not (out / "runs").is_dir():
            raise UsageError(
                f"--out {out}: a folder that is neither empty nor a results dataset (no runs/)"
            )
    why = folder_problem(out)
    if why:
        raise UsageError(f"--out {out}: {why}")


def _check_json(path: Path) -> None:
    from decodescope.ui.cmd_capture import folder_problem

    if path.is_dir():
        raise UsageError(f"--json {path}: is a folder, not a file")
    if os.path.lexists(path) and not path.is_file():
        raise UsageError(f"--json {path}: exists and is not a file")
    why = folder_problem(path.absolute().parent)
    if why:
        raise UsageError(f"--json {path}: {why}")


def _write_json(path: Path, payload: dict) -> str | None:
    """Write ``payload`` to ``path`` whole (a temporary file beside it, then renamed); why not,
    in one line, or None."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(payload, indent=1, default=str))
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        return f"--json {path}: cannot write it ({e.strerror or e})"
    return None


def kind_rows(run, backend: str, batch: int, tokens_per_seq: int) -> list[dict]:
    """Per layer kind of one captured run: kernels, span, floor and efficiency. A run of several
    ranks gives rank 0's figures, with the ranks' skew (median start skew over layers and steps,
    analysis.metrics.rank_skew) and every rank's span in ``rank_span_us``."""
    import pyarrow.compute as pc

    from decodescope.analysis.metrics import kind_table, rank_kind_table, ranks_of, skew_table

    kern = run.kernels
    ranks = ranks_of(kern)
    skew: dict[str, list] = {}
    rank_span: dict[str, dict[int, float]] = {}
    if len(ranks) > 1:
        for r in skew_table(kern).to_pylist():
            skew.setdefault(r["layer_kind"], []).append((r["start_skew_us"], r["end_skew_us"]))
        for r in rank_kind_table(kern).to_pylist():
            rank_span.setdefault(r["layer_kind"], {})[r["rank"]] = r["span_us"]
        kern = kern.filter(pc.equal(pc.fill_null(kern["rank"], 0), ranks[0]))
    kt = kind_table(kern).to_pylist()
    bw = run.meta.copy_bw_tbs
    lb = run.meta.layer_bytes or {}
    rows = []
    for r in kt:
        kind = r["layer_kind"]
        floor = proj.bytes_floor_us(lb[kind], bw) if (bw and lb.get(kind)) else None
        rows.append(
            {
                "backend": backend,
                "batch": batch,
                "tokens_per_seq": tokens_per_seq,
                "layer_kind": kind,
                "layers": r["layers"],
                "kernels": r["kernels"],
                "span_us": r["span_us"],
                "span_us_min": r["span_us_min"],
                "span_us_max": r["span_us_max"],
                "busy_us": r["busy_us"],
                "gaps_us": r["gaps_us"],
                "share_us": r.get("share_us"),
                "layer_bytes": lb.get(kind),
                "copy_bw_tbs": bw,
                "gemm_tflops": run.meta.gemm_tflops,
                "floor_us": floor,
                "efficiency": (r["span_us"] / floor) if floor else None,
                "share_efficiency": (r["share_us"] / floor)
                if (floor and r.get("share_us") is not None)
                else None,
                "run_id": run.run_id,
            }
        )
        if len(ranks) > 1:
            sk = sorted(skew.get(kind, []))
            rows[-1].update(
                ranks=len(ranks),
                skew_us=sk[len(sk) // 2][0] if sk else None,
                end_skew_us=sk[len(sk) // 2][1] if sk else None,
                rank_span_us=rank_span.get(kind),
            )
    return rows


def _fmt(x, nd=1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:,.0f}" if (nd == 1 and x.is_integer() and abs(x) < 1000) else f"{x:,.{nd}f}"
    return f"{x:,}"


def _layer_table(rows: list[dict], meta_line: str) -> Table:
    t = Table(
        title=f"Per layer (one layer + its MoE block or dense MLP, one step; {meta_line})",
        title_justify="left",
    )
    for c in (
        "kind",
        "batch",
        "tok/seq",
        "std kernels",
        "spec kernels",
        "std us",
        "spec us",
        "speedup",
        "floor us",
        "std x floor",
        "spec x floor",
        "std share",
        "spec share",
        "spec share x floor",
        "share speedup",
    ):
        t.add_column(c, justify="left" if c == "kind" else "right")
    t.caption = (
        "us: layer span (first kernel start to last kernel end); share: the layer's share of the "
        "step (from the later of its first start and the previous layer's end), smaller where "
        "its first kernel waits early under programmatic dependent launch; projections sum shares"
    )
    keyed = {(r["backend"], r["layer_kind"], r["batch"], r["tokens_per_seq"]): r for r in rows}
    keys = sorted({(r["layer_kind"], r["batch"], r["tokens_per_seq"]) for r in rows})
    for kind, batch, tps in keys:
        s = keyed.get(("standard", kind, batch, tps))
        p = keyed.get(("specialized", kind, batch, tps))
        floor = pair_floor(s, p)  # one floor per row, every ratio of the row on it

        def per_floor(r, key, floor=floor):  # every ratio of the row on the row's one floor
            return f"{r[key] / floor:.2f}" if (r and floor and r.get(key) is not None) else "-"

        t.add_row(
            kind,
            str(batch),
            str(tps),
            _fmt(s and s["kernels"]),
            _fmt(p and p["kernels"]),
            _fmt(s and s["span_us"]),
            _fmt(p and p["span_us"]),
            f"{s['span_us'] / p['span_us']:.2f}x" if (s and p) else "-",
            _fmt(floor),
            per_floor(s, "span_us"),
            per_floor(p, "span_us"),
            _fmt(s and s.get("share_us")),
            _fmt(p and p.get("share_us")),
            per_floor(p, "share_us"),
            f"{s['share_us'] / p['share_us']:.2f}x"
            if (s and p and s.get("share_us") and p.get("share_us"))
            else "-",
        )
    return t


def pair_floor(std: dict | None, spec: dict | None) -> float | None:
    """The floor both paths of a setup are held to: the lower of the two runs' floors. Each run
    divides its layer's bytes (the same weights and, from the same seed, nearly the same experts)
    by the copy bandwidth measured in its own process, and that measurement varies by a few
    percent from process to process (3.90-4.19 TB/s over the H200 runs in results/). The lower
    floor is the faster copy: a slow copy measurement in one run cannot lift a floor above what
    the device was seen to do and show a layer faster than its floor."""
    floors = [r["floor_us"] for r in (std, spec) if r and r.get("floor_us")]
    return min(floors) if floors else None


def _rank_table(rows: list[dict]) -> Table:
    """Runs of several ranks: each rank's span and the skew between the ranks (median over the
    layers and steps; start skew = spread of the ranks' layer start times, end skew = of the
    ends)."""
    t = Table(title="Per rank (the table above shows rank 0)", title_justify="left")
    for c in ("backend", "kind", "batch", "tok/seq", "span us per rank", "start skew us",
              "end skew us"):  # fmt: skip
        t.add_column(c, justify="left" if c in ("backend", "kind") else "right")
    for r in rows:
        if not r.get("ranks"):
            continue
        spans = r.get("rank_span_us") or {}
        t.add_row(
            r["backend"], r["layer_kind"], str(r["batch"]), str(r["tokens_per_seq"]),
            " / ".join(_fmt(spans[k]) for k in sorted(spans)),
            _fmt(r.get("skew_us")), _fmt(r.get("end_skew_us")),
        )  # fmt: skip
    return t


def projections(rows: list[dict], acceptance: float) -> list[dict]:
    """Projected full-model decode steps per (backend, batch, tokens_per_seq): the sum of the
    layers' shares of the step (``share_us``, analysis.metrics), or of their spans for rows
    without a share."""
    out = []
    groups: dict[tuple, dict[str, float]] = {}
    for r in rows:
        v = r.get("share_us")
        groups.setdefault((r["backend"], r["batch"], r["tokens_per_seq"]), {})[r["layer_kind"]] = (
            r["span_us"] if v is None else v
        )
    for (backend, batch, tps), spans in sorted(groups.items(), key=lambda kv: str(kv[0])):
        if not batch:  # a run that does not record its batch (an imported trace): no step
            continue
        tps = tps or 1
        accepted = acceptance if tps > 1 else 1.0
        try:
            p = proj.project_step(spans, batch, tokens_per_seq=accepted)
        except ValueError:
            continue
        out.append(
            {
                "backend": backend,
                "batch": batch,
                "tokens_per_seq": tps,
                "accepted_per_step": accepted,
                "step_us": p.step_us,
                "tok_s": p.tok_s,
                "label": p.label,
                "dense_layer": "measured" if p.dense_measured else "excluded (not measured)",
            }
        )
    return out


def dense_line(prows: list[dict], layers: str) -> str:
    """One line: whether the projection summed a measured dense layer 0 or left it out."""
    how = sorted({r.get("dense_layer", "") for r in prows} - {""})
    if how == ["measured"]:
        return "dense layer 0: measured (its span is summed once into each projected step)"
    if "measured" in how:
        return "dense layer 0: measured in some runs only (see each projection's label)"
    return (
        f"dense layer 0: excluded (not measured): no run holds a dense layer (asked for "
        f"--layers {layers}); the projected steps leave it out"
    )


def _projection_table(prows: list[dict], meta_line: str) -> Table:
    t = Table(
        title=f"PROJECTION: full model (69 KDA + 24 MLA + 1 dense) from per-layer shares of the step; {meta_line}",
        title_justify="left",
    )
    for c in (
        "batch",
        "tok/seq",
        "std step ms",
        "spec step ms",
        "std tok/s",
        "spec tok/s",
        "ratio",
    ):
        t.add_column(c, justify="right")
    keyed = {(r["backend"], r["batch"], r["tokens_per_seq"]): r for r in prows}
    for batch, tps in sorted({(r["batch"], r["tokens_per_seq"]) for r in prows}):
        s = keyed.get(("standard", batch, tps))
        p = keyed.get(("specialized", batch, tps))
        t.add_row(
            str(batch),
            str(tps),
            _fmt(s and s["step_us"] / 1e3, 2),
            _fmt(p and p["step_us"] / 1e3, 2),
            _fmt(s and s["tok_s"]),
            _fmt(p and p["tok_s"]),
            f"{p['tok_s'] / s['tok_s']:.2f}x" if (s and p) else "-",
        )
    labels = sorted({r["label"] for r in prows})
    t.caption = "; ".join(labels) + ". Not a served-request measurement."
    return t


def impl_line(run) -> str | None:
    """Where a run's ops came from (``op_impl`` of its workload config): counts per source
    (vLLM's compiled ops, decodescope's Triton stand-ins, torch/cuBLAS, CuTe DSL), and for the
    standard path why vLLM's were not used when none were. None for runs that do not record it
    (imports of other tools' traces)."""
    wl = (run.meta.config or {}).get("workload") or {}
    impl = wl.get("op_impl")
    if not impl:
        return None
    counts: dict[str, int] = {}
    for v in impl.values():
        src = str(v).split(":", 1)[0]
        counts[src] = counts.get(src, 0) + 1
    parts = ", ".join(f"{n} {src}" for src, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    backend = run.meta.backend or "?"
    line = f"{backend} ops of {run.run_id}: {parts}"
    if backend == "standard" and not wl.get("vllm_ops"):
        why = "; ".join(wl.get("vllm_ops_errors") or []) or "not found"
        line += f" -- WITHOUT vLLM's compiled ops ({why}): not the vLLM baseline"
    return line


def chunk_lines(runs) -> list[str]:
    """One line per run whose step ran in sequence chunks (:func:`.cmd_report.chunk_note`), so
    that a point where the specialized path re-reads its weights per chunk says so beside the
    tables: ``"specialized 32x8: 4 chunks of 8 sequences (256 tokens per step): ..."``."""
    from decodescope.ui.cmd_report import chunk_note

    out = []
    for run in runs:
        note = chunk_note(run.meta)
        if note:
            m = run.meta
            point = f"{m.batch}x{m.tokens_per_seq}" if (m.tokens_per_seq or 1) > 1 else f"{m.batch}"
            out.append(f"{m.backend} {point}: ran in {note}")
    return out


def _reference_table() -> Table:
    ref = proj.REFERENCE
    t = Table(title=f"Reference (published): {proj.REFERENCE_HARDWARE}", title_justify="left")
    for c in ("figure", "standard", "specialized", "ratio"):
        t.add_column(c, justify="left" if c == "figure" else "right")
    pl = ref["per_layer"]
    t.add_row(
        "per-layer trace",
        f"{pl['standard']['kernels']} kernels, {pl['standard']['span_us']:.0f} us",
        f"{pl['specialized']['kernels']} kernels, {pl['specialized']['span_us']:.0f} us",
        f"{pl['ratio']:.2f}x",
    )
    for what, batch, std, spec, ratio in ref["tok_s"]:
        t.add_row(f"decode tok/s, batch {batch}, {what}", _fmt(std), _fmt(spec), f"{ratio:.2f}x")
    return t


BENCH_HELP = (
    "Run both decode paths under CUDA graphs, capture, and print the reference-style table.\n\n"
    "Options and output paths are checked before the first capture, then that an NVIDIA driver "
    "is there. Exit code 1 when any job failed (the tables of the jobs that succeeded and one "
    "'failed:' line per failure are printed first) or the --json file could not be written."
)


@app.command("bench", help=BENCH_HELP)
def bench_cmd(
    preset: str = typer.Option("kimi-k3", help="Model preset (kernels/config.py)."),
    tp_shape: int = typer.Option(8, "--tp-shape", help="Per-rank shapes of this TP size."),
    batch: str = typer.Option("1,8,32,64", help="Comma-separated batch sizes."),
    spec_verify: int = typer.Option(
        0, "--spec-verify", help="Also run the verify step with 1+K tokens per sequence."
    ),
    acceptance: float = typer.Option(
        6.0, help="Synthetic acceptance length for --spec-verify (tokens accepted per step)."
    ),
    verify_only: bool = typer.Option(
        False,
        "--verify-only",
        help="With --spec-verify: run the verify step only (no one-token rows).",
    ),
    backends: str = typer.Option("standard,specialized", help="Backends to run."),
    layers: str = typer.Option(
        "dense,kda,mla",
        help="Layer kinds in the captured step (dense = K3's layer 0: attention + dense MLP).",
    ),
    replays: int = typer.Option(
        30, min=1, help="Graph replays captured per run (medians over them)."
    ),
    warmup: int = typer.Option(5, min=0, help="Warm-up steps before capture."),
    out: Path | None = typer.Option(None, "--out", help="Results dataset to append the runs to."),
    runs_dir: Path | None = typer.Option(None, "--runs-dir", help="Keep the run folders here."),
    timeout: float = typer.Option(900.0, help="Seconds allowed per capture."),
    json_out: Path | None = typer.Option(None, "--json", help="Write all tables as JSON here."),
    tp_world: int = typer.Option(
        1,
        "--tp-world",
        min=1,
        max=2,
        help="GPUs that really run, 1 or 2 (one process per rank, real all-reduces).",
    ),
    allreduce: str = typer.Option(
        "nccl",
        "--allreduce",
        help="Standard path's all-reduce at --tp-world > 1: nccl|oneshot (the specialized path "
        "reduces inside its fused kernels, --tp-world 2 only).",
    ),
    spec_allreduce: str = typer.Option(
        "fused",
        "--spec-allreduce",
        help="Specialized path's reductions at --tp-world 2: fused (inside its kernels, peer "
        "memory) | nccl (explicit NCCL all-reduce launches around its single-GPU kernels).",
    ),
    require_vllm_ops: bool = typer.Option(
        False,
        "--require-vllm-ops",
        help="Refuse to run (exit 2) where vLLM's compiled ops are not there (vllm installed, or "
        "VLLM_OPS_DIR), and keep a standard run that ran without them out of --out: without "
        "them the standard path is not the vLLM baseline.",
    ),
) -> None:
    """Run both decode paths under CUDA graphs, capture, and print the reference-style table
    (``BENCH_HELP``, what ``--help`` shows)."""
    from decodescope import tracer
    from decodescope.tracer.capture import run_capture
    from decodescope.ui.cmd_capture import require_cuda_driver

    batches = _ints(batch, "--batch")
    bks = _backends(backends)
    if spec_verify < 0 or spec_verify > 7:
        raise UsageError("--spec-verify takes 0..7 draft tokens")
    if verify_only and not spec_verify:
        raise UsageError("--verify-only needs --spec-verify K (the verify step's draft tokens)")
    if not acceptance > 0:
        raise UsageError(f"--acceptance must be > 0 tokens per step, got {acceptance:g}")
    if not timeout > 0:
        raise UsageError(f"--timeout must be > 0 seconds, got {timeout:g}")
    _check_model(preset, tp_shape, layers, allreduce, spec_allreduce)
    if out is not None:
        _check_dataset(out)
    if json_out is not None:  # fail before the captures, not after them
        _check_json(json_out)
    if runs_dir is not None:
        from decodescope.ui.cmd_capture import folder_problem

        why = folder_problem(runs_dir)
        if why:
            raise UsageError(f"--runs-dir {runs_dir}: {why}")
    if require_vllm_ops and "standard" in bks:
        from decodescope.kernels import vllm_ops

        why = vllm_ops.missing()
        if why:
            raise UsageError(
                f"--require-vllm-ops: vLLM's compiled ops are not there ({why}); without them the "
                "standard path is not the vLLM baseline"
            )
    require_cuda_driver("bench")
    tps_list = ([] if verify_only else [1]) + ([1 + spec_verify] if spec_verify else [])
    jobs = [(b, n, t) for t in tps_list for n in batches for b in bks]
    root = Path(runs_dir) if runs_dir else Path(tempfile.mkdtemp(prefix="decodescope-bench-"))
    rows: list[dict] = []
    failures: list[str] = []
    runs = []
    appended = 0
    with Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=err_console,
    ) as progress:
        task = progress.add_task("bench", total=len(jobs))
        for backend, n, tps in jobs:
            name = f"{backend}-{preset}-tp{tp_shape}-b{n}-t{tps}"
            if tp_world > 1:
                name = f"{backend}-{preset}-tp{tp_shape}-w{tp_world}-b{n}-t{tps}"
            progress.update(task, description=name)
            spec = {
                "workload": backend,
                "opts": {
                    "preset": preset,
                    "tp_shape": tp_shape,
                    "batch": n,
                    "tokens_per_seq": tps,
                    "layers": layers,
                },
                "graph": True,
                "steps": replays,
                "warmup": warmup,
                "copy_bw": True,
            }
            if tp_world > 1:
                spec["opts"]["tp_world"] = tp_world
                if backend == "standard":
                    spec["opts"]["allreduce"] = allreduce
                elif backend == "specialized":
                    spec["opts"]["allreduce"] = spec_allreduce
            try:
                if tp_world > 1:
                    from decodescope.tracer.distributed import run_distributed_capture

                    res = run_distributed_capture(
                        spec, tp_world, out=root / name, timeout=timeout, echo=False
                    )
                else:
                    res = run_capture(spec, out=root / name, timeout=timeout, echo=False)
            except Exception as e:  # a run that fails is reported; the others go on
                failures.append(f"{name}: {' '.join(str(e).split())}")
                progress.advance(task)
                continue
            if not res.ok:
                failures.append(f"{name}: {res.message}")
                progress.advance(task)
                continue
            run = tracer.load(res.out)
            if require_vllm_ops and backend == "standard":
                from decodescope.ui.cmd_demo import without_vllm

                if without_vllm(run.meta):  # found but not loaded: not the baseline asked for
                    failures.append(f"{name}: {impl_line(run)} (--require-vllm-ops)")
                    progress.advance(task)
                    continue
            runs.append(run)
            if out is not None:  # each run as it completes: a later failure or timeout keeps it
                from decodescope.tracer.dataset import append_run

                try:
                    append_run(run, out, replace=True)
                    appended += 1
                except Exception as e:  # the run stays in its folder; the bench goes on
                    failures.append(f"{name}: not appended to {out}: {' '.join(str(e).split())}")
            rows.extend(kind_rows(run, backend, n, tps))
            progress.advance(task)
    meta = runs[0].meta if runs else None
    meta_line = (
        f"{meta.gpu or 'GPU ?'} x{meta.tp_world or 1}, tp_shape {tp_shape}, "
        f"tp_world {meta.tp_world or 1}, {preset}"
        if meta
        else f"tp_shape {tp_shape}, {preset}"
    )
    if rows:
        console.print(Fitted(_layer_table(rows, meta_line), keys=3))
        if any(r.get("ranks") for r in rows):
            console.print(Fitted(_rank_table(rows)))
        prows = projections(rows, acceptance)
        if prows:
            console.print(Fitted(_projection_table(prows, meta_line), keys=2))
            console.print(dense_line(prows, layers), highlight=False)
        for line in chunk_lines(runs):
            console.print(line, highlight=False, soft_wrap=True)
    else:
        prows = []
    console.print(Fitted(_reference_table()))
    seen: set[str] = set()
    for run in runs:  # which ops ran: vLLM's or the stand-ins (never silent), once per mix
        line = impl_line(run)
        key = line and f"{run.meta.backend}: {line.split(': ', 1)[1]}"
        if line is not None and key not in seen:
            seen.add(key)
            console.print(line, highlight=False, soft_wrap=True)
    json_error = None
    if json_out is not None:
        payload = {"layers": rows, "projections": prows, "failures": failures, "meta": meta_line}
        json_error = _write_json(json_out, payload)
    for f in failures:
        err_console.print(f"[bold red]failed:[/] {f}", highlight=False, soft_wrap=True)
    console.print(f"run folders: {root}")
    if out is not None:
        console.print(f"{appended} run(s) appended to {out}")
    if json_error:
        err_console.print(f"[bold red]error:[/] {json_error}", highlight=False, soft_wrap=True)
    if failures or json_error:
        raise typer.Exit(1)


__all__ = ["bench_cmd", "chunk_lines", "impl_line", "kind_rows", "projections"]
