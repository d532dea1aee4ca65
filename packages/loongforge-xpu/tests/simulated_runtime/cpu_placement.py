"""Places the simulated runtime's devices on the CPU.

The real ``torch_xmlir`` presents the XPU as ``cuda`` (device type ``cuda``, device calls through ``torch.cuda``), and
the plugin treats every runtime that way. The CPU stand-in cannot: its tensors live on the CPU. :func:`install` makes
the plugin's ``load_runtime`` describe the stand-in as a ``cpu`` runtime whose device calls go through
``torch_xmlir.DEVICE``; everything else (finding the module, importing it after the environment is exported, the
errors) stays the plugin's own code.
"""

from __future__ import annotations

import dataclasses
import importlib.abc
import importlib.machinery
import sys

ACCELERATOR_MODULE = "loongforge_xpu.accelerator"


def _on_cpu(load_runtime):
    def load():
        rt = load_runtime()
        return dataclasses.replace(rt, device_type="cpu", device_module=rt.module.DEVICE)

    load.on_cpu = True
    return load


def place(accelerator_module) -> None:
    """Wrap the accelerator module's ``load_runtime`` (once)."""
    if not getattr(accelerator_module.load_runtime, "on_cpu", False):
        accelerator_module.load_runtime = _on_cpu(accelerator_module.load_runtime)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs :func:`place` right after ``loongforge_xpu.accelerator`` is executed (for subprocesses)."""

    def find_spec(self, name, path=None, target=None):
        if name != ACCELERATOR_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_place(module):
            exec_module(module)
            place(module)

        spec.loader.exec_module = exec_and_place
        return spec


def install() -> None:
    """Place the stand-in on the CPU in this process: now if the plugin is imported, else when it is."""
    if ACCELERATOR_MODULE in sys.modules:
        place(sys.modules[ACCELERATOR_MODULE])
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
