"""Summarise Nsight Compute's per-SASS-instruction source counters: where a kernel's warps stall.

Reads the CSV of ``ncu --import R.ncu-rep --page source --csv --print-source sass`` (one row per
SASS instruction; written by ``scripts/gpu/ncu_source.sh``) and prints:

- the stall samples per reason over the whole kernel (columns whose name has ``stall``), largest
  first, with their share;
- the samples per opcode (the first word of the instruction, predicate dropped);
- the ``--top`` instructions by samples, in address order around them, with their reasons.

The sample column is the first whose name starts with ``Warp Stall Sampling (All``; without it
the script says which columns it found and exits 1.

    python scripts/ncu_stalls.py OUT/ncu/kda8.sass.csv [--top 30]
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from collections import Counter
from pathlib import Path

_PRED = re.compile(r"^@!?U?P\w+\s+")


def _num(v: str) -> float:
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return 0.0


def _rows(path: Path) -> tuple[list[str], list[dict]]:
    lines = path.read_text(errors="replace").splitlines()
    # ncu may print notes before the CSV, and (ncu 2025+, H200 s31) a `"Kernel Name","..."`
    # line before each kernel's header: start at the first quoted line naming a Source column,
    # end at the next kernel's name line (the first kernel only)
    quoted = [i for i, ln in enumerate(lines) if ln.startswith('"')]
    if not quoted:
        raise ValueError(f"{path}: no CSV header (is this `ncu --page source --csv` output?)")
    start = next((i for i in quoted if '"Source"' in lines[i]), quoted[0])
    end = next((i for i in quoted if i > start and lines[i].startswith('"Kernel Name"')),
               len(lines))  # fmt: skip
    reader = csv.DictReader(lines[start:end])
    return list(reader.fieldnames or []), list(reader)


def summarise(path: Path, top: int = 30) -> str:
    fields, rows = _rows(path)
    total_col = next((f for f in fields if f.startswith("Warp Stall Sampling (All")), None)
    src_col = next((f for f in fields if f.strip().lower() == "source"), None)
    if total_col is None or src_col is None:
        raise ValueError(
            f"{path}: no 'Warp Stall Sampling (All ...' or 'Source' column; columns: "
            + ", ".join(fields[:30])
        )
    reasons = [f for f in fields if "stall" in f.lower() and f != total_col and "Sampling" not in f]
    total = sum(_num(r[total_col]) for r in rows)
    out = [f"{path.name}: {len(rows)} SASS instructions, {total:.0f} stall samples"]
    if reasons:
        by = Counter({f: sum(_num(r[f]) for r in rows) for f in reasons})
        out.append("\nstall reasons (samples, share):")
        for f, n in by.most_common():
            if n:
                out.append(f"  {f:<48} {n:>10.0f}  {n / max(total, 1):6.1%}")
    ops: Counter = Counter()
    for r in rows:
        op = _PRED.sub("", r[src_col].strip()).split(" ")[0]
        ops[op] += _num(r[total_col])
    out.append("\nsamples by opcode:")
    for op, n in ops.most_common(15):
        out.append(f"  {op:<20} {n:>10.0f}  {n / max(total, 1):6.1%}")
    out.append(f"\ntop {top} instructions:")
    ranked = sorted(range(len(rows)), key=lambda i: -_num(rows[i][total_col]))[:top]
    for i in sorted(ranked):
        r = rows[i]
        why = sorted(((f, _num(r[f])) for f in reasons), key=lambda x: -x[1])[:2]
        tag = ", ".join(f"{f.split('(')[0].strip()} {n:.0f}" for f, n in why if n)
        out.append(f"  #{i:<5} {_num(r[total_col]):>8.0f}  {r[src_col].strip()[:70]:<70}  {tag}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", type=Path)
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args(argv)
    try:
        print(summarise(a.csv, a.top))
    except (OSError, ValueError) as e:
        print(f"ncu_stalls: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
