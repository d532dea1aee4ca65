"""Reading a file a recipe names (a policy file, a records file): a regular file of bounded size, JSON of bounded
nesting, each failure one line naming the file and the recipe key.

NOTE: a path in a recipe can name anything: ``/dev/zero`` (reading it never ends), a FIFO (opening it blocks until
a writer comes), a directory, a multi-gigabyte file, or JSON nested 100k deep (``json.loads`` recurses once per
level). Each is refused before it is read, or while it is parsed, with a bound the caller chooses.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from loongforge.errors import RecipeError

MAX_JSON_DEPTH = 64  # nested objects / lists of a data or policy file (the shipped formats use a few levels)


def read_regular_file(path: str | Path, *, key: str, max_bytes: int, what: str = "file") -> bytes:
    """The bytes of ``path`` (symlinks followed) if it is a regular file of at most ``max_bytes``."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise RecipeError(f"{what} '{path}' does not exist", key=key) from None
    except OSError as exc:
        raise RecipeError(f"{what} '{path}' cannot be read ({exc.strerror})", key=key) from None
    if not stat.S_ISREG(info.st_mode):
        kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file (a device, FIFO or socket)"
        raise RecipeError(f"{what} '{path}' is {kind}; give a regular file", key=key)
    if info.st_size > max_bytes:
        raise RecipeError(f"{what} '{path}' is {info.st_size:,} bytes, more than the {max_bytes:,} allowed", key=key)
    try:
        # NOTE: O_NONBLOCK: a FIFO swapped in after the check does not block the open
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as exc:
        raise RecipeError(f"{what} '{path}' cannot be read ({exc.strerror})", key=key) from None
    if len(data) > max_bytes:
        raise RecipeError(f"{what} '{path}' grew past the {max_bytes:,} bytes allowed while read", key=key)
    return data


def parse_json(text: str | bytes, *, where: str, key: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads(text)`` with its nesting bounded: one line naming ``where`` for invalid or too deep JSON."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise RecipeError(f"{where}: JSON nests deeper than {max_depth} levels", key=key) from None
    except (ValueError, TypeError) as exc:  # NOTE: JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise RecipeError(f"{where}: invalid JSON ({str(exc).splitlines()[0][:160]})", key=key) from None
    check_depth(value, where=where, key=key, max_depth=max_depth)
    return value


def check_depth(value: Any, *, where: str, key: str, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Refuse a loaded JSON value that nests deeper than ``max_depth`` (iterative: no recursion of its own)."""
    stack = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            raise RecipeError(f"{where}: JSON nests deeper than {max_depth} levels", key=key)
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
