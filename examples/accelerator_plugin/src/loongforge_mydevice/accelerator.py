"""Accelerator ``mydevice``: a stand-in for real hardware, computing on the CPU.

A real plugin replaces the bodies with calls into its runtime (imported lazily, inside the methods), returns
its collective backend's name from ``dist_backend`` and says in ``unavailable_reason`` what is missing.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from loongforge.accelerator import Adaptation, Capabilities
from loongforge.accelerator.base import Accelerator
from loongforge.errors import RecipeError


class MyDeviceAccelerator(Accelerator):
    name = "mydevice"
    device_type = "cpu"  # the torch device type tensors live on
    dist_backend = "gloo"  # the torch.distributed backend name of the device's collective library

    def __init__(self, *, options: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None):
        super().__init__(options=options, env=env)
        # Validate recipe-visible settings early, naming the key path.
        for key in self.env:
            if key.lower().startswith("mydev_") and not key.isupper():
                raise RecipeError("environment variable names are case-sensitive", key=f"accelerator.env.{key}")

    @classmethod
    def unavailable_reason(cls) -> str | None:
        # Find the runtime without importing it (a real runtime may read its environment at import time).
        if os.environ.get("MYDEVICE_FORCE_MISSING") or importlib.util.find_spec("torch") is None:
            return "the mydevice runtime is not installed (pip install mydevice-runtime)"
        return None

    def setup_environment(self) -> None:
        os.environ.setdefault("MYDEV_THREADS", "1")  # a documented default; the recipe's env wins
        super().setup_environment()

    def device_count(self) -> int:
        return 1

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def capabilities(self) -> Capabilities:
        return Capabilities(bf16=True, fp16=False, fp8=False, triton=False, extra={"example": True})

    def adaptations(self, backend: str) -> Sequence[Adaptation]:
        return ()  # e.g. replace_attr(...) entries that adapt a backend's library to this device

    def kernel_overrides(self) -> Mapping[str, Callable[..., Any]]:
        from loongforge_mydevice.kernels import rms_norm

        return {"rms_norm": rms_norm}
