"""The ``decodescope`` command line (typer + rich).

Each subcommand lives in its own ``ui/cmd_*.py`` module and registers itself on ``app``.
Every user-facing failure is a :class:`~decodescope.tracer.errors.TraceError` (or a
``UsageError``): printed as one line on stderr, exit code 2, no traceback.
"""

from __future__ import annotations

import os
import sys

import typer
from rich.console import Console

from decodescope.tracer.errors import TraceError

app = typer.Typer(
    name="decodescope",
    help="Per-layer kernel counts and microseconds for LLM decode steps: capture, import, compare.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# Piped or captured output (a log, CI) has no terminal width: rich would then fold every table to
# 80 columns and cut the numbers short; give such output room for the widest table instead.
_WIDTH = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 200
console = Console(width=_WIDTH)
err_console = Console(stderr=True)


class UsageError(Exception):
    """A wrong combination of arguments; one line for the user."""


def fail(message: str, code: int = 2) -> typer.Exit:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def _register() -> None:
    import importlib
    import pkgutil

    import decodescope.ui as ui_pkg

    for mod in sorted(m.name for m in pkgutil.iter_modules(ui_pkg.__path__)):
        if mod.startswith("cmd_"):
            importlib.import_module(f"decodescope.ui.{mod}")


def main(argv: list[str] | None = None) -> None:
    _register()
    try:
        rc = app(args=argv, standalone_mode=False)
        if isinstance(rc, int) and rc:  # click returns a typer.Exit's code when not standalone
            sys.exit(rc)
    except TraceError as e:
        err_console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except UsageError as e:
        err_console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)
    except Exception as e:  # click's own usage errors (typer >= 0.2x vendors click as typer._click)
        usage, abort = _click_exception_types()
        if isinstance(e, usage):
            ctx = getattr(e, "ctx", None)
            hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
            err_console.print(
                f"[bold red]error:[/] {e.format_message()}{hint}", highlight=False, soft_wrap=True
            )
            sys.exit(2)
        if isinstance(e, abort):
            sys.exit(1)
        raise


def _click_exception_types() -> tuple[tuple[type, ...], tuple[type, ...]]:
    """click's ClickException and Abort classes: the vendored copy in newer typer, click's own."""
    usage: list[type] = []
    abort: list[type] = [typer.Abort]
    try:
        from typer import _click as vendored

        usage.append(vendored.exceptions.ClickException)
        abort.append(
            vendored.exceptions.Abort if hasattr(vendored.exceptions, "Abort") else typer.Abort
        )
    except (ImportError, AttributeError):
        pass
    try:
        import click

        usage.append(click.exceptions.ClickException)
        abort.append(click.exceptions.Abort)
    except ImportError:
        pass
    return tuple(usage), tuple(abort)


if __name__ == "__main__":
    # run as a script the commands register on the imported module's app, not on __main__'s
    from decodescope.ui.cli import main as _main

    _main()
