"""Compare a checkpoint's tensor names and shapes with what a model expects, with errors that name the tensor."""

from __future__ import annotations

from collections.abc import Mapping

from loongforge.errors import CheckpointError


def check_shapes(
    expected: Mapping[str, tuple[int, ...]], actual: Mapping[str, tuple[int, ...]], *, where: str = "checkpoint"
) -> None:
    """Raise CheckpointError naming the first missing, unexpected or mis-shaped tensor (sorted by name)."""
    missing = sorted(set(expected) - set(actual))
    unexpected = sorted(set(actual) - set(expected))
    if missing:
        raise CheckpointError(
            f"{where}: missing tensor '{missing[0]}' (expected shape {tuple(expected[missing[0]])})"
            + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
            + "; the checkpoint does not match the model architecture"
        )
    if unexpected:
        raise CheckpointError(
            f"{where}: unexpected tensor '{unexpected[0]}' (shape {tuple(actual[unexpected[0]])})"
            + (f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else "")
            + "; the checkpoint does not match the model architecture"
        )
    for name in sorted(expected):
        if tuple(expected[name]) != tuple(actual[name]):
            raise CheckpointError(
                f"{where}: tensor '{name}' has shape {tuple(actual[name])}, the model expects "
                f"{tuple(expected[name])}"
            )
