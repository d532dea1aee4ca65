"""JSON files of a checkpoint or exported folder (``config.json``, sidecars), read with bounds.

NOTE: a folder handed to a command may hold anything: a FIFO or ``/dev/zero`` under the file's name (a plain read
blocks or grows without end), gigabytes, or brackets nested 100k deep (``json.loads`` raises ``RecursionError``).
Only a regular file of bounded size and nesting is parsed; anything else is one line naming the file.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from loongforge.errors import CheckpointError

MAX_BYTES = 16 * 2**20  # a config.json is a few KiB
MAX_DEPTH = 64


def _depth_ok(value: Any) -> bool:
    stack = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            return False
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
    return True


def read_json(path: str | os.PathLike, *, max_bytes: int = MAX_BYTES) -> Any:
    """Parse ``path`` (a regular file of at most ``max_bytes``, nested at most ``MAX_DEPTH`` deep, no NaN)."""
    path = Path(path)
    try:
        st = os.stat(path)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{path}: not a regular file")
    if st.st_size > max_bytes:
        raise CheckpointError(f"{path}: {st.st_size:,} bytes, more than a JSON file here may hold ({max_bytes:,})")

    def no_constant(name: str):
        raise ValueError(f"{name} is not JSON")

    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
        value = json.loads(raw, parse_constant=no_constant)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    except RecursionError:
        raise CheckpointError(f"{path}: nests deeper than {MAX_DEPTH} levels") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({str(exc).splitlines()[0][:160]})") from None
    if not _depth_ok(value):
        raise CheckpointError(f"{path}: nests deeper than {MAX_DEPTH} levels")
    return value


def read_json_object(path: str | os.PathLike, *, max_bytes: int = MAX_BYTES) -> dict[str, Any]:
    """:func:`read_json` of a file that must hold a JSON object."""
    value = read_json(path, max_bytes=max_bytes)
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: a JSON object is expected, got a {type(value).__name__}")
    return value
