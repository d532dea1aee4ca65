"""What every policy's size dataclass shares: recipe overrides validated by field name, and the dict form
written into exports. No torch, no LeRobot import (recipes resolve here)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import Field, asdict, fields, replace
from typing import Any, ClassVar, Self


class ArchMixin:
    """Mixin of a policy's frozen size dataclass (``TinyVLAArch``, ``GrootArch``, ...).

    Every such dataclass carries ``stats`` (normalisation statistics, filled at run time): it is not a size, so
    it is neither overridable by name in the error message, nor exported, nor mirrored into LeRobot's config.

    An integer field overridden by a recipe must be positive (a size, a count), except those named in
    ``may_be_zero`` (flags, ids, "0 = the library's default"), which must not be negative.
    """

    may_be_zero: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def size_fields(cls) -> tuple[Field, ...]:
        """The fields that configure the model, in declaration order (all but ``stats``)."""
        return tuple(f for f in fields(cls) if f.name != "stats")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Self:
        """The arch of a dict such as an export's ``config.json``: other keys are ignored, missing ones default."""
        return cls(**{f.name: d[f.name] for f in cls.size_fields() if f.name in d})

    def with_overrides(self, **kw: Any) -> Self:
        """A copy with ``kw`` replaced; an unknown name raises and lists the allowed ones."""
        known = {f.name for f in fields(self)}
        bad = sorted(set(kw) - known)
        if bad:
            raise ValueError(f"unknown architecture fields {bad}; allowed: {sorted(known - {'stats'})}")
        for name, value in kw.items():
            want = type(getattr(self, name))
            if value is None and want is str:
                kw[name] = ""
            elif want in (int, str) and (type(value) is not want):
                kind = "an integer" if want is int else "a string"
                raise ValueError(f"architecture field '{name}' must be {kind}, got {value!r}")
            elif want is int and value < (0 if name in self.may_be_zero else 1):
                least = "0 or more" if name in self.may_be_zero else "a positive integer"
                raise ValueError(f"architecture field '{name}' must be {least}, got {value}")
        return replace(self, **kw)

    def to_dict(self) -> dict[str, Any]:
        """The sizes as plain values (no ``stats``)."""
        d = asdict(self)
        d.pop("stats")
        return d

    @property
    def served_steps(self) -> int:
        """Actions one inference answers (what a server's metadata gives as ``chunk_size``): the trained chunk,
        unless a policy answers fewer (a world model conditioned on its first frame drops that frame's)."""
        return self.chunk_size
