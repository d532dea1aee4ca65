"""The built-in CPU accelerator: gloo collectives, torch's CPU RNG, no device memory accounting."""

from __future__ import annotations

import torch

from loongforge.accelerator.base import Accelerator, Capabilities


class CpuAccelerator(Accelerator):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"

    def device_count(self) -> int:
        return 1

    def capabilities(self) -> Capabilities:
        # NOTE: bf16 matmuls work on CPU but are slow; fp32 is the CPU default in recipes.
        return Capabilities(bf16=True, fp16=False, fp8=False, triton=False, flash_attention=False)

    def memory_stats(self) -> dict[str, float]:
        try:
            import resource

            peak = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024.0
        except Exception:  # pragma: no cover - non-POSIX
            peak = 0.0
        return {"allocated": 0.0, "peak_allocated": peak}

    def get_rng_state(self):
        return {"cpu": torch.get_rng_state()}
