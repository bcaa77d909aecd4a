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
        """Compile a parsed scheme. ``extends = "default"`` puts its rules ahead of the shipped
        ones (first match wins), so a file need only hold what it adds."""
        if not isinstance(data, dict):
            raise ValueError("naming scheme: expected a table of rule lists")
        base = default_scheme() if data.get("extends") == "default" else None

        def rules(key: str, value_key: str | None = None, group: str | None = None):
            out = []
            entries = data.get(key, [])
            if not isinstance(entries, list):
                raise ValueError(f"naming scheme: {key!r} must be an array of tables ([[{key}]])")
            for i, r in enumerate(entries):
                if not isinstance(r, dict):
                    raise ValueError(f"naming scheme: [[{key}]] rule {i} is not a table")
                try:
                    pat = re.compile(r["pattern"])
                except (KeyError, TypeError, re.error) as e:
                    raise ValueError(f"naming scheme: [[{key}]] rule {i}: bad pattern: {e}") from e
                if value_key is not None and not isinstance(r.get(value_key), str):
                    raise ValueError(f"naming scheme: [[{key}]] rule {i} lacks {value_key!r}")
                if group is not None and group not in pat.groupindex:
                    raise ValueError(
                        f"naming scheme: [[{key}]] rule {pat.pattern!r} has no group {group!r}"
                    )
                out.append(Rule(r.get("scheme", ""), pat, r.get(value_key) if value_key else None))
            if base is not None:
                out.extend(getattr(base, key))
            return tuple(out)

        default_kind = data.get("default_kind", base.default_kind if base else "layer")
        return cls(
            unwrap=rules("unwrap", group="name"),
            step=rules("step"),
            layer=rules("layer", group="layer"),
            segment=rules("segment", group="seg"),
            block=rules("block", "block"),
            kind=rules("kind", "kind"),
            default_kind=default_kind,
        )

    @classmethod
    def from_toml(cls, text: str) -> Scheme:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"naming scheme: not valid TOML: {e}") from e
        return cls.from_dict(data)

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
