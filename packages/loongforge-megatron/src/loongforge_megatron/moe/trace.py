"""Routing traces: a run's per-step, per-layer expert loads (``logging.moe_trace: true``), for ``loongforge moe
simulate`` to replay.

``moe_trace.jsonl`` in the run directory: one JSON line per training step, ``{"step": N, "ep_size": EP,
"tokens_per_expert": [[tokens of expert e in layer l, ...], ...]}`` (summed over all ranks; all-zero rows are the
dense layers). Appended step by step, so a run that stops early still leaves the steps it made.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from loongforge_megatron.moe.placement import PlacementError

FILE_NAME = "moe_trace.jsonl"


class TraceWriter:
    """Appends one line per step to ``run_dir / moe_trace.jsonl`` (main rank only)."""

    def __init__(self, run_dir: str | Path, *, ep_size: int):
        self.path = Path(run_dir) / FILE_NAME
        self.ep_size = ep_size

    def write(self, step: int, tokens_per_expert: list[list[int]]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, "ep_size": self.ep_size, "tokens_per_expert": tokens_per_expert}) + "\n")


def read_trace(path: str | Path) -> tuple[np.ndarray, int]:
    """``(loads[steps, layers, experts], ep_size)`` of a ``moe_trace.jsonl``; a resumed run's repeated steps keep
    their last record. :class:`PlacementError` (one line, naming the file and line) for anything else."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise PlacementError(f"{path}: cannot read the trace ({e.strerror or e})") from None
    by_step: dict[int, list] = {}
    ep = 1
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            step, rows, ep = int(rec["step"]), rec["tokens_per_expert"], int(rec.get("ep_size", 1))
            arr = np.asarray(rows, dtype=np.float64)
        except (ValueError, KeyError, TypeError) as e:
            raise PlacementError(f"{path}:{n}: not a moe_trace.jsonl record ({type(e).__name__}: {e})") from None
        if arr.ndim != 2 or (by_step and arr.shape != next(iter(by_step.values())).shape):
            raise PlacementError(f"{path}:{n}: tokens_per_expert must be [layers][experts] of one shape in every line")
        by_step[step] = arr
    if len(by_step) < 2:
        raise PlacementError(f"{path}: a trace needs at least 2 steps, found {len(by_step)}")
    return np.stack([by_step[s] for s in sorted(by_step)]), ep
