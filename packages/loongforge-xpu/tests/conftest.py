"""Fixtures: the CPU-backed simulated Kunlun runtime (``simulated_runtime/torch_xmlir``), in-process and for
subprocesses, and a clean registry/environment around each test."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

SIM_DIR = Path(__file__).parent / "simulated_runtime"
RUNTIME_ENV = ("XPU_VISIBLE_DEVICES", "XMLIR_ENABLE_NEW_PG")


def _forget_runtime() -> None:
    for name in [m for m in sys.modules if m == "torch_xmlir" or m.startswith("torch_xmlir.")]:
        del sys.modules[name]


@pytest.fixture(autouse=True)
def _isolated(monkeypatch):
    """Each test starts with no runtime imported and no Kunlun variables set; whatever it exports is undone."""
    from loongforge import registry

    saved = {k: v for k, v in os.environ.items() if k.startswith(("XMLIR_", "BKCL_")) or k in RUNTIME_ENV}
    for k in saved:
        monkeypatch.delenv(k)
    _forget_runtime()
    registry.accelerators.reset()
    yield
    _forget_runtime()
    for k in [k for k in os.environ if k.startswith(("XMLIR_", "BKCL_")) or k in RUNTIME_ENV]:
        del os.environ[k]
    os.environ.update(saved)
    registry.accelerators.reset()


@pytest.fixture
def simulated_runtime(monkeypatch):
    """Make ``import torch_xmlir`` find the simulated runtime in this process, placed on the CPU."""
    import loongforge_xpu.accelerator as accelerator

    monkeypatch.syspath_prepend(str(SIM_DIR))
    monkeypatch.setattr(accelerator, "load_runtime", accelerator.load_runtime)  # undone after the test
    import cpu_placement

    cpu_placement.place(accelerator)
    return SIM_DIR


@pytest.fixture
def sim_env():
    """Environment for a subprocess (``loongforge train``) that sees the simulated runtime, placed on the CPU (the
    folder's ``sitecustomize``)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SIM_DIR), *filter(None, [env.get("PYTHONPATH")])])
    return env
