"""Helpers for checkpoint tests: tiny recipes, CLI launches in their own process group, forked gloo ranks."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml


def write_recipe(path: Path, hf_dir: Path, *, steps: int = 6, parallel: dict | None = None, **checkpoint) -> Path:
    """A CPT recipe on a tiny HF model: synthetic data, fp32 on the CPU, deterministic."""
    r = {
        "backend": "megatron",
        "model": {"hf": str(hf_dir)},
        "data": {"format": "synthetic", "seq_length": 32},
        "train": {"stage": "cpt", "steps": steps, "global_batch_size": 4, "micro_batch_size": 1, "precision": "fp32",
                  "lr": 1e-3, "seed": 7},
        "checkpoint": {"load": str(hf_dir), **checkpoint},
        "parallel": parallel or {},
        "accelerator": "cpu",
        "logging": {"tensorboard": False},
    }
    path.write_text(yaml.safe_dump(r))
    return path


def cli(*args: str, timeout_s: float = 180) -> subprocess.CompletedProcess:
    """``python -m loongforge ARGS`` in its own session (so a timeout can kill the whole process tree)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen([sys.executable, "-m", "loongforge", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        pytest.fail(f"loongforge {' '.join(args)} timed out after {timeout_s}s:\n{out[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def _child(fn: Callable[..., Any], rank: int, world: int, port: int, out: Path, kwargs: dict[str, Any]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import torch

    torch.set_num_threads(1)
    try:
        torch.save(fn(rank=rank, world=world, **kwargs), out / f"rank{rank}.pt")
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def run_ranks(fn: Callable[..., Any], *, world: int, out: Path, timeout_s: float = 240, **kwargs: Any) -> list[Any]:
    """``fn(rank=, world=, **kwargs)`` in ``world`` forked gloo ranks with a watchdog; each rank's result.

    NOTE: fork so the children reuse the parent's megatron-core import (same helper as tests/engine).
    """
    import megatron.core.models.gpt  # noqa: F401  (import once, before forking)
    import torch
    from loongforge_megatron.engine.parallel_state import free_port

    ctx = mp.get_context("fork")
    port = free_port()
    out.mkdir(parents=True, exist_ok=True)
    procs = [ctx.Process(target=_child, args=(fn, r, world, port, out, kwargs)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    while any(p.is_alive() for p in procs):
        if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    errors = [(out / f"rank{r}.err").read_text() for r in range(world) if (out / f"rank{r}.err").exists()]
    if errors:
        pytest.fail("rank failed:\n" + "\n".join(errors))
    if any(p.exitcode != 0 for p in procs):
        pytest.fail(f"rank exit codes {[p.exitcode for p in procs]} (timeout {timeout_s}s = deadlock?)")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="session")
def recipe():
    """:func:`write_recipe`."""
    return write_recipe


@pytest.fixture(scope="session")
def loongforge_cli():
    """:func:`cli`."""
    return cli


@pytest.fixture(scope="session")
def ranks():
    """:func:`run_ranks`."""
    return run_ranks

