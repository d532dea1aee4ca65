"""Entry point of one training process started by the elastic launcher (``python -m loongforge.worker``).

A user error (``LoongForgeError``) is one line on stderr and exit code 2. When several ranks fail, the first one
to record ``OUTPUT/.failed`` prints; ranks that fail with the same message, or only because a failed peer closed
its connections, stay quiet, so the console shows the cause once, not one traceback per rank.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from loongforge.errors import LoongForgeError

FAILED = ".failed"  # OUTPUT/.failed: the first failing rank's one-line error (this launch only)


def _claim(marker: Path, message: str) -> str | None:
    """Record ``message`` as the launch's failure; returns the message recorded first by another rank, if any."""
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return marker.read_text()
    with os.fdopen(fd, "w") as f:
        f.write(message)
    return None


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

    marker = Path(args.output) / FAILED
    rank = int(os.environ.get("RANK", 0))
    try:
        recipe = load_recipe(args.recipe)
        run_in_process(recipe, output_dir=args.output, write_recipe=rank == 0)
    except LoongForgeError as exc:
        message = f"error: {exc}\n"
        if _claim(marker, message) != message:
            sys.stderr.write(message)  # NOTE: one write: lines of several ranks must not interleave
        return 2
    except Exception:
        if _peer_failed(marker):
            return 2  # NOTE: a consequence (e.g. "Connection closed by peer"): the cause is already printed
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
