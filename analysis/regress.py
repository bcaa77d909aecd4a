"""Regression check: a run against a baseline run, or against the median of several baseline runs.

Per layer kind, the run's median span and kernel count are compared with the baseline's; a
figure above ``baseline * (1 + pct / 100)`` is a regression. A layer kind the baseline has and
the run lacks is a regression too (work moved out of the layers is not a speed-up). Pure.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from decodescope.analysis import metrics
from decodescope.analysis.schema import Run

__all__ = ["CheckResult", "check", "baseline_kinds", "noun", "TIME_METRICS"]

DEFAULT_METRICS = ("span_us", "kernels")
# the time figures a check can judge beside the kernel count (``check --metric``, the dashboard's
# history): the layer span (DESIGN's), its share of the step (what a layer adds where a path
# starts its first kernel early under programmatic dependent launch), or both
TIME_METRICS = {"span": ("span_us",), "share": ("share_us",), "both": ("span_us", "share_us")}


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """``ok`` is False when any reason was found; ``table`` holds the figures per layer kind."""

    ok: bool
    reasons: list[str]
    table: pa.Table


def _kernels(x: Run | pa.Table) -> pa.Table:
    return x.kernels if isinstance(x, Run) else x


def _split_runs(x: Run | pa.Table | Sequence[Run | pa.Table]) -> list[pa.Table]:
    """The kernels tables of one or several baseline runs (a table with many run_ids splits)."""
    items = list(x) if isinstance(x, Sequence) and not isinstance(x, pa.Table) else [x]
    out = []
    for it in items:
        k = _kernels(it)
        ids = pc.unique(k["run_id"].cast(pa.string())).to_pylist() if k.num_rows else []
        if len(ids) <= 1:
            out.append(k)
        else:
            col = k["run_id"].cast(pa.string())
            out.extend(k.filter(pc.equal(col, rid)) for rid in ids)
    return out


def baseline_kinds(baselines: Sequence[pa.Table], ms: Sequence[str]) -> pa.Table:
    """Per layer kind: the median over baseline runs of each run's per-kind median, and the
    number of runs that have the kind."""
    per_run = [metrics.kind_table(k).select(["layer_kind", *ms]) for k in baselines]
    if not per_run:
        raise ValueError("no baseline runs")
    t = pa.concat_tables(per_run)
    out = metrics.group_stats(t, ["layer_kind"], tuple(ms), "runs")
    return out.select(["layer_kind", "runs", *ms])


def check(
    run_tables: Run | pa.Table,
    baseline_tables: Run | pa.Table | Sequence[Run | pa.Table],
    max_regression_pct: float,
    metrics: Sequence[str] = DEFAULT_METRICS,
    *,
    max_kernel_increase_pct: float | None = None,
) -> CheckResult:
    """Compare ``run_tables`` (a Run or its kernels table) with a baseline (one run, or several
    whose per-kind medians are medianed). ``max_kernel_increase_pct`` overrides the threshold for
    the kernel count (default: ``max_regression_pct``)."""
    if max_regression_pct < 0:
        raise ValueError("max_regression_pct must be >= 0")
    ms = list(metrics)
    unknown = [m for m in ms if m not in _metrics_known()]
    if unknown:
        raise ValueError(f"unknown metrics {unknown}; known: {sorted(_metrics_known())}")
    run_k = _kernels(run_tables)
    base = baseline_kinds(_split_runs(baseline_tables), ms)
    cur = _kind_metrics(run_k, ms)
    b_rows = {r["layer_kind"]: r for r in base.to_pylist()}
    c_rows = {r["layer_kind"]: r for r in cur.to_pylist()}
    reasons: list[str] = []
    rows = []
    for kind in sorted(set(b_rows) | set(c_rows)):
        b = b_rows.get(kind)
        c = c_rows.get(kind)
        if b is None:
            rows.append(_row(kind, None, c, ms, None, "new"))
            continue
        if c is None:
            reasons.append(f"{noun(kind)}s: in the baseline, missing from the run")
            rows.append(_row(kind, b, None, ms, None, "missing"))
            continue
        status = "ok"
        for m in ms:
            limit_pct = max_regression_pct
            if m == "kernels" and max_kernel_increase_pct is not None:
                limit_pct = max_kernel_increase_pct
            bv, cv = b[m], c[m]
            if bv is None or cv is None or math.isnan(bv) or math.isnan(cv):
                continue
            limit = bv * (1 + limit_pct / 100.0)
            if cv > limit + 1e-9:
                pct = (cv / bv - 1) * 100 if bv else math.inf
                reasons.append(
                    f"{noun(kind)} {_label(m)}: {_fmt(cv)} vs baseline {_fmt(bv)} "
                    f"(+{pct:.1f}%, limit +{limit_pct:g}%)"
                )
                status = "regression"
        rows.append(_row(kind, b, c, ms, b.get("runs"), status))
    if not b_rows:
        reasons.append("the baseline has no per-layer figures (no kernel attributed to a layer)")
    table = _table(rows, ms)
    return CheckResult(ok=not reasons, reasons=reasons, table=table)


def _metrics_known() -> set[str]:
    return set(metrics.METRICS)


def _kind_metrics(kernels: pa.Table, ms: Sequence[str]) -> pa.Table:
    return metrics.kind_table(kernels).select(["layer_kind", *ms])


def noun(kind: str) -> str:
    """ "KDA layer", "layer" (for runs whose layers have no kind)."""
    if kind in ("layer", "(none)"):
        return "layer"
    return f"{kind.upper() if kind in ('kda', 'mla') else kind} layer"


def _label(m: str) -> str:
    return {"span_us": "span (us)", "kernels": "kernels", "busy_us": "busy (us)",
            "share_us": "share (us)"}.get(m, m)  # fmt: skip


def _fmt(x: float) -> str:
    return f"{x:.0f}" if abs(x - round(x)) < 1e-9 else f"{x:.2f}"


def _row(kind, b, c, ms, runs, status):
    row = {"layer_kind": kind, "status": status, "baseline_runs": runs}
    for m in ms:
        bv = None if b is None else b[m]
        cv = None if c is None else c[m]
        row[f"baseline_{m}"] = bv
        row[f"run_{m}"] = cv
        row[f"{m}_change_pct"] = (
            (cv / bv - 1) * 100
            if bv not in (None, 0) and cv is not None and not np.isnan(bv)
            else None
        )
    return row


def _table(rows: list[dict], ms: Sequence[str]) -> pa.Table:
    fields = [("layer_kind", pa.string()), ("status", pa.string()), ("baseline_runs", pa.int64())]
    for m in ms:
        fields += [
            (f"baseline_{m}", pa.float64()),
            (f"run_{m}", pa.float64()),
            (f"{m}_change_pct", pa.float64()),
        ]
    return pa.Table.from_pylist(rows, schema=pa.schema(fields))
