"""Import speed: decodescope's Kineto importer against HolisticTraceAnalysis on the same file.

Every measurement runs in a fresh Python process (``--worker``), so imports, caches and peak
memory of one loader never colour another's:

- time: wall time of one load, median (and min / max) over ``--repeats`` loads in that process
  after one warm-up load (the first load of a process also pays pyarrow's lazy start-up; the cold
  first load is reported apart), and the median CPU time (``time.process_time``, all threads),
  which other work on a shared machine disturbs far less than wall time;
- peak memory: the process's peak RSS during the first load (VmHWM, reset after the imports)
  minus its RSS before it, i.e. what loading the trace added at its peak;
- events/s and MB/s: the trace's event count and uncompressed JSON size over the median time.

decodescope is timed twice: ``tracer.kineto.load_kineto`` (the raw import, the like of what HTA
does) and ``tracer.load`` (import plus attribution). HTA is timed as its users call it:
``TraceAnalysis(trace_dir=...)`` on a temporary folder holding only the trace.

Usage: python benchmarks/bench_import.py [--trace FILE ...] [--repeats 5] [--hta-repeats 3]
Writes benchmarks/results/import.json and prints a table. A benchmark, never a timed test.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "tests" / "data" / "traces"
DEFAULT = TRACES / "kineto_a100_torchcompile_cudagraph__HTA_negative_queue.json.gz"
RESULTS = ROOT / "benchmarks" / "results" / "import.json"


# ---------------------------------------------------------------------------------------------
# worker: one loader, one trace, a fresh process


def _mem_mb() -> tuple[float, float]:
    """(current RSS, peak RSS) of this process in MB.

    Linux: VmRSS / VmHWM of /proc/self/status. (``getrusage().ru_maxrss`` is no good here: a child
    keeps the maximum its parent had when it forked, so a small worker reports the driver's size.)
    Elsewhere: ru_maxrss for both."""
    try:
        fields = dict(
            line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines()
        )
        return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024
    except (OSError, KeyError, ValueError):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        return peak, peak


def _reset_peak() -> None:
    """Start the peak (VmHWM) afresh from the current RSS, where Linux lets us."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def worker(loader: str, path: str, repeats: int) -> dict:
    t0 = time.perf_counter()
    if loader == "hta":
        import logging

        logging.disable(logging.WARNING)  # HTA logs every parse at WARNING
        from hta.trace_analysis import TraceAnalysis

        tmp = tempfile.mkdtemp(prefix="bench_hta_")
        shutil.copy(path, tmp)

        def load() -> None:
            TraceAnalysis(trace_dir=tmp)

    elif loader == "load_kineto":
        from decodescope.tracer.kineto import load_kineto

        def load() -> None:
            load_kineto(path)

    elif loader == "tracer.load":
        from decodescope import tracer

        def load() -> None:
            tracer.load(path)

    else:
        raise SystemExit(f"unknown loader {loader}")
    # pyarrow imports pandas on its first conversion of a Python list: pay that here, as part of
    # the imports (HTA imports pandas itself), not as memory the trace took
    import pyarrow as pa

    pa.array([0])
    import_s = time.perf_counter() - t0
    _reset_peak()
    base, _ = _mem_mb()
    t = time.perf_counter()
    load()
    first = time.perf_counter() - t
    _, peak = _mem_mb()
    times, cpu = [], []
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        load()
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    if loader == "hta":
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "loader": loader,
        "import_s": import_s,
        "first_s": first,
        "times_s": times,
        "median_s": statistics.median(times) if times else first,
        "cpu_times_s": cpu,
        "cpu_median_s": statistics.median(cpu) if cpu else None,
        "rss_base_mb": base,
        "rss_peak_mb": peak,
        "rss_added_mb": peak - base,
    }


def run_worker(loader: str, path: Path, repeats: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", loader, str(path), "--repeats", str(repeats)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"loader": loader, "error": tail}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# driver


def trace_facts(path: Path) -> dict:
    raw = path.read_bytes()
    text = gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw
    events = json.loads(text).get("traceEvents", [])
    return {
        "file": path.name,
        "file_mb": len(raw) / 1e6,
        "json_mb": len(text) / 1e6,
        "events": len(events),
    }


def machine() -> dict:
    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = {}
    for mod in ("msgspec", "pyarrow", "numpy", "hta", "pandas"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - a missing package is just not listed
            versions[mod] = None
    try:
        from importlib.metadata import version

        versions["hta"] = version("HolisticTraceAnalysis")
    except Exception:  # noqa: BLE001
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": versions,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        # other work on the machine slows every loader; the load average says how busy it was
        "loadavg_1_5_15": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, action="append", help="trace file (repeatable)")
    ap.add_argument("--repeats", type=int, default=5, help="timed loads per decodescope worker")
    ap.add_argument("--hta-repeats", type=int, default=3, help="timed loads per HTA worker")
    ap.add_argument("--no-hta", action="store_true", help="skip HolisticTraceAnalysis")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--worker", nargs=2, metavar=("LOADER", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker[0], args.worker[1], args.repeats)))
        return 0

    traces = args.trace or [DEFAULT]
    mach = machine()
    rows = []
    for path in traces:
        facts = trace_facts(path)
        loaders = [("load_kineto", args.repeats), ("tracer.load", args.repeats)]
        if not args.no_hta:
            loaders.append(("hta", args.hta_repeats))
        results = {name: run_worker(name, path, n) for name, n in loaders}
        hta = results.get("hta", {})
        for name, r in results.items():
            row = {**facts, **r}
            if "error" not in r:
                row["events_per_s"] = facts["events"] / r["median_s"]
                row["mb_per_s"] = facts["json_mb"] / r["median_s"]
                row["peak_x_json"] = r["rss_added_mb"] / facts["json_mb"]
                if name != "hta" and "median_s" in hta:
                    row["speedup_vs_hta"] = hta["median_s"] / r["median_s"]
                    if hta.get("cpu_median_s") and r.get("cpu_median_s"):
                        row["cpu_speedup_vs_hta"] = hta["cpu_median_s"] / r["cpu_median_s"]
            rows.append(row)
    report = {"machine": mach, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print_table(report)
    print(f"\nwrote {args.out}")
    return 0


def print_table(report: dict) -> None:
    m = report["machine"]
    title = f"Kineto import on {m['cpu']} ({m['cores']} cores), Python {m['python']}"
    if m.get("loadavg_1_5_15"):
        title += f", load average {m['loadavg_1_5_15'][0]:.1f} at the start"
    header = [
        "trace",
        "events",
        "JSON MB",
        "loader",
        "median s",
        "min-max s",
        "cold 1st s",
        "events/s",
        "MB/s",
        "peak +MB",
        "peak/JSON",
        "vs HTA",
        "CPU s",
        "vs HTA (CPU)",
    ]
    body = []
    for r in report["rows"]:
        if "error" in r:
            body.append(
                [
                    r["file"][:28],
                    str(r["events"]),
                    f"{r['json_mb']:.1f}",
                    r["loader"],
                    "failed: " + r["error"][:60],
                ]
                + [""] * 9
            )
            continue
        t = r["times_s"] or [r["median_s"]]
        body.append(
            [
                r["file"][:28],
                f"{r['events']:,}",
                f"{r['json_mb']:.1f}",
                r["loader"],
                f"{r['median_s']:.3f}",
                f"{min(t):.3f}-{max(t):.3f}",
                f"{r['first_s']:.3f}",
                f"{r['events_per_s']:,.0f}",
                f"{r['mb_per_s']:.1f}",
                f"{r['rss_added_mb']:.0f}",
                f"{r['peak_x_json']:.2f}x",
                f"{r['speedup_vs_hta']:.1f}x" if "speedup_vs_hta" in r else "",
                f"{r['cpu_median_s']:.3f}" if r.get("cpu_median_s") else "",
                f"{r['cpu_speedup_vs_hta']:.1f}x" if "cpu_speedup_vs_hta" in r else "",
            ]
        )
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title)
        for h in header:
            table.add_column(h, justify="left" if h in ("trace", "loader") else "right")
        for b in body:
            table.add_row(*b)
        Console(width=max(180, shutil.get_terminal_size().columns)).print(table)
    except ImportError:
        print(title)
        print(" | ".join(header))
        for b in body:
            print(" | ".join(b))


if __name__ == "__main__":
    sys.exit(main())
