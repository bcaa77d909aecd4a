"""A knob's A/B from `decodescope bench --json` files: each mode against the mean of the baseline.

    python scripts/ab_modes.py default=t16d.json,t16d2.json auto=t16a.json,t16a2.json \
        issued=t16i.json,t16i2.json [--layer mla] [--json]

The first mode is the baseline. Per (tp_shape, batch, tokens per sequence) point and for each
other mode: the layer's span difference (mean of the mode's runs minus the baseline's mean), its
share difference and the projected step difference per run (so that a rule set before the runs,
"in every run within +x", can be read off), and the baseline's own spread between its runs (the
noise a difference has to beat). Used for notes/specialized.md "Outcome of part 43".

With ``--ops DATASET`` (the bench's ``--out`` folder, where its runs' kernels were exported) it
prints, for the same layer, each kernel's duration per point and op instead: the median over
the run's replays and layers, per run, each mode's runs against the baseline's mean, and the
kernel's registers per thread where a mode changed them. Under programmatic dependent launch a
kernel's duration includes the time it waits for the one before, so a difference there can be
its predecessor's. Kernels that only a mode ran are listed too (``new``: that mode's own
durations), and each op ends with its total (the sum of its kernels' medians), so that a knob
that replaces kernels reads as one number per op. Several datasets: join them by commas. Used
for notes/specialized.md "Outcome of part 45" and "Outcome of part 52".

    python scripts/ab_modes.py default=t8d.json,t8d2.json rn=t8r.json,t8r2.json \
        --layer mla --ops ab [--min-us 0.3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


class ABError(ValueError):
    pass


def _load(path: str) -> dict:
    p = Path(path)
    try:
        d = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ABError(
            f"{path}: not a readable bench JSON file ({e.__class__.__name__}: {e})"
        ) from e
    if not isinstance(d, dict) or "layers" not in d or "projections" not in d:
        raise ABError(
            f"{path}: not a `decodescope bench --json` file (no 'layers' / 'projections')"
        )
    return {"layers": d["layers"], "projections": d["projections"], "meta": str(d.get("meta", ""))}


def _point(row: dict) -> tuple[int, int]:
    return int(row["batch"]), int(row.get("tokens_per_seq", 1))


def collect(files: list[str], layer: str) -> dict[tuple[int, int], list[dict]]:
    """Per (batch, tokens per sequence): one dict per run with span, share and step (us)."""
    out: dict[tuple[int, int], list[dict]] = {}
    for f in files:
        d = _load(f)
        steps = {
            _point(p): p["step_us"] for p in d["projections"] if p.get("backend") == "specialized"
        }
        for L in d["layers"]:
            if L.get("backend") != "specialized" or L.get("layer_kind") != layer:
                continue
            k = _point(L)
            out.setdefault(k, []).append(
                {"span": L["span_us"], "share": L["share_us"], "step": steps.get(k), "file": f}
            )
    return out


def compare(modes: list[tuple[str, list[str]]], layer: str = "mla") -> list[dict]:
    if len(modes) < 2:
        raise ABError("give at least two modes: the baseline first, then the others")
    metas = {_load(f)["meta"]: f for _, files in modes for f in files}
    if len(metas) > 1:
        a, b = list(metas.items())[:2]
        raise ABError(
            f"{b[1]}: another setup ('{b[0]}') than {a[1]} ('{a[0]}'): compare one setup at a time"
        )
    base_name, base_files = modes[0]
    base = collect(base_files, layer)
    rows = []
    for point in sorted(base):
        b = base[point]
        b_span = statistics.mean(r["span"] for r in b)
        b_share = statistics.mean(r["share"] for r in b)
        b_steps = [r["step"] for r in b if r["step"] is not None]
        row = {
            "batch": point[0],
            "tokens_per_seq": point[1],
            "baseline": base_name,
            "baseline_runs": len(b),
            "baseline_step_spread_us": (max(b_steps) - min(b_steps)) if len(b_steps) > 1 else None,
            "modes": {},
        }
        b_step = statistics.mean(b_steps) if b_steps else None
        for name, files in modes[1:]:
            m = collect(files, layer).get(point)
            if not m:
                row["modes"][name] = None
                continue
            row["modes"][name] = {
                "span_us": statistics.mean(r["span"] for r in m) - b_span,
                "share_us": [r["share"] - b_share for r in m],
                "step_us": [
                    None if r["step"] is None or b_step is None else r["step"] - b_step for r in m
                ],
            }
        rows.append(row)
    return rows


def _run_ids(files: list[str], layer: str) -> dict[str, tuple[int, int]]:
    """run_id -> (batch, tokens per sequence) of the specialized runs in ``files``."""
    out = {}
    for f in files:
        for L in _load(f)["layers"]:
            if (
                L.get("backend") == "specialized"
                and L.get("layer_kind") == layer
                and L.get("run_id")
            ):
                out[L["run_id"]] = _point(L)
    return out


TOTAL = "(op total)"


def op_kernels(dataset: str, files: list[str], layer: str) -> dict:
    """Per (point, op, kernel): per run, (median duration in us, registers per thread), from the
    kernels table of ``dataset`` (Hive partitions, as ``decodescope export`` / bench's ``--out``
    write it; several folders joined by commas) for the runs named in ``files``. Each op also
    gets a row ``(op total)``: per run, the sum of its kernels' medians (registers 0)."""
    import pyarrow as pa

    from decodescope.analysis.timeline import short_name
    from decodescope.tracer.dataset import read_table
    from decodescope.tracer.errors import TraceError

    ids = _run_ids(files, layer)
    cols = ["run_id", "layer_kind", "op", "name", "start_ns", "end_ns", "registers"]
    tables = []
    for folder in [d for d in dataset.split(",") if d]:
        try:
            tables.append(read_table(folder, "kernels", list(ids)).select(cols))
        except TraceError as e:
            raise ABError(f"{e} (give the bench's --out folder)") from None
    t = pa.concat_tables(tables)
    missing = sorted(set(ids) - set(t["run_id"].to_pylist()))
    if missing:
        raise ABError(f"{dataset}: no kernels of run(s) {', '.join(missing)}")
    acc: dict = {}
    for r in t.to_pylist():
        if r["layer_kind"] != layer:
            continue
        key = (ids[r["run_id"]], r["op"], short_name(r["name"]))
        d = acc.setdefault(key, {}).setdefault(r["run_id"], ([], set()))
        d[0].append((r["end_ns"] - r["start_ns"]) / 1e3)
        d[1].add(r["registers"])
    out = {
        k: {run: (statistics.median(v[0]), max(v[1])) for run, v in runs.items()}
        for k, runs in acc.items()
    }
    totals: dict = {}
    for (point, op, _), runs in out.items():
        tot = totals.setdefault((point, op, TOTAL), {})
        for run, (us, _) in runs.items():
            tot[run] = (tot.get(run, (0.0, 0))[0] + us, 0)
    out.update(totals)
    return out


def _order(key: tuple) -> tuple:
    """Points, then ops, each op's kernels by name and its total last."""
    return key[0], key[1], key[2] == TOTAL, key[2]


def compare_ops(modes: list[tuple[str, list[str]]], dataset: str, layer: str) -> list[dict]:
    """Per (point, op, kernel) that any mode ran: the baseline's mean duration and registers
    (None where only another mode ran the kernel), each other mode's per-run differences (its
    own durations, with ``new`` set, where the baseline did not run it) and registers."""
    per_mode = {name: op_kernels(dataset, files, layer) for name, files in modes}
    base_name = modes[0][0]
    base_points = {k[0] for k in per_mode[base_name]}
    keys = {k for m in per_mode.values() for k in m if k[0] in base_points}
    rows = []
    for key in sorted(keys, key=_order):
        b = per_mode[base_name].get(key)
        b_mean = statistics.mean(d for d, _ in b.values()) if b else None
        row = {
            "batch": key[0][0],
            "tokens_per_seq": key[0][1],
            "op": key[1],
            "kernel": key[2],
            "baseline_us": b_mean,
            "baseline_registers": max(r for _, r in b.values()) if b else None,
            "modes": {},
        }
        for name, _ in modes[1:]:
            m = per_mode[name].get(key)
            row["modes"][name] = None if not m else {
                "us": [d - (b_mean or 0.0) for d, _ in m.values()],
                "registers": max(r for _, r in m.values()),
                "new": b is None,
            }  # fmt: skip
        rows.append(row)
    return rows


def ops_markdown(rows: list[dict], min_us: float = 0.0) -> str:
    """The rows where some mode's mean difference is at least ``min_us`` (all for 0). A kernel
    the baseline did not run shows ``-`` there and each mode's own durations as ``new``; one a
    mode did not run shows ``-`` in that mode's column."""
    names = [n for n in rows[0]["modes"]] if rows else []
    head = ["point", "op", "kernel", "baseline us"] + [f"{n}: us (registers)" for n in names]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ms = [r["modes"][n] for n in names]
        moved = [
            statistics.mean(m["us"]) if m else (r["baseline_us"] or 0.0) for m in ms
        ]  # a kernel a mode dropped moved it by the baseline's whole duration
        if min_us and not any(abs(v) >= min_us for v in moved):
            continue
        cells = [
            f"b{r['batch']}" + (f"x{r['tokens_per_seq']}" if r["tokens_per_seq"] > 1 else ""),
            r["op"],
            r["kernel"],
            "-" if r["baseline_us"] is None else f"{r['baseline_us']:.2f}",
        ]
        for m in ms:
            if m is None:
                cells.append("-")
                continue
            if m.get("new"):
                cells.append("new: " + " / ".join(f"{v:.2f}" for v in m["us"]))
                continue
            regs = "" if m["registers"] == r["baseline_registers"] else (
                f" ({r['baseline_registers']} -> {m['registers']})")  # fmt: skip
            cells.append(" / ".join(_fmt(v, 2) for v in m["us"]) + regs)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt(v: float | None, nd: int) -> str:
    return "-" if v is None else f"{v:+.{nd}f}"


def markdown(rows: list[dict], layer: str) -> str:
    names = [n for n in rows[0]["modes"]] if rows else []
    head = (
        ["point"]
        + [f"{n}: {layer} span, share (us), step (us)" for n in names]
        + ["baseline step spread"]
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [f"b{r['batch']}" + (f"x{r['tokens_per_seq']}" if r["tokens_per_seq"] > 1 else "")]
        for n in names:
            m = r["modes"][n]
            if m is None:
                cells.append("-")
                continue
            share = " / ".join(_fmt(v, 2) for v in m["share_us"])
            step = " / ".join(_fmt(v, 0) for v in m["step_us"])
            cells.append(f"{_fmt(m['span_us'], 1)}, {share}, {step}")
        sp = r["baseline_step_spread_us"]
        cells.append("-" if sp is None else f"{sp:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_modes(specs: list[str]) -> list[tuple[str, list[str]]]:
    out = []
    for s in specs:
        name, sep, files = s.partition("=")
        if not sep or not name or not files:
            raise ABError(f"'{s}': expected NAME=FILE[,FILE...]")
        out.append((name, [f for f in files.split(",") if f]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("modes", nargs="+", help="NAME=FILE[,FILE...]; the first is the baseline")
    ap.add_argument("--layer", default="mla", choices=("dense", "kda", "mla"))
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    ap.add_argument(
        "--ops",
        metavar="DATASET",
        help="per kernel, from this results dataset (several: comma-separated)",
    )
    ap.add_argument("--min-us", type=float, default=0.0,
                    help="with --ops: only kernels some mode moved by this much (mean)")  # fmt: skip
    a = ap.parse_args(argv)
    try:
        modes = parse_modes(a.modes)
        rows = compare(modes, a.layer)
        if a.ops:
            rows = compare_ops(modes, a.ops, a.layer)
    except ABError as e:
        print(f"ab_modes: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(rows, indent=1))
    else:
        print(ops_markdown(rows, a.min_us) if a.ops else markdown(rows, a.layer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
