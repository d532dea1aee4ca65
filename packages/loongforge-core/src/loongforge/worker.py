"""Entry point of one training process started by the elastic launcher (``python -m loongforge.worker``).

A user error (``LoongForgeError``) is one line on stderr and exit code 2. When several ranks fail, the first one
to record ``OUTPUT/.failed.<restart>`` (``loongforge.failures.marker_path``) prints; ranks that fail with the same
message (a ``PeerFailedError`` carries the failing rank's), or only because a failed peer closed its connections,
stay quiet, so the console shows the cause once, not one traceback per rank. Any other exception keeps its
traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from loongforge.errors import LoongForgeError
from loongforge.failures import marker_path

# what a rank sees when a failed peer's process is gone: a consequence, not a cause
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted")


def _claim(marker: Path, message: str) -> str | None:
    """Record ``message`` as this attempt's failure; returns the message another rank recorded first, if any."""
    tmp = marker.with_name(f"{marker.name}.{os.getpid()}")
    tmp.write_text(message)
    try:
        os.link(tmp, marker)  # NOTE: atomic and exclusive: a reader never sees a half-written marker
        return None
    except FileExistsError:
        return marker.read_text()
    finally:
        tmp.unlink(missing_ok=True)


def _peer_lost(exc: BaseException) -> bool:
    import torch.distributed as dist

    return isinstance(exc, getattr(dist, "DistBackendError", ())) or any(s in str(exc) for s in _PEER_LOST)


def _peer_failed(marker: Path, wait_s: float = 3.0) -> bool:
    """Whether another rank recorded a failure (it may still be writing: wait a little)."""
    deadline = time.monotonic() + wait_s
    while not marker.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="loongforge.worker")
    parser.add_argument("--recipe", required=True, help="resolved recipe (RUN/recipe.launch.yaml)")
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    from loongforge.api import load_recipe, run_in_process

    marker = marker_path(args.output)
    rank = int(os.environ.get("RANK", 0))
    try:
        recipe = load_recipe(args.recipe)
        run_in_process(recipe, output_dir=args.output, write_recipe=rank == 0)
    except LoongForgeError as exc:
        message = f"error: {exc}\n"
        if _claim(marker, message) != message:
            sys.stderr.write(message)  # NOTE: one write: lines of several ranks must not interleave
        return 2
    except Exception as exc:
        if _peer_lost(exc) and _peer_failed(marker):
            return 2  # NOTE: a consequence of a peer's error, which is already printed
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
