"""The dashboard in a real browser: ``decodescope dashboard`` serves the bundled default runs,
Chromium (the Debian package, driven by Playwright) opens it, and the side-by-side table and the
plotly charts must render with no exception element; an uploaded file that is not a trace must
give a message. Screenshots go to ``tmp/artifacts/`` (or ``$DECODESCOPE_ARTIFACTS``).

Needs ``/usr/bin/chromium`` (``scripts/install_browser.sh``; or ``$DECODESCOPE_CHROMIUM``).
It is not skipped when the browser is missing: it fails and says how to install it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
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
ARTIFACTS = Path(os.environ.get("DECODESCOPE_ARTIFACTS", ROOT / "tmp" / "artifacts"))
EXCEPTION = '[data-testid="stException"]'
TIMEOUT_MS = 60_000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
            raise AssertionError(f"the dashboard exited with {proc.returncode}:\n{out}")
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                if r.read().strip() == b"ok":
                    return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"the dashboard did not answer on {url} within {timeout:.0f} s")


@pytest.fixture(scope="module")
def server():
    """``decodescope dashboard --port N`` (no sources: the bundled default) in a subprocess."""
    port = free_port()
    cmd = [
        sys.executable,
        "-c",
        "from decodescope.ui.cli import main; main()",
        "dashboard",
        "--port",
        str(port),
        "--address",
        "127.0.0.1",
    ]
    env = {k: v for k, v in os.environ.items() if k != "DECODESCOPE_DASHBOARD_SOURCES"}
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        yield url
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).is_file():
        pytest.fail(
            f"no Chromium at {CHROMIUM}: run scripts/install_browser.sh (apt package chromium) "
            "or set DECODESCOPE_CHROMIUM"
        )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture()
def page(browser):
    ctx = browser.new_context(viewport={"width": 1600, "height": 1200})
    pg = ctx.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.js_errors = errors  # type: ignore[attr-defined]
    yield pg
    ctx.close()


def shot(page, name: str) -> Path:
    """A screenshot of the whole page (Streamlit scrolls inside its own container, so the
    viewport is grown to the content first)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    height = page.evaluate(
        '() => Math.max(...[...document.querySelectorAll(\'[data-testid="stMain"], '
        '[data-testid="stAppViewContainer"], section.main\')].map(e => e.scrollHeight), 1200)'
    )
    page.set_viewport_size({"width": 1600, "height": min(int(height) + 100, 6000)})
    page.wait_for_timeout(500)
    page.screenshot(path=str(path), full_page=True)
    return path


def wait_rendered(page) -> None:
    """Until the script run is over: the headline is there and no 'running' indicator."""
    page.wait_for_selector("h3:has-text('Layer')", timeout=TIMEOUT_MS)
    page.wait_for_function(
        "() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=TIMEOUT_MS
    )


def test_side_by_side_table_and_charts_render(server, page):
    page.goto(server, wait_until="domcontentloaded")
    wait_rendered(page)
    # the headline, the side-by-side table (kinds, then per layer) with A and B columns
    headline = page.locator("h3:has-text('Layer')").first.inner_text()
    assert " vs " in headline and "kernels" in headline
    table = page.locator('[data-testid="stDataFrame"]').first
    table.wait_for(state="visible", timeout=TIMEOUT_MS)
    assert table.bounding_box()["height"] > 40
    assert page.locator('[data-testid="stDataFrame"]').count() >= 2
    # a plotly chart: open the Charts tab, the per-layer bars draw SVG bars
    page.get_by_role("tab", name="Charts").click()
    plot = page.locator(".js-plotly-plot").first
    plot.wait_for(state="visible", timeout=TIMEOUT_MS)
    page.wait_for_selector(".js-plotly-plot .barlayer .point path", timeout=TIMEOUT_MS)
    assert page.locator(".js-plotly-plot .barlayer .point").count() > 24
    # the timeline draws too
    page.get_by_role("tab", name="Timeline").click()
    page.wait_for_selector(
        "[data-testid='stTabPanel']:visible .js-plotly-plot .barlayer .point", timeout=TIMEOUT_MS
    )
    assert page.locator(EXCEPTION).count() == 0
    assert not page.js_errors, page.js_errors
    page.get_by_role("tab", name="Side by side").click()
    page.locator('[data-testid="stDataFrame"]').first.wait_for(state="visible", timeout=TIMEOUT_MS)
    shot(page, "dashboard_side_by_side")
    page.get_by_role("tab", name="Charts").click()
    page.wait_for_function(
        "() => document.querySelectorAll("
        "'[data-testid=\"stTabPanel\"]:not([hidden]) .js-plotly-plot .barlayer').length >= 2",
        timeout=TIMEOUT_MS,
    )
    path = shot(page, "dashboard_charts")
    assert path.stat().st_size > 10_000


def test_uploading_a_file_that_is_not_a_trace_is_a_message(server, page, tmp_path):
    page.goto(server, wait_until="domcontentloaded")
    wait_rendered(page)
    bad = tmp_path / "not_a_trace.json"
    bad.write_text("hello, I am not a trace\n")
    page.locator('[data-testid="stFileUploaderDropzoneInput"]').set_input_files(str(bad))
    alert = page.locator('[data-testid="stAlert"]:has-text("not_a_trace.json")')
    alert.wait_for(state="visible", timeout=TIMEOUT_MS)
    assert page.locator(EXCEPTION).count() == 0
    shot(page, "dashboard_bad_upload")
