"""A CPU-backed stand-in for Kunlun's ``torch_xmlir`` runtime, for tests without Kunlun hardware.

It mimics what the plugin relies on: a device module with torch.cuda's device / memory / RNG calls (here on the
CPU), and a BKCL process group registered with ``torch.distributed`` under torch_xmlir's name (``kccl``, or
``bccl`` with ``XMLIR_ENABLE_NEW_PG=0``), backed by gloo. Tests put this folder on PYTHONPATH.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

__version__ = "0.0.0+simulated"

# The XMLIR_* / BKCL_* variables as they were when the runtime was imported (torch_xmlir reads them then).
IMPORT_ENV = {k: v for k, v in os.environ.items() if k.startswith(("XMLIR_", "BKCL_"))}

BACKEND = "kccl" if os.environ.get("XMLIR_ENABLE_NEW_PG", "1").lower() in ("1", "true") else "bccl"


def _create_bkcl(store, rank, size, timeout):
    return dist.ProcessGroupGloo(store, rank, size, timeout)


if BACKEND not in dist.Backend.backend_list:
    dist.Backend.register_backend(BACKEND, _create_bkcl, devices=["cpu"])


class _Device:
    """torch.cuda's device / memory / RNG surface, on the CPU."""

    def __init__(self) -> None:
        self._current = 0
        self.seeded: list[int] = []

    def is_available(self) -> bool:
        return self.device_count() > 0

    def device_count(self) -> int:
        visible = os.environ.get("XPU_VISIBLE_DEVICES")
        if visible is not None:
            return len([d for d in visible.split(",") if d.strip()])
        return 8

    def set_device(self, index: int) -> None:
        self._current = int(index)

    def current_device(self) -> int:
        return self._current

    def synchronize(self) -> None:
        pass

    def get_device_name(self, index: int | None = None) -> str:
        return "Kunlun R300 (simulated)"

    def memory_allocated(self) -> int:
        return 0

    def max_memory_allocated(self) -> int:
        return 0

    def memory_reserved(self) -> int:
        return 0

    def reset_peak_memory_stats(self) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def manual_seed_all(self, seed: int) -> None:
        self.seeded.append(int(seed))
        torch.manual_seed(seed)

    def get_rng_state(self) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        torch.set_rng_state(state)


# The device calls (the real runtime routes torch.cuda's to the XPU; see ../cpu_placement.py).
DEVICE = _Device()
