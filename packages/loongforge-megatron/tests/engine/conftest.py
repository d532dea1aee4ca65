"""Multi-process helpers: fork N gloo ranks with a free port and a deadlock watchdog."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


def _child(
    fn: Callable[..., Any], rank: int, world: int, port: int, out: Path, kwargs: dict[str, Any]
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    import torch

    # NOTE: 2 ranks on 2 cores; one thread each also keeps OpenMP out of the forked children.
    torch.set_num_threads(1)
    try:
        result = fn(rank=rank, world=world, **kwargs)
        torch.save(result, out / f"rank{rank}.pt")
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def run_ranks(
    fn: Callable[..., Any], *, world: int, out: Path, timeout_s: float = 300, **kwargs: Any
) -> list[Any]:
    """Run ``fn(rank=, world=, **kwargs)`` in ``world`` forked processes; return each rank's result.

    NOTE: fork (not spawn) so the children reuse the parent's ~20 s megatron-core import. A rank that fails
    makes the others hang in a collective, so the watchdog kills everything at the first failure or timeout.
    """
    import megatron.core.models.gpt  # noqa: F401  (import once, before forking)
    from loongforge_megatron.engine.parallel_state import free_port

    ctx = mp.get_context("fork")
    port = free_port()
    out.mkdir(parents=True, exist_ok=True)
    procs = [ctx.Process(target=_child, args=(fn, r, world, port, out, kwargs)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    failed = None
    while any(p.is_alive() for p in procs):
        failed = next((r for r, p in enumerate(procs) if p.exitcode not in (None, 0)), None)
        if failed is not None or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    errors = [(out / f"rank{r}.err") for r in range(world) if (out / f"rank{r}.err").exists()]
    if errors:
        pytest.fail("rank failed:\n" + "\n".join(e.read_text() for e in errors))
    if failed is not None or any(p.exitcode != 0 for p in procs):
        pytest.fail(f"rank exit codes {[p.exitcode for p in procs]} (timeout {timeout_s}s = deadlock?)")
    import torch

    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="session")
def ranks():
    """The :func:`run_ranks` launcher."""
    return run_ranks
