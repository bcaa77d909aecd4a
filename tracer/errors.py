"""The one error type a user sees for bad input: which file, and what is wrong with it."""

from __future__ import annotations

import os


class TraceError(Exception):
    """A file or folder that decodescope cannot read. ``str()`` is one line for the user."""

    def __init__(self, path: str | os.PathLike[str], problem: str) -> None:
        self.path = os.fspath(path)
        self.problem = " ".join(str(problem).split())  # always one line
        super().__init__(f"{self.path}: {self.problem}")
