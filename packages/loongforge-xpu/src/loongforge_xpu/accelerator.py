"""The ``kunlun`` accelerator: Baidu Kunlun XPU through xpytorch's ``torch_xmlir`` runtime.

Recipe::

    accelerator:
      name: kunlun
      env: {BKCL_PCIE_RING: 1}              # XMLIR_* / BKCL_* tuning, validated (see env.py)
      options:
        dist_backend: kccl                  # default: the BKCL group torch_xmlir registered, else nccl
        peak_tflops: 128                    # dense bf16/fp16 peak per device, for MFU
        kernel_overrides: {rms_norm: "my_kunlun_ops:rms_norm"}
        unchecked_env: [XMLIR_SOMETHING_NEW]
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from functools import cached_property
from typing import Any, ClassVar

import torch
from loongforge.accelerator.adaptation import Adaptation
from loongforge.accelerator.base import Accelerator, Capabilities
from loongforge.errors import PluginError, RecipeError

from loongforge_xpu import env as kenv
from loongforge_xpu.runtime import KunlunRuntime, load_runtime, missing_reason

OPTIONS = ("dist_backend", "peak_tflops", "kernel_overrides", "unchecked_env")
# Dense FP16 peak TFLOP/s per device, by device-name substring (R300: 1 PFLOPS FP16 per 8-chip R480, FlagPerf).
_PEAK_FP16_TFLOPS = {"R300": 128.0}


class KunlunAccelerator(Accelerator):
    """Kunlun XPU. Device, memory and RNG calls go through the runtime's device module (``torch.cuda`` under
    xpytorch); collectives through BKCL; no Triton, so kernels come from torch references or overrides."""

    name: ClassVar[str] = "kunlun"

    def __init__(self, *, options: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None):
        super().__init__(options=options, env=env)
        unknown = sorted(set(self.options) - set(OPTIONS))
        if unknown:
            raise RecipeError(f"unknown option '{unknown[0]}'; allowed: {', '.join(OPTIONS)}",
                              key=f"accelerator.options.{unknown[0]}")
        unchecked = self.options.get("unchecked_env", [])
        if not isinstance(unchecked, list | tuple):
            raise RecipeError("expected a list of variable names", key="accelerator.options.unchecked_env")
        kenv.validate_env(self.env, unchecked=unchecked)
        self._parse_overrides()

    # --- availability & setup -------------------------------------------------------------------------
    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Whether ``torch_xmlir`` is installed, found without importing it (it reads XMLIR_* at import)."""
        return missing_reason()

    def setup_environment(self) -> None:
        """Export the tuning variables (defaults, then the recipe's), then import the runtime and check a device
        is visible; raises :class:`PluginError` with one line otherwise."""
        import os

        for key, value in kenv.effective_env(self.env, current=os.environ).items():
            os.environ[key] = value
        reason = self.runtime.unusable_reason()
        if reason:
            raise PluginError(f"accelerator 'kunlun' is not available: {reason}")

    @cached_property
    def runtime(self) -> KunlunRuntime:
        """The loaded runtime (imported on first use)."""
        return load_runtime()

    @property
    def device_type(self) -> str:  # type: ignore[override]
        return self.runtime.device_type

    @property
    def dist_backend(self) -> str:  # type: ignore[override]
        return str(self.options.get("dist_backend") or self.runtime.dist_backend())

    # --- devices, memory, RNG ---------------------------------------------------------------------------
    @property
    def _dev(self) -> Any:
        return self.runtime.device_module

    def device_count(self) -> int:
        return int(self._dev.device_count())

    def set_device(self, local_rank: int) -> None:
        self._dev.set_device(local_rank % max(1, self.device_count()))

    def current_device_index(self) -> int:
        return int(self._dev.current_device())

    def synchronize(self) -> None:
        self._dev.synchronize()

    def memory_stats(self) -> dict[str, float]:
        stats = {"allocated": float(self._dev.memory_allocated()), "peak_allocated": float(self._dev.max_memory_allocated())}
        if hasattr(self._dev, "memory_reserved"):
            stats["reserved"] = float(self._dev.memory_reserved())
        return stats

    def reset_peak_memory(self) -> None:
        self._dev.reset_peak_memory_stats()

    def empty_cache(self) -> None:
        self._dev.empty_cache()

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)
        self._dev.manual_seed_all(seed)

    def get_rng_state(self) -> dict[str, Any]:
        return {"cpu": torch.get_rng_state(), "kunlun": self._dev.get_rng_state()}

    def set_rng_state(self, state: Mapping[str, Any]) -> None:
        torch.set_rng_state(state["cpu"])
        if "kunlun" in state:
            self._dev.set_rng_state(state["kunlun"])

    # --- capabilities & hooks ---------------------------------------------------------------------------
    def capabilities(self) -> Capabilities:
        # NOTE: no Triton and no flash-attn package API on Kunlun: kernel selection falls back to the torch
        # references (or to kernel_overrides); SDPA is served by torch_xmlir itself.
        rt = self.runtime
        return Capabilities(bf16=True, fp16=True, fp8=False, triton=False, flash_attention=False,
                            extra={"runtime": "torch_xmlir", "version": rt.version, "dist_backend": self.dist_backend})

    def peak_flops(self, dtype: torch.dtype) -> float | None:
        if "peak_tflops" in self.options and dtype in (torch.bfloat16, torch.float16):
            return float(self.options["peak_tflops"]) * 1e12
        if dtype != torch.float16:
            return None
        try:
            name = str(self._dev.get_device_name())
        except Exception:
            return None
        return next((t * 1e12 for key, t in _PEAK_FP16_TFLOPS.items() if key in name), None)

    def adaptations(self, backend: str) -> Sequence[Adaptation]:
        if backend != "megatron":
            return ()
        from loongforge_xpu.megatron import megatron_adaptations

        return megatron_adaptations(device_type=self.device_type, dist_backend=self.dist_backend)

    def _parse_overrides(self) -> None:
        spec = self.options.get("kernel_overrides", {})
        if not isinstance(spec, Mapping):
            raise RecipeError("expected a mapping op -> 'module:function'", key="accelerator.options.kernel_overrides")
        for op, target in spec.items():
            module, _, attr = str(target).partition(":")
            if not module or not attr:
                raise RecipeError(f"expected 'module:function', got '{target}'",
                                  key=f"accelerator.options.kernel_overrides.{op}")
        self._override_spec = {str(op): str(t) for op, t in spec.items()}

    def kernel_overrides(self) -> Mapping[str, Callable[..., Any]]:
        """The ops named in ``options.kernel_overrides``, imported on first use (PluginError if one is missing)."""
        if not hasattr(self, "_overrides"):
            out = {}
            for op, target in self._override_spec.items():
                module, _, attr = target.partition(":")
                try:
                    fn: Any = importlib.import_module(module)
                    for part in attr.split("."):
                        fn = getattr(fn, part)
                except (ImportError, AttributeError) as exc:
                    raise PluginError(f"accelerator 'kunlun': kernel override {op} -> {target} cannot be loaded: "
                                      f"{type(exc).__name__}: {exc}") from exc
                out[op] = fn
            self._overrides = out
        return self._overrides

    def describe(self) -> str:
        rt = self.runtime
        return f"kunlun ({self.device_type}, dist backend {self.dist_backend}, torch_xmlir {rt.version})"
