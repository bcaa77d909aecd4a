"""First render of the dashboard on its bundled default data: where the time goes.

    .venv/bin/python benchmarks/bench_dashboard.py [--no-browser] [--repeat N]

Prints a table (median, min and max over N fresh processes where it says so):

- imports: a fresh Python importing what the page imports (streamlit, plotly, pandas, decodescope);
- load / analysis / figures: reading the default runs, the metrics and compare tables, building
  the plotly figures, each from cold (no Streamlit cache);
- page, first run: Streamlit's AppTest running the page once with empty caches (the script run a
  started server does for the first visitor): with cold imports, and with the imports warmed as
  ``decodescope dashboard`` warms them while its server starts (the figure that counts); then a
  second run (caches warm) and the Charts tab;
- browser: ``decodescope dashboard`` started, Chromium (Playwright) opening it: server ready,
  headline shown, side-by-side table shown, first chart drawn after opening the Charts tab.

The target is a first render under 2 s on the development machine; this measures, it asserts
nothing. The load average is printed with it: other work on the machine shows in the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "ui" / "dashboard.py"
CHROMIUM = os.environ.get("DECODESCOPE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

# runs in a fresh interpreter: cold imports, then cold load / analysis / figures
_PHASES = r"""
import json, sys, time
t = time.perf_counter()
import pandas, plotly.graph_objects, pyarrow, streamlit
from decodescope import tracer
from decodescope.analysis import compare, metrics
from decodescope.ui import figures
from decodescope.ui import dashboard
out = {"imports": time.perf_counter() - t}
t = time.perf_counter()
entries = [e for src in dashboard.DEFAULT_DATA for e in dashboard.expand(str(src))[0]]
runs = [tracer.load(e.path) for e in entries]
out["load default runs"] = time.perf_counter() - t
a, b = runs[0], runs[min(1, len(runs) - 1)]
t = time.perf_counter()
side = [(metrics.kind_table(r.kernels), metrics.layer_table(r.kernels), metrics.op_table(r.kernels),
         metrics.kernel_table(r.kernels)) for r in (a, b)]
out["per-run tables (metrics)"] = time.perf_counter() - t
t = time.perf_counter()
pair = (compare.compare_kinds(a.kernels, b.kernels), compare.compare_layers(a.kernels, b.kernels),
        compare.compare_ops(a.kernels, b.kernels), compare.fused_coverage(a.kernels, b.kernels),
        compare.only_one_side(a.kernels, b.kernels))
out["comparison tables (compare)"] = time.perf_counter() - t
t = time.perf_counter()
figs = [figures.layer_bars(side[0][1], side[1][1]), figures.op_stack(side[0][2], side[1][2])]
step = a.kernels["step"].to_pylist()
layer = next(x for x in a.kernels["layer"].to_pylist() if x is not None)
figs.append(figures.timeline(a.kernels, b.kernels, layer, None))
for f in figs:
    f.to_json()
out["figures (build + JSON)"] = time.perf_counter() - t
print(json.dumps(out))
"""

_APPTEST = r"""
import json, time
from streamlit.testing.v1 import AppTest
warm = sys.argv[2] == "warm"
if warm:  # what `decodescope dashboard` does while its server starts
    from decodescope.ui.cmd_dashboard import _warm
    _warm()
at = AppTest.from_file(sys.argv[1], default_timeout=300)
t = time.perf_counter(); at.run(); first = time.perf_counter() - t
assert not at.exception, [e.value for e in at.exception]
tag = "imports warmed, as served" if warm else "cold imports"
out = {f"page, first run ({tag}, cold caches)": first}
# the page's own measure of its script run (without AppTest's first-run component scan)
own = [c.value for c in at.sidebar.caption if c.value.startswith("page computed in")]
out[f"  of which the page script itself ({tag})"] = float(own[0].split()[3])
if warm:
    t = time.perf_counter(); at.run(); out["page, second run (warm caches)"] = time.perf_counter() - t
    at.session_state["view"] = "Charts"
    t = time.perf_counter(); at.run(); out["Charts tab, first run"] = time.perf_counter() - t
print(json.dumps(out))
"""


def _python(code: str, *args: str) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k != "DECODESCOPE_DASHBOARD_SOURCES"}
    out = subprocess.run(
        [sys.executable, "-c", "import sys\n" + code, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _browser() -> dict[str, float]:
    from playwright.sync_api import sync_playwright

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k != "DECODESCOPE_DASHBOARD_SOURCES"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", "from decodescope.ui.cli import main; main()", "dashboard"]
        + ["--port", str(port), "--address", "127.0.0.1"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    out: dict[str, float] = {}
    try:
        while True:
            try:
                with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                    if r.read().strip() == b"ok":
                        break
            except OSError:
                if time.perf_counter() - t0 > 120:
                    raise RuntimeError("the dashboard did not start within 120 s") from None
                time.sleep(0.05)
        out["browser: server ready after start"] = time.perf_counter() - t0
        with sync_playwright() as p:
            b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            for visit in ("first", "second"):
                page = b.new_page(viewport={"width": 1600, "height": 1200})
                t = time.perf_counter()
                page.goto(url, wait_until="commit")
                page.wait_for_selector("h3:has-text('Layer')", timeout=120_000)
                out[f"browser {visit} visit: headline shown"] = time.perf_counter() - t
                page.locator('[data-testid="stDataFrame"]').first.wait_for(
                    state="visible", timeout=120_000
                )
                out[f"browser {visit} visit: side-by-side table shown"] = time.perf_counter() - t
                own = page.get_by_text("page computed in").first.inner_text()
                out[f"browser {visit} visit: page script (server side)"] = float(own.split()[3])
                t = time.perf_counter()
                page.get_by_role("tab", name="Charts").click()
                page.wait_for_selector(".js-plotly-plot .barlayer .point path", timeout=120_000)
                out[f"browser {visit} visit: Charts tab drawn (after click)"] = (
                    time.perf_counter() - t
                )
                page.close()
            b.close()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="fresh processes per measurement")
    ap.add_argument("--no-browser", action="store_true", help="skip the Chromium measurement")
    args = ap.parse_args()
    samples: dict[str, list[float]] = {}

    def add(d: dict[str, float]) -> None:
        for k, v in d.items():
            samples.setdefault(k, []).append(v)

    load0 = os.getloadavg()[0]
    for _ in range(args.repeat):
        add(_python(_PHASES))
    for _ in range(args.repeat):
        add(_python(_APPTEST, str(APP), "cold"))
    for _ in range(args.repeat):
        add(_python(_APPTEST, str(APP), "warm"))
    if not args.no_browser:
        if Path(CHROMIUM).is_file():
            add(_browser())
        else:
            print(f"(no Chromium at {CHROMIUM}: browser timings skipped)")
    load1 = os.getloadavg()[0]

    width = max(len(k) for k in samples) + 2
    print(f"dashboard first render, default data: {', '.join(str(p) for p in _default())}")
    print(
        f"machine: {os.cpu_count()} CPUs, load average {load0:.1f} before, {load1:.1f} after; "
        f"python {sys.version.split()[0]}"
    )
    print(f"{'phase':<{width}} {'median s':>9} {'min s':>8} {'max s':>8} {'n':>3}")
    print("-" * (width + 32))
    for k, v in samples.items():
        print(
            f"{k:<{width}} {statistics.median(v):>9.3f} {min(v):>8.3f} {max(v):>8.3f} {len(v):>3}"
        )


def _default() -> list[Path]:
    sys.path.insert(0, str(ROOT))
    from decodescope.ui.dashboard import DEFAULT_DATA

    return [p.relative_to(ROOT) if p.is_relative_to(ROOT) else p for p in DEFAULT_DATA]


if __name__ == "__main__":
    main()
