"""What megatron-core needs on Kunlun, beyond what the megatron backend does for the device type.

On real hardware xpytorch presents the XPU as ``cuda`` (CUDA-compatible mode), so megatron-core's CUDA paths
run as they are and the megatron backend adds nothing for ``cuda``; the only Kunlun-specific difference megatron
sees is the collective backend's *name*. xpytorch's own CUDA layer reports its BKCL group as ``nccl``; when this
plugin uses the BKCL group under its registered name (``kccl`` / ``bccl``), megatron-core's NCCL-keyed branches
(``megatron.core.utils``: the straggler detector's device timing) must see ``nccl`` too.

In the CPU-backed simulation the device type is ``cpu`` and the megatron backend's CPU adaptations apply; nothing
is added here.
"""

from __future__ import annotations

import inspect
from typing import Any

from loongforge.accelerator.adaptation import Adaptation, replace_attr

from loongforge_xpu.runtime import BKCL_BACKENDS

UTILS = "megatron.core.utils"


class _DistributedView:
    """``torch.distributed`` whose ``get_backend`` reports BKCL groups as ``nccl``."""

    def __init__(self, dist: Any):
        self._dist = dist

    def get_backend(self, group: Any = None) -> str:
        name = str(self._dist.get_backend(group))
        return "nccl" if name in BKCL_BACKENDS else name

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dist, name)


class TorchView:
    """A stand-in for the ``torch`` module seen by one megatron-core module (everything else unchanged)."""

    def __init__(self, torch_module: Any):
        self._torch = torch_module
        self.distributed = _DistributedView(torch_module.distributed)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)


def _mentions_nccl_branch(_original: Any) -> bool:
    import importlib

    return 'backend == "nccl"' in inspect.getsource(importlib.import_module(UTILS))


def megatron_adaptations(*, device_type: str, dist_backend: str) -> list[Adaptation]:
    """The named adaptations for a Kunlun run of the megatron backend."""
    if device_type != "cuda" or dist_backend not in BKCL_BACKENDS:
        return []
    return [
        replace_attr(
            "kunlun-bkcl-is-nccl",
            f"{UTILS}.torch",
            TorchView,
            description="megatron.core.utils sees the BKCL process group as 'nccl' (as xpytorch's CUDA layer reports it)",
            expect=_mentions_nccl_branch,
        )
    ]
