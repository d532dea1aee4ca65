"""The built-in CUDA accelerator: nccl collectives, CUDA RNG and memory statistics."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from loongforge.accelerator.base import Accelerator, Capabilities

# Dense peak TFLOP/s per device (bf16 / fp16 tensor cores, no sparsity), by device-name substring.
_PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0}


class CudaAccelerator(Accelerator):
    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not torch.cuda.is_available():
            return "torch.cuda.is_available() is False (no NVIDIA GPU or no CUDA build of torch)"
        return None

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def set_device(self, local_rank: int) -> None:
        torch.cuda.set_device(local_rank % max(1, torch.cuda.device_count()))

    def current_device_index(self) -> int:
        return torch.cuda.current_device()

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def memory_stats(self) -> dict[str, float]:
        return {
            "allocated": float(torch.cuda.memory_allocated()),
            "peak_allocated": float(torch.cuda.max_memory_allocated()),
            "reserved": float(torch.cuda.memory_reserved()),
        }

    def reset_peak_memory(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)
        torch.cuda.manual_seed_all(seed)

    def get_rng_state(self) -> dict[str, Any]:
        return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state()}

    def set_rng_state(self, state: Mapping[str, Any]) -> None:
        torch.set_rng_state(state["cpu"])
        if "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"])

    def capabilities(self) -> Capabilities:
        major, minor = torch.cuda.get_device_capability()
        return Capabilities(
            bf16=major >= 8,
            fp16=True,
            fp8=(major, minor) >= (8, 9),
            triton=True,
            flash_attention=major >= 8,
            extra={"sm": f"{major}{minor}", "name": torch.cuda.get_device_name()},
        )

    def peak_flops(self, dtype: torch.dtype) -> float | None:
        name = torch.cuda.get_device_name()
        for key, tflops in _PEAK_BF16_TFLOPS.items():
            if key in name:
                if dtype in (torch.bfloat16, torch.float16):
                    return tflops * 1e12
                if dtype == torch.float32:
                    return tflops * 1e12 / 2  # TF32 tensor cores
        return None
