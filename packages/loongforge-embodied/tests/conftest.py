"""Shared fixture: the subprocess environment (offline HF cache, one thread per rank)."""

from __future__ import annotations

import os

import pytest


@pytest.fixture
def env(tmp_path) -> dict[str, str]:
    # NOTE: a private HF_HOME and offline flags: nothing may come from the hub. One OMP thread per process:
    # on a shared 2-core machine more threads make tiny matmuls 20x slower (spin-waiting).
    return {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "OMP_NUM_THREADS": "1", "SDL_VIDEODRIVER": "dummy"}
