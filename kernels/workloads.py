"""The workload registry (docs/internal-api.md, "Workloads and capture").

A workload is built inside the capture's child process by a factory registered by name. The
standard-layer issue owns this module and adds its factories; this is only the registry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Workload:
    name: str
    step: Callable[[], None]  # one decode step on the current stream, capturable into a graph
    refresh: Callable[[], None] | None = None  # fresh random inputs, called outside capture
    meta: dict[str, Any] = field(default_factory=dict)  # RunMeta fields (see the contract)


WORKLOADS: dict[str, Callable[..., Workload]] = {}


def register(name: str) -> Callable[[Callable[..., Workload]], Callable[..., Workload]]:
    """Register a workload factory under ``name``: ``@register("toy") def make(**opts): ...``."""

    def deco(factory: Callable[..., Workload]) -> Callable[..., Workload]:
        WORKLOADS[name] = factory
        return factory

    return deco
