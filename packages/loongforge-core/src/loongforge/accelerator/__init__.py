"""Accelerators: the built-in ``cpu`` and ``cuda`` plus plugins from ``loongforge.accelerators``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from loongforge.accelerator.adaptation import Adaptation, AdaptationSet, active, applied, replace_attr
from loongforge.accelerator.base import Accelerator, Capabilities
from loongforge.errors import PluginError

__all__ = [
    "Accelerator",
    "Adaptation",
    "AdaptationSet",
    "Capabilities",
    "active",
    "applied",
    "get_accelerator",
    "replace_attr",
]


def get_accelerator(
    name: str = "auto", *, options: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
) -> Accelerator:
    """Instantiate the accelerator ``name`` (``auto`` picks cuda when usable, else cpu).

    Raises :class:`PluginError` (one line) when the plugin is missing or its runtime is absent.
    """
    from loongforge import registry

    if name == "auto":
        from loongforge.accelerator.cuda import CudaAccelerator

        name = "cuda" if CudaAccelerator.unavailable_reason() is None else "cpu"
    cls = registry.accelerators.get(name)
    reason = cls.unavailable_reason()
    if reason:
        raise PluginError(f"accelerator '{name}' is not available: {reason}")
    return cls(options=options, env=env)
