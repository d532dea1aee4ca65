"""Helpers for checkpoint tests: tiny recipes and CLI launches in their own process group (ranks of the
workspace harness, tests/support/rank_harness.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


@pytest.fixture(scope="session")
def recipe():
    """:func:`write_recipe`."""
    return write_recipe


@pytest.fixture(scope="session")
def loongforge_cli():
    """:func:`cli`."""
    return cli
