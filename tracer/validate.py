"""Cross-checks of a capture: attribution of the toy workload, and torch.profiler (Kineto).

- :func:`op_sequences` / :func:`check_attribution`: per step, the kernels of each range
  (``layer.{i}.{block}.{op}``) — every step and every graph replay must show the same kernels in
  the same ops, and every op of the reference must be there.
- :func:`validate_against_kineto`: profiles the same workload, eager, with torch.profiler in a
  separate process (two CUPTI subscribers cannot share one), imports the JSON with
  :func:`decodescope.tracer.load`, and compares kernel counts per layer (equal) and per-kernel
  median durations (within 5%). Writes ``validation.json`` and ``validation.parquet`` into the
  run folder.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from decodescope.analysis.schema import Run
from decodescope.tracer import cupti_records as cr

TOLERANCE = 0.05


def attributed(run: Run) -> Run:
    """The run through :func:`decodescope.analysis.attribution.attribute`; without that module,
    range paths filled from the launch (eager) the same way, and no layer columns."""
    try:
        from decodescope.analysis.attribution import attribute
    except ImportError:
        attribute = None
    if attribute is not None:
        return attribute(run)
    k = run.kernels.to_pylist()
    paths = cr.innermost_paths(
        run.ranges.to_pylist(),
        ((x["launch_thread"], x["launch_start_ns"]) for x in k),
    )
    rp = [x["range_path"] or p for x, p in zip(k, paths, strict=True)]
    i = run.kernels.schema.get_field_index("range_path")
    col = pa.array(rp, pa.string()).dictionary_encode().cast(run.kernels.schema.field(i).type)
    return run.replace(kernels=run.kernels.set_column(i, run.kernels.schema.field(i), col))


def leaf(path: str | None) -> str:
    return path.rsplit("/", 1)[-1] if path else "(unattributed)"


def op_sequences(run: Run) -> dict[Any, list[tuple[str, str]]]:
    """step -> [(innermost range name, kernel name)] in start order."""
    k = attributed(run).kernels
    out: dict[Any, list[tuple[str, str]]] = defaultdict(list)
    rows = sorted(
        zip(
            k.column("step").to_pylist(),
            k.column("start_ns").to_pylist(),
            k.column("range_path").to_pylist(),
            k.column("name").to_pylist(),
            strict=True,
        ),
        key=lambda t: (t[0] is None, t[0] or 0, t[1]),
    )
    for step, _, path, name in rows:
        out[step].append((leaf(path), name or ""))
    return out


def check_attribution(run: Run, expected_ops: list[str], min_steps: int = 2) -> dict[str, Any]:
    """Every step holds kernels in every expected op, and the same kernels per op in each step."""
    seqs = op_sequences(run)
    steps = sorted(s for s in seqs if s is not None)
    problems: list[str] = []
    if None in seqs:
        problems.append(f"{len(seqs[None])} kernels have no step")
    if len(steps) < min_steps:
        problems.append(f"only {len(steps)} steps")
    ref = Counter(seqs[steps[0]]) if steps else Counter()
    missing = [op for op in expected_ops if not any(o == op for o, _ in ref)]
    if missing:
        problems.append(f"ops without kernels: {missing}")
    unattr = sum(n for (o, _), n in ref.items() if o not in expected_ops)
    if unattr:
        problems.append(f"{unattr} kernels per step outside the expected ops")
    differing = [s for s in steps[1:] if Counter(seqs[s]) != ref]
    if differing:
        problems.append(
            f"{len(differing)} steps differ from step {steps[0]} (first: {differing[0]})"
        )
    per_op: dict[str, list[str]] = defaultdict(list)
    for (o, name), n in sorted(ref.items()):
        per_op[o].extend([name] * n)
    return {
        "ok": not problems,
        "problems": problems,
        "steps": len(steps),
        "kernels_per_step": sum(ref.values()),
        "per_op": dict(per_op),
    }


# ---------------------------------------------------------------------------------------------
# torch.profiler cross-check

_KINETO_CHILD = r"""
import json, sys, threading
import torch
from decodescope.tracer import ranges as R
from decodescope.tracer.child import _find_workload

spec = json.loads(sys.argv[1])
_local = threading.local()
_enter, _exit = R.range.__enter__, R.range.__exit__
def enter(self):
    st = getattr(_local, "s", None) or []
    _local.s = st
    rf = torch.profiler.record_function(self.name); rf.__enter__(); st.append(rf)
    return _enter(self)
def exit_(self, *a):
    _exit(self, *a)
    _local.s.pop().__exit__(None, None, None)
R.range.__enter__, R.range.__exit__ = enter, exit_

wl = _find_workload(spec["workload"])(**spec.get("opts", {}))
if wl.refresh: wl.refresh()
for _ in range(max(1, spec.get("warmup", 3))):
    with R.range("warmup"): wl.step()
torch.cuda.synchronize()
acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
with torch.profiler.profile(activities=acts) as prof:
    for _ in range(spec.get("steps", 20)):
        with R.range("step"): wl.step()
    torch.cuda.synchronize()
prof.export_chrome_trace(spec["trace"])
"""


def _per_layer_counts(run: Run) -> dict[str, float]:
    k = run.kernels
    cols = k.column_names
    key = "layer" if "layer" in cols and k.column("layer").null_count < k.num_rows else None
    per: dict[tuple[Any, Any], int] = Counter()
    for row in zip(
        k.column("step").to_pylist(),
        (k.column(key) if key else k.column("range_path")).to_pylist(),
        strict=True,
    ):
        step, lay = row
        if key is None:
            lay = next(
                (
                    p
                    for p in reversed((lay or "").split("/"))
                    if p.startswith("layer.") and p.count(".") == 1
                ),
                None,
            )
        per[(step, lay)] += 1
    by_layer: dict[str, list[int]] = defaultdict(list)
    for (_, lay), n in per.items():
        by_layer[str(lay)].append(n)
    return {lay: statistics.median(v) for lay, v in sorted(by_layer.items())}


def _median_durations(run: Run) -> dict[tuple[str, int], tuple[float, int, str]]:
    """(innermost range, ordinal of the kernel within that range in its step) -> (median ns,
    calls, kernel name). Keyed by position, not by name, so that two tools' name spellings
    (demangled, shortened) cannot hide a kernel from the comparison."""
    k = run.kernels
    rows = sorted(
        zip(
            k.column("step").to_pylist(),
            k.column("start_ns").to_pylist(),
            k.column("end_ns").to_pylist(),
            k.column("range_path").to_pylist(),
            k.column("name").to_pylist(),
            strict=True,
        ),
        key=lambda t: (t[0] is None, t[0] or 0, t[1] or 0),
    )
    seen: Counter = Counter()
    d: dict[tuple[str, int], list[int]] = defaultdict(list)
    names: dict[tuple[str, int], str] = {}
    for step, s, e, path, name in rows:
        if s is None or e is None:
            continue
        op = leaf(path)
        i = seen[(step, op)]
        seen[(step, op)] += 1
        d[(op, i)].append(e - s)
        names.setdefault((op, i), name or "")
    return {key: (statistics.median(v), len(v), names[key]) for key, v in d.items()}


def compare_runs(
    ours: Run, kineto: Run, tolerance: float = TOLERANCE
) -> tuple[dict[str, Any], pa.Table]:
    """Per-layer kernel counts (medians over steps) and per-kernel median durations."""
    a, b = attributed(ours), attributed(kineto)
    la, lb = _per_layer_counts(a), _per_layer_counts(b)
    layers = sorted(set(la) | set(lb))
    count_rows = [{"layer": lay, "cupti": la.get(lay), "kineto": lb.get(lay)} for lay in layers]
    counts_equal = all(r["cupti"] == r["kineto"] for r in count_rows if r["layer"] not in ("None",))
    da, db = _median_durations(a), _median_durations(b)
    rows = []
    for key in sorted(set(da) | set(db)):
        ma, na, name_a = da.get(key, (None, 0, None))
        mb, nb, name_b = db.get(key, (None, 0, None))
        ratio = (ma / mb) if ma and mb else None
        rows.append(
            {
                "range": key[0],
                "ordinal": key[1],
                "name": name_a or name_b,
                "kineto_name": name_b,
                "cupti_median_ns": ma,
                "kineto_median_ns": mb,
                "cupti_calls": na,
                "kineto_calls": nb,
                "ratio": ratio,
                "within": ratio is not None and abs(ratio - 1) <= tolerance,
            }
        )
    both = [r for r in rows if r["ratio"] is not None]
    within = sum(r["within"] for r in both)
    ratios = sorted(r["ratio"] for r in both)
    summary = {
        "per_layer_counts": count_rows,
        "counts_equal": counts_equal,
        "kernels_compared": len(both),
        "kernels_within_tolerance": within,
        "median_ratio": statistics.median(ratios) if ratios else None,
        "durations_ok": bool(both) and abs(statistics.median(ratios) - 1) <= tolerance,
        "only_cupti": [
            f"{r['range']}#{r['ordinal']} {r['name']}" for r in rows if r["kineto_calls"] == 0
        ],
        "only_kineto": [
            f"{r['range']}#{r['ordinal']} {r['kineto_name']}" for r in rows if r["cupti_calls"] == 0
        ],
        "tolerance": tolerance,
    }
    summary["ok"] = summary["counts_equal"] and summary["durations_ok"]
    return summary, pa.Table.from_pylist(rows) if rows else pa.table(
        {"name": pa.array([], pa.string())}
    )


def profile_with_kineto(spec: dict[str, Any], trace: Path, timeout: float = 600) -> None:
    """Run the workload eager under torch.profiler in a fresh process; write its JSON trace."""
    env = dict(os.environ)
    env.pop("NVTX_INJECTION64_PATH", None)  # no second CUPTI client in that process
    job = {**spec, "trace": str(trace)}
    r = subprocess.run(
        [sys.executable, "-c", _KINETO_CHILD, json.dumps(job)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if r.returncode != 0 or not trace.exists():
        tail = " | ".join((r.stderr or "").strip().splitlines()[-3:])
        raise RuntimeError(f"torch.profiler child failed (code {r.returncode}): {tail}")


def validate_against_kineto(
    run_dir: str | os.PathLike[str], spec: dict[str, Any], *, keep_trace: bool = True
) -> dict[str, Any]:
    """Profile ``spec``'s workload with torch.profiler and compare it with the run in ``run_dir``."""
    from decodescope.tracer import load, read_run

    run_dir = Path(run_dir)
    ours = read_run(run_dir)
    with tempfile.TemporaryDirectory() as td:
        trace = Path(td) / "kineto.json"
        profile_with_kineto({**spec, "graph": False}, trace)
        kin = load(trace)
        if keep_trace:
            import gzip

            (run_dir / "kineto_trace.json.gz").write_bytes(gzip.compress(trace.read_bytes()))
    summary, table = compare_runs(ours, kin)
    summary["kineto_kernels"] = kin.kernels.num_rows
    summary["cupti_kernels"] = ours.kernels.num_rows
    (run_dir / "validation.json").write_text(json.dumps(summary, indent=2, default=str))
    pq.write_table(table, run_dir / "validation.parquet")
    return summary
