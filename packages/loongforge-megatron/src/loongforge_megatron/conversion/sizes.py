"""Sizes read from an HF ``config.json`` that remember the keys they came from, so that a tensor whose shape
disagrees with the config is reported with the key, its value and the shape (``Entry.shape`` of the name maps
computes HF shapes with these)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loongforge.errors import CheckpointError

# NOTE: far above any real model's dimension (2**24 = 16M) yet small enough that products of a few never overflow
# what a shape can hold; a config beyond it is malformed, not large
MAX_SIZE = 2**24


class Size:
    """An integer with the config keys (and values) it was computed from, e.g. ``num_attention_heads 4 x
    head_dim 16``."""

    __slots__ = ("keys", "value")

    def __init__(self, value: int, keys: str):
        self.value, self.keys = value, keys

    @staticmethod
    def of(x: Size | int) -> Size:
        return x if isinstance(x, Size) else Size(int(x), str(int(x)))

    def _op(self, other: Size | int, sym: str, fn) -> Size:
        o = Size.of(other)
        return Size(fn(self.value, o.value), f"{self.keys} {sym} {o.keys}")

    def __mul__(self, other: Size | int) -> Size:
        return self._op(other, "x", lambda a, b: a * b)

    def __rmul__(self, other: int) -> Size:
        return Size.of(other)._op(self, "x", lambda a, b: a * b)

    def __add__(self, other: Size | int) -> Size:
        return self._op(other, "+", lambda a, b: a + b)

    def __radd__(self, other: int) -> Size:
        return Size.of(other)._op(self, "+", lambda a, b: a + b)

    def __floordiv__(self, other: Size | int) -> Size:
        return self._op(other, "/", lambda a, b: a // b if b else 0)

    def __int__(self) -> int:
        return self.value

    def __repr__(self) -> str:
        return self.keys


class Sizes:
    """A (sub-)config whose integer keys read as :class:`Size`, each checked to be a positive integer; a missing
    or mistyped key is a one-line :class:`CheckpointError` naming the file and the key path."""

    def __init__(self, cfg: dict[str, Any], *, where: str | Path, prefix: str = ""):
        self._cfg, self.where, self._prefix = cfg, where, prefix

    def _path(self, key: str) -> str:
        return self._prefix + key

    def __getitem__(self, key: str) -> Size:
        if self._cfg.get(key) is None:
            raise CheckpointError(f"{self.where}: key '{self._path(key)}' is missing")
        return self._size(key)

    def get(self, key: str, default: Size | int | None = None) -> Size | None:
        if self._cfg.get(key) is None:
            return None if default is None else Size.of(default)
        return self._size(key)

    def _size(self, key: str) -> Size:
        v = self._cfg[key]
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_SIZE:
            raise CheckpointError(f"{self.where}: key '{self._path(key)}' must be an integer from 1 to {MAX_SIZE}, "
                                  f"got {_short(v)}")
        return Size(v, f"{self._path(key)} {v}")

    def flag(self, key: str, default: bool = False) -> bool:
        v = self._cfg.get(key, default)
        if not isinstance(v, bool) and v is not None:
            raise CheckpointError(f"{self.where}: key '{self._path(key)}' must be true or false, got {_short(v)}")
        return bool(v)

    def sub(self, key: str) -> Sizes:
        v = self._cfg.get(key)
        if not isinstance(v, dict):
            raise CheckpointError(f"{self.where}: key '{self._path(key)}' must be an object, got {_short(v)}")
        return Sizes(v, where=self.where, prefix=f"{self._path(key)}.")

    def raw(self, key: str, default: Any = None) -> Any:
        return self._cfg.get(key, default)


def _short(v: Any) -> str:
    text = repr(v) if not isinstance(v, (dict, list)) else type(v).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def as_shape(dims: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in dims)


def describe(dims: Any) -> str:
    """The config keys behind a shape's dimensions (constants left out), e.g. ``vocab_size 100, hidden_size 32``."""
    seen: list[str] = []
    for d in dims:
        if isinstance(d, Size) and not d.keys.isdigit() and d.keys not in seen:
            seen.append(d.keys)
    return ", ".join(seen)
