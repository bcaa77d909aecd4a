"""``decodescope dashboard [RUN_OR_DATASET ...] [--port N]``: the Streamlit comparison dashboard.

Starts ``streamlit run ui/dashboard.py`` with the sources in the environment (``dashboard.py``
reads them); with no sources the app opens its bundled default data. Streamlit is imported only
by the app, so the rest of the command line stays fast.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer

from decodescope.tracer.errors import TraceError
from decodescope.ui.cli import app, console

APP = Path(__file__).with_name("dashboard.py")
SOURCES_ENV = "DECODESCOPE_DASHBOARD_SOURCES"  # the same name as dashboard.SOURCES_ENV


def streamlit_command(port: int, address: str, open_browser: bool) -> list[str]:
    return [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(APP),
        "--server.port",
        str(port),
        "--server.address",
        address,
        "--server.headless",
        "false" if open_browser else "true",
        "--browser.gatherUsageStats",
        "false",
        "--server.fileWatcherType",
        "none",
    ]


@app.command("dashboard")
def dashboard(
    sources: list[Path] | None = typer.Argument(
        None,
        help="run folders, results datasets or traces (Kineto JSON, nsys SQLite); "
        "none: the bundled default runs",
    ),
    port: int = typer.Option(8501, "--port", "-p", help="port to serve on"),
    address: str = typer.Option("localhost", help="address to listen on (0.0.0.0: all)"),
    open_browser: bool = typer.Option(False, "--open", help="open a browser tab"),
    print_command: bool = typer.Option(
        False, "--print-command", hidden=True, help="print the streamlit command, run nothing"
    ),
) -> None:
    """Compare runs side by side in the browser (Streamlit + plotly)."""
    paths = [p.resolve() for p in sources or []]
    for p in paths:
        if not p.exists():
            raise TraceError(p, "no such file or directory")
    env = dict(os.environ)
    env[SOURCES_ENV] = os.pathsep.join(str(p) for p in paths)
    cmd = streamlit_command(port, address, open_browser)
    if print_command:
        console.print(
            f"{SOURCES_ENV}={env[SOURCES_ENV]!r} " + " ".join(cmd), highlight=False, soft_wrap=True
        )
        return
    console.print(f"decodescope dashboard on http://{address}:{port} (Ctrl-C stops it)")
    sys.stdout.flush()
    os.execve(sys.executable, cmd, env)
