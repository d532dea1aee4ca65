"""Reading a resumable checkpoint's files: ``meta.json`` and the rank files, each failure one line naming the file.

Rank files are read with ``torch.load(weights_only=True)``: tensors and plain containers only, never code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from loongforge.errors import CheckpointError


class UnreadableCheckpointError(CheckpointError):
    """A checkpoint file is truncated, garbled or missing (resume falls back to an older checkpoint)."""


def _first_line(exc: BaseException) -> str:
    """The first sentence of the error (torch's zip reader appends a paragraph of advice)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = lines[0] if lines else type(exc).__name__
    return text.split(". ", 1)[0].rstrip(".")[:160]


def read_meta(path: Path) -> dict[str, Any]:
    """``meta.json`` of a megatron checkpoint: the saved layout and every rank's parallel coordinates."""
    try:
        meta = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UnreadableCheckpointError(f"{path} is missing") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UnreadableCheckpointError(f"{path} is not valid JSON ({_first_line(exc)})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("layout"), dict) or not isinstance(meta.get("ranks", []), list):
        raise UnreadableCheckpointError(f"{path}: expected an object with 'layout' and 'ranks' keys")
    for key in ("tp", "pp", "vpp", "cp", "ep", "etp", "dp", "distributed_optimizer"):
        if not isinstance(meta["layout"].get(key), int):
            raise UnreadableCheckpointError(f"{path}: key 'layout.{key}' is missing or not an integer")
    return meta


def read_rank_file(path: Path) -> dict[str, Any]:
    """One rank's state (model, optimizer, scheduler, RNG, step)."""
    if not Path(path).is_file():
        raise UnreadableCheckpointError(f"{path} is missing")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - truncated zip, garbled or refused pickle: all one line
        raise UnreadableCheckpointError(f"{path} is unreadable ({_first_line(exc)})") from None
    missing = [k for k in ("step", "model", "optimizer", "scheduler", "rng") if not isinstance(state, dict) or k not in state]
    if missing:
        raise UnreadableCheckpointError(f"{path} is not a LoongForge rank file (no '{missing[0]}')")
    return state
