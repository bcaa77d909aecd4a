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
from decodescope.ui.cli import UsageError, app, console

APP = Path(__file__).with_name("dashboard.py")
SOURCES_ENV = "DECODESCOPE_DASHBOARD_SOURCES"  # the same name as dashboard.SOURCES_ENV


def streamlit_command(port: int, address: str, open_browser: bool) -> list[str]:
    """``python -c <serve> run ui/dashboard.py --server...``: Streamlit's own command line,
    behind :func:`serve`, which warms the page's imports while the server starts."""
    return [
        sys.executable,
        "-c",
        "from decodescope.ui.cmd_dashboard import serve; serve()",
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


def _warm() -> None:
    """Import what the page imports and build one figure, so that the first visitor's script
    run does not pay for it (pandas, plotly and its validators take seconds cold)."""
    try:
        import pandas  # noqa: F401
        import plotly.graph_objects as go
        import pyarrow.parquet  # noqa: F401
        from plotly.subplots import make_subplots

        import decodescope.analysis.compare  # noqa: F401
        import decodescope.analysis.regress  # noqa: F401
        import decodescope.tracer.kineto  # noqa: F401
        import decodescope.tracer.nsys  # noqa: F401
        import decodescope.ui.figures  # noqa: F401

        fig = make_subplots(rows=2, cols=1)
        fig.add_trace(go.Bar(x=[["a"], ["0"]], y=[1], error_y=dict(array=[0])), row=1, col=1)
        fig.add_trace(go.Scatter(x=[1], y=[1], mode="lines+markers"), row=2, col=1)
        fig.to_json()
        # Streamlit's once-per-process check for a REPL walks the stack with inspect (about a
        # second with this many modules loaded) on the first element; it prints nothing under
        # `streamlit run`, so mark it done
        import streamlit.delta_generator as dg

        if hasattr(dg, "_use_warning_has_been_displayed"):
            dg._use_warning_has_been_displayed = True
    except Exception:  # warming is an optimisation only; the page reports real errors
        pass


def serve() -> None:
    """Streamlit's command line (arguments from ``sys.argv``) with :func:`_warm` beside it."""
    import threading

    threading.Thread(target=_warm, name="decodescope-warm", daemon=True).start()
    from streamlit.web import cli as stcli

    sys.argv = ["streamlit", *sys.argv[1:]]
    sys.exit(stcli.main())


def _check_port(address: str, port: int) -> None:
    """A one-line error where ``address:port`` cannot be listened on (in use, not an address of
    this machine), before the server starts and says it runs there."""
    import socket

    try:
        infos = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise UsageError(f"--address {address}: {e.strerror or e}") from None
    fam, kind, proto, _, addr = infos[0]
    with socket.socket(fam, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise UsageError(
                f"--port {port}: cannot listen on {address}:{port}: {e.strerror or e}"
            ) from None


@app.command("dashboard")
def dashboard(
    sources: list[Path] | None = typer.Argument(
        None,
        help="run folders, results datasets or traces (Kineto JSON, nsys SQLite); "
        "none: the bundled default runs",
    ),
    port: int = typer.Option(8501, "--port", "-p", min=1, max=65535, help="port to serve on"),
    address: str = typer.Option("localhost", help="address to listen on (0.0.0.0: all)"),
    open_browser: bool = typer.Option(False, "--open", help="open a browser tab"),
    print_command: bool = typer.Option(
        False, "--print-command", hidden=True, help="print the streamlit command, run nothing"
    ),
) -> None:
    """Compare runs side by side in the browser (Streamlit + plotly)."""
    from decodescope import tracer

    paths: list[Path | str] = []
    for p in sources or []:
        if tracer.dataset_ref(p) is not None:  # DATASET@RUN_ID (a run it cannot find: one line)
            ds, rid = tracer.dataset_ref(p)
            paths.append(f"{ds.resolve()}@{rid}")
        elif not p.exists():
            raise TraceError(p, "no such file or directory")
        else:
            paths.append(p.resolve())
    env = dict(os.environ)
    env[SOURCES_ENV] = os.pathsep.join(str(p) for p in paths)
    cmd = streamlit_command(port, address, open_browser)
    if print_command:
        console.print(
            f"{SOURCES_ENV}={env[SOURCES_ENV]!r} " + " ".join(cmd), highlight=False, soft_wrap=True
        )
        return
    _check_port(address, port)
    console.print(f"decodescope dashboard on http://{address}:{port} (Ctrl-C stops it)")
    sys.stdout.flush()
    os.execve(sys.executable, cmd, env)
