"""Driving the command line in the test process, shared by the CLI test files."""

from __future__ import annotations

import contextlib
import dataclasses
import io


@dataclasses.dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def cli(*args: object, width: int = 200) -> Result:
    """Run the console script's entry point in this process (as ``decodescope ARGS``), its
    console ``width`` columns wide (default 200: wide tables, rows stay on one line for the
    assertions)."""
    from decodescope.ui import cli as cli_mod

    cli_mod.console.width = width
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cli_mod.main([str(a) for a in args])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return Result(code, out.getvalue(), err.getvalue())
