"""The accelerator API: everything a backend needs to know about the device it runs on.

Core ships ``cpu`` and ``cuda``; other hardware arrives as plugins through the ``loongforge.accelerators``
entry-point group (see ``docs/plugins.md``). A backend never calls ``torch.cuda`` directly for device
handling: it asks the accelerator.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from loongforge.accelerator.adaptation import Adaptation


@dataclass(frozen=True)
class Capabilities:
    """What a device can do. Backends and kernel providers read these instead of probing hardware."""

    bf16: bool = False
    fp16: bool = False
    fp8: bool = False
    triton: bool = False
    flash_attention: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict)


class Accelerator:
    """Base class of every accelerator. Subclasses set ``name``/``device_type`` and override what differs.

    ``options`` are the recipe's ``accelerator.options``; ``env`` its ``accelerator.env`` (exported into the
    process environment by :meth:`setup_environment` before any device or process group is touched).
    """

    name: ClassVar[str] = "base"
    device_type: ClassVar[str] = "cpu"
    dist_backend: ClassVar[str] = "gloo"

    def __init__(self, *, options: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None):
        self.options = dict(options or {})
        self.env = {str(k): str(v) for k, v in (env or {}).items()}

    # --- availability -----------------------------------------------------------------------------
    @classmethod
    def unavailable_reason(cls) -> str | None:
        """None when the device can be used in this process, else one line saying why not."""
        return None

    def is_available(self) -> bool:
        return self.unavailable_reason() is None

    # --- environment & process setup --------------------------------------------------------------
    def setup_environment(self) -> None:
        """Export ``accelerator.env`` (recipe-visible tuning variables) before the device is touched."""
        for key, value in self.env.items():
            os.environ[key] = value

    # --- devices ------------------------------------------------------------------------------------
    def device_count(self) -> int:
        return 1

    def set_device(self, local_rank: int) -> None:  # noqa: B027 - optional override
        """Bind this process to its local device (no-op on CPU)."""

    def current_device_index(self) -> int:
        return 0

    def device(self, index: int | None = None) -> torch.device:
        """The torch device this process computes on."""
        if self.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.device_type, self.current_device_index() if index is None else index)

    def synchronize(self) -> None:  # noqa: B027 - optional override
        """Wait for queued device work to finish (no-op on CPU)."""

    # --- memory -------------------------------------------------------------------------------------
    def memory_stats(self) -> dict[str, float]:
        """Memory figures in bytes: at least ``allocated`` and ``peak_allocated`` (0 when unknown)."""
        return {"allocated": 0.0, "peak_allocated": 0.0}

    def reset_peak_memory(self) -> None:  # noqa: B027 - optional override
        """Reset the peak-memory counter."""

    def empty_cache(self) -> None:  # noqa: B027 - optional override
        """Release cached device memory."""

    # --- RNG ----------------------------------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        """Seed every RNG this device uses."""
        torch.manual_seed(seed)

    def get_rng_state(self) -> dict[str, Any]:
        """Device RNG state, for exact resume."""
        return {"cpu": torch.get_rng_state()}

    def set_rng_state(self, state: Mapping[str, Any]) -> None:
        torch.set_rng_state(state["cpu"])

    # --- capabilities & hooks -------------------------------------------------------------------
    def capabilities(self) -> Capabilities:
        return Capabilities()

    def resolve_precision(self, precision: str) -> str:
        """``auto`` → bf16 on devices with bf16 support (CPU excluded: fp32 is faster there), else fp32."""
        if precision != "auto":
            return precision
        return "bf16" if self.device_type != "cpu" and self.capabilities().bf16 else "fp32"

    def peak_flops(self, dtype: torch.dtype) -> float | None:
        """Dense peak FLOP/s for ``dtype`` on one device, used for MFU; None when unknown."""
        return None

    def adaptations(self, backend: str) -> Sequence[Adaptation]:
        """Extra adaptations this accelerator needs for ``backend`` (beyond what the backend ships per
        ``device_type``). Plugins override this to adapt e.g. megatron-core to their runtime."""
        return ()

    def kernel_overrides(self) -> Mapping[str, Any]:
        """Kernel implementations this accelerator provides itself: op name -> callable. Ops not listed fall
        back to the kernel registry's normal choice."""
        return {}

    def describe(self) -> str:
        return f"{self.name} ({self.device_type}, dist backend {self.dist_backend})"
