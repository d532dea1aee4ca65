"""Reading a JSON file a user hands us (a checkpoint's ``config.json``, a recipe's policy or records file) with
bounds: a regular file of bounded size, JSON of bounded nesting, each failure one line naming the file.

The caller says which error a failure is (``error``: a :class:`~loongforge.errors.LoongForgeError` class, or a
``functools.partial`` of one that adds the recipe key), so the same reader serves checkpoints and recipes.

NOTE: a path can name anything: ``/dev/zero`` (reading it never ends), a FIFO (opening it blocks until a writer
comes), a directory, a multi-gigabyte file, or JSON nested 100k deep (``json.loads`` recurses once per level and
raises ``RecursionError``). Each is refused before it is read, or while it is parsed, with a bound the caller
chooses.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from typing import Any

ErrorFactory = Callable[[str], Exception]

MAX_BYTES = 16 * 2**20  # a config.json or a policy file is a few KiB
MAX_DEPTH = 64  # nested objects / lists (the shipped formats use a few levels)


def read_regular_file(path: str | os.PathLike, *, error: ErrorFactory, max_bytes: int = MAX_BYTES,
                      what: str = "file") -> bytes:
    """The bytes of ``path`` (symlinks followed) if it is a regular file of at most ``max_bytes``; ``error(message)``
    otherwise, the message naming ``what`` and the path."""
    name = f"{what} '{path}'"
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise error(f"{name} cannot be read: it does not exist") from None
    except OSError as exc:
        raise error(f"{name} cannot be read ({exc.strerror or exc})") from None
    if not stat.S_ISREG(info.st_mode):
        kind = "a directory" if stat.S_ISDIR(info.st_mode) else "a device, FIFO or socket"
        raise error(f"{name} is not a regular file ({kind}); give a regular file")
    if info.st_size > max_bytes:
        raise error(f"{name} is {info.st_size:,} bytes, more than a {what} here may hold ({max_bytes:,})")
    try:
        # NOTE: O_NONBLOCK: a FIFO swapped in after the check does not block the open
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as exc:
        raise error(f"{name} cannot be read ({exc.strerror or exc})") from None
    if len(data) > max_bytes:
        raise error(f"{name} grew past the {max_bytes:,} bytes a {what} here may hold while it was read")
    return data


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_json(text: str | bytes, *, error: ErrorFactory, where: str, max_depth: int = MAX_DEPTH,
               allow_nan: bool = False) -> Any:
    """``json.loads(text)`` with its nesting bounded; ``error(message)`` naming ``where`` for invalid or too deep
    JSON. ``NaN`` / ``Infinity`` are refused unless ``allow_nan`` (a caller whose schema checks every number)."""
    try:
        value = json.loads(text, **({} if allow_nan else {"parse_constant": _no_constant}))
    except RecursionError:
        raise error(f"{where}: JSON nests deeper than {max_depth} levels") from None
    except (ValueError, TypeError) as exc:  # NOTE: JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise error(f"{where}: not valid JSON ({str(exc).splitlines()[0][:160]})") from None
    _check_depth(value, error=error, where=where, max_depth=max_depth)
    return value


def _check_depth(value: Any, *, error: ErrorFactory, where: str, max_depth: int) -> None:
    """Refuse a loaded value that nests deeper than ``max_depth`` (iterative: no recursion of its own)."""
    stack = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            raise error(f"{where}: JSON nests deeper than {max_depth} levels")
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)


def read_json(path: str | os.PathLike, *, error: ErrorFactory, max_bytes: int = MAX_BYTES,
              what: str = "JSON file") -> Any:
    """The JSON value of ``path``: a regular file of at most ``max_bytes``, nested at most ``MAX_DEPTH`` deep, no
    NaN; ``error(message)`` naming ``what`` and the path otherwise."""
    data = read_regular_file(path, error=error, max_bytes=max_bytes, what=what)
    return parse_json(data, error=error, where=f"{what} '{path}'")


def read_json_object(path: str | os.PathLike, *, error: ErrorFactory, max_bytes: int = MAX_BYTES,
                     what: str = "JSON file") -> dict[str, Any]:
    """:func:`read_json` of a file that must hold a JSON object."""
    value = read_json(path, error=error, max_bytes=max_bytes, what=what)
    if not isinstance(value, dict):
        raise error(f"{what} '{path}': a JSON object is expected, got a {type(value).__name__}")
    return value
