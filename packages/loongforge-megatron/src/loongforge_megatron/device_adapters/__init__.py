"""Device adaptations of megatron-core: what it takes to run its CUDA-only code paths on other devices.

``adaptations_for(device_type)`` returns the named list for a device type (on ``cuda`` only faster stand-ins for megatron's no-TE/Apex fallbacks);
``adapted(accelerator)`` applies that list plus the accelerator's own ``adaptations("megatron")`` for the
duration of a ``with`` block. Nothing is patched at import time.
"""

from __future__ import annotations

from collections.abc import Sequence

from loongforge.accelerator.adaptation import Adaptation, AdaptationSet


def adaptations_for(device_type: str) -> list[Adaptation]:
    """The adaptations megatron-core needs on ``device_type`` (``cuda``: only fused fallbacks without TE/Apex)."""
    if device_type == "cpu":
        from loongforge_megatron.device_adapters.cpu import cpu_adaptations

        return cpu_adaptations()
    if device_type == "cuda":
        from loongforge_megatron.device_adapters.cuda import cuda_adaptations

        return cuda_adaptations()
    return []


def adapted(accelerator, *, grad_accum_fusion: bool = False, model: Sequence[Adaptation] = ()) -> AdaptationSet:
    """An :class:`AdaptationSet` for ``accelerator``: use as ``with adapted(acc): ...`` around a run.
    ``grad_accum_fusion``: also the stand-in for Apex's fused weight-gradient accumulation where Apex is absent;
    ``model``: the adaptations the run's model needs (e.g. a vision tower's norms), applied after the device's."""
    extra = list(accelerator.adaptations("megatron"))
    if grad_accum_fusion:
        from loongforge_megatron.device_adapters.grad_accum import adaptation

        extra += [a for a in (adaptation(),) if a is not None]
    return AdaptationSet(adaptations_for(accelerator.device_type) + extra + list(model))


__all__ = ["adaptations_for", "adapted"]
