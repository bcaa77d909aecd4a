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
its predecessor's. Used for notes/specialized.md "Outcome of part 45".

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


def op_kernels(dataset: str, files: list[str], layer: str) -> dict:
    """Per (point, op, kernel): per run, (median duration in us, registers per thread), from the
    kernels table of ``dataset`` (Hive partitions, as ``decodescope export`` / bench's ``--out``
    write it) for the runs named in ``files``."""
    from decodescope.analysis.timeline import short_name
    from decodescope.tracer.dataset import read_table
    from decodescope.tracer.errors import TraceError

    ids = _run_ids(files, layer)
    try:
        t = read_table(dataset, "kernels", list(ids)).select(
            ["run_id", "layer_kind", "op", "name", "start_ns", "end_ns", "registers"]
        )
    except TraceError as e:
        raise ABError(f"{e} (give the bench's --out folder)") from None
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
    return {
        k: {run: (statistics.median(v[0]), max(v[1])) for run, v in runs.items()}
        for k, runs in acc.items()
    }


def compare_ops(modes: list[tuple[str, list[str]]], dataset: str, layer: str) -> list[dict]:
    """Per (point, op, kernel): the baseline's mean duration and registers, each other mode's
    per-run differences and registers."""
    per_mode = {name: op_kernels(dataset, files, layer) for name, files in modes}
    base_name = modes[0][0]
    rows = []
    for key in sorted(per_mode[base_name]):
        b = per_mode[base_name][key]
        b_mean = statistics.mean(d for d, _ in b.values())
        row = {
            "batch": key[0][0],
            "tokens_per_seq": key[0][1],
            "op": key[1],
            "kernel": key[2],
            "baseline_us": b_mean,
            "baseline_registers": max(r for _, r in b.values()),
            "modes": {},
        }
        for name, _ in modes[1:]:
            m = per_mode[name].get(key)
            row["modes"][name] = None if not m else {
                "us": [d - b_mean for d, _ in m.values()],
                "registers": max(r for _, r in m.values()),
            }  # fmt: skip
        rows.append(row)
    return rows


def ops_markdown(rows: list[dict], min_us: float = 0.0) -> str:
    """The rows where some mode's mean difference is at least ``min_us`` (all for 0)."""
    names = [n for n in rows[0]["modes"]] if rows else []
    head = ["point", "op", "kernel", "baseline us"] + [f"{n}: us (registers)" for n in names]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ms = [r["modes"][n] for n in names]
        if min_us and not any(m and abs(statistics.mean(m["us"])) >= min_us for m in ms):
            continue
        cells = [
            f"b{r['batch']}" + (f"x{r['tokens_per_seq']}" if r["tokens_per_seq"] > 1 else ""),
            r["op"],
            r["kernel"],
            f"{r['baseline_us']:.2f}",
        ]
        for m in ms:
            if m is None:
                cells.append("-")
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
    ap.add_argument("--ops", metavar="DATASET", help="per kernel, from this results dataset")
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
