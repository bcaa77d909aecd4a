"""Naming schemes: from a range path to step, layer, layer kind, block and op.

The patterns live in ``naming.toml`` beside this module (decodescope's own names, vLLM and
Hugging Face module paths, torch.profiler ``nn.Module:`` names); this module only applies them.
Everything here works on strings; :mod:`decodescope.analysis.attribution` applies it once per
distinct path, not once per kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import tomllib
from importlib import resources
from typing import Any

SEP = "/"


@dataclasses.dataclass(frozen=True)
class Rule:
    scheme: str
    pattern: re.Pattern[str]
    value: str | None = None  # block / kind name for [[block]] and [[kind]] rules


@dataclasses.dataclass(frozen=True)
class Naming:
    """What one range path says: all fields ``None`` where the path says nothing."""

    layer: int | None = None
    layer_kind: str | None = None
    block: str | None = None
    op: str | None = None


@dataclasses.dataclass(frozen=True)
class Scheme:
    """A compiled naming scheme (see ``naming.toml`` for the meaning of each rule list)."""

    unwrap: tuple[Rule, ...]
    step: tuple[Rule, ...]
    layer: tuple[Rule, ...]
    segment: tuple[Rule, ...]
    block: tuple[Rule, ...]
    kind: tuple[Rule, ...]
    default_kind: str | None = "layer"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Scheme:
        def rules(key: str, value_key: str | None = None) -> tuple[Rule, ...]:
            out = []
            for i, r in enumerate(data.get(key, [])):
                try:
                    pat = re.compile(r["pattern"])
                except (KeyError, re.error) as e:
                    raise ValueError(f"naming scheme: [[{key}]] rule {i}: bad pattern: {e}") from e
                if value_key is not None and value_key not in r:
                    raise ValueError(f"naming scheme: [[{key}]] rule {i} lacks {value_key!r}")
                out.append(Rule(r.get("scheme", ""), pat, r.get(value_key) if value_key else None))
            return tuple(out)

        for r in rules("layer"):
            if "layer" not in r.pattern.groupindex:
                raise ValueError(
                    f"naming scheme: layer rule {r.pattern.pattern!r} has no group 'layer'"
                )
        return cls(
            unwrap=rules("unwrap"),
            step=rules("step"),
            layer=rules("layer"),
            segment=rules("segment"),
            block=rules("block", "block"),
            kind=rules("kind", "kind"),
            default_kind=data.get("default_kind", "layer"),
        )

    @classmethod
    def from_toml(cls, text: str) -> Scheme:
        return cls.from_dict(tomllib.loads(text))

    # -- single names ---------------------------------------------------------------------

    def unwrap_name(self, name: str) -> str:
        for r in self.unwrap:
            m = r.pattern.search(name)
            if m:
                return m.group("name")
        return name

    def step_number(self, name: str) -> tuple[bool, int | None]:
        """(is this a step range, its number if the name carries one)."""
        name = self.unwrap_name(name)
        for r in self.step:
            m = r.pattern.search(name)
            if m:
                n = m.groupdict().get("n")
                return True, int(n) if n is not None else None
        return False, None

    def _segment(self, name: str) -> list[str]:
        for r in self.segment:
            m = r.pattern.search(name)
            if m:
                return [s for s in m.group("seg").split(".") if s]
        return [s for s in name.split(".") if s]

    def _block(self, seg: str) -> str:
        for r in self.block:
            if r.pattern.search(seg):
                return r.value  # type: ignore[return-value]
        return seg

    def _kind(self, segs: list[str]) -> str | None:
        for seg in segs:
            for r in self.kind:
                if r.pattern.search(seg):
                    return r.value
        return None

    # -- paths ----------------------------------------------------------------------------

    def name_path(self, path: str | None) -> Naming:
        """Layer, kind, block and op of one range path (kind ``None`` where the path is silent)."""
        if not path:
            return Naming()
        names = [self.unwrap_name(n) for n in path.split(SEP)]
        hits: list[tuple[int, int, str | None, str | None]] = []  # (pos, layer, kind, rest)
        for pos, name in enumerate(names):
            for r in self.layer:
                m = r.pattern.search(name)
                if m:
                    gd = m.groupdict()
                    hits.append((pos, int(gd["layer"]), gd.get("kind"), gd.get("rest")))
                    break
        if not hits:
            return Naming()
        pos, layer, kind, rest = hits[-1]
        # a kind named by any enclosing range of the same layer ("layer.3:kda" > "layer.3.attn.x")
        for _, lyr, k, _ in reversed(hits):
            if lyr == layer and k:
                kind = kind or k
        segs: list[str] = []
        if rest:
            segs.extend(s for s in rest.split(".") if s)
        for name in names[pos + 1 :]:
            segs.extend(self._segment(name))
        kind = kind or self._kind(segs)
        if not segs:
            return Naming(layer=layer, layer_kind=kind)
        block = self._block(segs[0])
        op = ".".join(segs[1:]) if len(segs) > 1 else segs[0]
        return Naming(layer=layer, layer_kind=kind, block=block, op=op)


@functools.cache
def default_scheme() -> Scheme:
    """The scheme shipped with decodescope (``analysis/naming.toml``, package data)."""
    text = resources.files("decodescope.analysis").joinpath("naming.toml").read_text("utf-8")
    return Scheme.from_toml(text)


def resolve(scheme: Scheme | str | dict[str, Any] | None) -> Scheme:
    """A :class:`Scheme` from a scheme, TOML text, a parsed dict, or ``None`` (the default)."""
    if scheme is None:
        return default_scheme()
    if isinstance(scheme, Scheme):
        return scheme
    if isinstance(scheme, str):
        return Scheme.from_toml(scheme)
    return Scheme.from_dict(scheme)
