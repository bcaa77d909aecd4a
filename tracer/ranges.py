"""``decodescope.tracer.range``: named NVTX ranges that also keep a host-side range stack.

The stack is what CUDA-graph attribution needs (DESIGN.md section 8): while a graph is being
captured, the capture session asks :func:`current_path` for the path open on this thread when a
graph node is created. This module imports without CUPTI, CUDA or even the ``nvtx`` package, and
costs a list append/pop when no NVTX tool is attached (``NVTX_INJECTION64_PATH`` unset): the
NVTX calls are made only when a tool will see them, with event attributes cached per name.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

try:  # the nvtx package (NVIDIA's official bindings) is an optional dependency
    import nvtx as _nvtx
except ImportError:  # pragma: no cover - exercised where nvtx is absent
    _nvtx = None

DOMAIN = "decodescope"
SEP = "/"

_local = threading.local()
_domain = None
F = TypeVar("F", bound=Callable[..., Any])


def _stack() -> list[str]:
    s = getattr(_local, "stack", None)
    if s is None:
        s = _local.stack = []
    return s


def _tool_attached() -> bool:
    """NVTX calls reach a tool only when one is injected (CUPTI, Nsight Systems)."""
    return (
        _nvtx is not None
        and _nvtx.enabled()
        and bool(os.environ.get("NVTX_INJECTION64_PATH") or os.environ.get("NVTX_INJECTION32_PATH"))
    )


_active = _tool_attached()
_attrs: dict[str, Any] = {}


def refresh() -> bool:
    """Re-read whether an NVTX tool is attached (after changing the environment); returns it."""
    global _active, _domain
    _active = _tool_attached()
    _domain = None
    _attrs.clear()
    return _active


def _get_domain():
    global _domain
    if _domain is None and _nvtx is not None:
        _domain = _nvtx.get_domain(DOMAIN)
    return _domain


def _attributes(name: str):
    a = _attrs.get(name)
    if a is None:
        a = _attrs[name] = _get_domain().get_event_attributes(message=name)
    return a


def current_path() -> str:
    """The path of ranges open on this thread, outermost first, joined by ``/``."""
    return SEP.join(_stack())


class range:  # noqa: N801 - reads like the builtin contextlib helpers it stands beside
    """Push an NVTX range (domain ``decodescope``) and the host-side stack; pop both on exit.

    Usable as ``with range("layer.3.attn.qkv_proj"):`` or as a decorator ``@range("step")``.
    """

    __slots__ = ("name", "_pushed")

    def __init__(self, name: str) -> None:
        if SEP in name:
            raise ValueError(f"range name {name!r} must not contain {SEP!r}")
        self.name = name
        self._pushed = False

    def __enter__(self) -> range:
        _stack().append(self.name)
        if _active:
            _get_domain().push_range(_attributes(self.name))
            self._pushed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pushed:
            _get_domain().pop_range()
            self._pushed = False
        _stack().pop()

    def __call__(self, fn: F) -> F:
        name = self.name

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with range(name):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]
