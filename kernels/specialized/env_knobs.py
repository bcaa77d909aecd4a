"""The environment knobs' one parser: a ``DECODESCOPE_*`` value checked against its allowed
values, a bad one a one-line ``ValueError`` that names the variable.

Strings are kept as they are; where every allowed value is an integer the value must be decimal
digits and is returned as an ``int``. The message: ``VAR='x': expected one of (...)``, or for
integers that form a range, ``VAR='x': expected lo..hi``. Used by :mod:`.moe_grouped` (the
grouped MoE's modes and stages), :mod:`.grouped_w2_tile` (its ``TileKnobs``) and
:mod:`.skinny_gemm` (the weight-load mode).
"""

from __future__ import annotations

import os


def check(var: str, v: str, allowed: tuple) -> str | int:
    """``v`` (the value of ``var``) if it is one of ``allowed`` (an ``int`` where those are
    integers), else a one-line ``ValueError`` naming ``var``."""
    if all(isinstance(a, str) for a in allowed):
        if v not in allowed:
            raise ValueError(f"{var}={v!r}: expected one of {allowed}")
        return v
    if not v.isdigit() or int(v) not in allowed:
        lo, hi = min(allowed), max(allowed)
        want = f"{lo}..{hi}" if len(allowed) == hi - lo + 1 else f"one of {allowed}"
        raise ValueError(f"{var}={v!r}: expected {want}")
    return int(v)


def read(var: str, allowed: tuple, default: str = "") -> str | int | None:
    """The environment's ``var`` (unset or empty: ``default``; None where that is empty too),
    through :func:`check`. Read at each call."""
    v = os.environ.get(var, "") or default
    if v == "":
        return None
    return check(var, v, allowed)
