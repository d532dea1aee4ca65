"""Finding and loading Kunlun's PyTorch runtime (``torch_xmlir``, shipped in Baidu's xpytorch build).

NOTE: xpytorch runs in a *CUDA-compatible* mode: importing ``torch_xmlir`` redirects ``torch.cuda`` to the Kunlun
XPU runtime, so the device type is ``cuda``, device / memory / RNG calls go through ``torch.cuda``, and the
BKCL-backed process group is registered with ``torch.distributed`` (see README.md for the sources).

Detection never imports the runtime: ``torch_xmlir`` reads its ``XMLIR_*`` settings at import time, so it must be
imported only *after* the recipe's ``accelerator.env`` is exported (:meth:`KunlunAccelerator.setup_environment`).

"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from types import ModuleType
from typing import Any

RUNTIME_MODULE = "torch_xmlir"
# Names under which torch_xmlir registers its BKCL process group with torch.distributed, newest first
# (``kccl``: the new ProcessGroupXCCL, ``bccl``: the legacy one; chosen by XMLIR_ENABLE_NEW_PG). When none is
# registered, ``nccl`` is used: xpytorch's CUDA-compatible layer routes it to BKCL.
BKCL_BACKENDS = ("kccl", "bccl", "bkcl")
CUDA_COMPAT_BACKEND = "nccl"

INSTALL_HINT = "install Baidu's xpytorch build for Kunlun (it provides torch_xmlir), see loongforge-xpu's README"


@dataclass(frozen=True)
class KunlunRuntime:
    """The loaded runtime: its module, the torch device type it exposes and the module with device calls."""

    module: ModuleType
    device_type: str
    device_module: Any

    @property
    def version(self) -> str:
        return str(getattr(self.module, "__version__", "unknown"))

    def dist_backend(self) -> str:
        """The torch.distributed backend name for BKCL in this process (see ``BKCL_BACKENDS``); the legacy
        ``bccl`` first when ``XMLIR_ENABLE_NEW_PG`` turns the new group off."""
        import os

        import torch.distributed as dist

        known = set(getattr(dist.Backend, "backend_list", ()))
        order = list(BKCL_BACKENDS)
        if os.environ.get("XMLIR_ENABLE_NEW_PG", "1").lower() in ("0", "false"):
            order.remove("bccl")
            order.insert(0, "bccl")
        for name in order:
            if name in known:
                return name
        return CUDA_COMPAT_BACKEND

    def unusable_reason(self) -> str | None:
        """None when at least one device is visible, else why not (one line)."""
        try:
            count = int(self.device_module.device_count())
        except Exception as exc:  # a broken driver must produce one line, not a traceback
            return f"{RUNTIME_MODULE} is installed but querying devices failed: {type(exc).__name__}: {exc}"
        if count < 1:
            return (f"{RUNTIME_MODULE} {self.version} is installed but no Kunlun XPU is visible "
                    "(check XPU_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES and `xpu-smi`)")
        return None


def missing_reason() -> str | None:
    """Why the runtime cannot be found, without importing it (None when it is installed)."""
    try:
        spec = importlib.util.find_spec(RUNTIME_MODULE)
    except (ImportError, ValueError) as exc:
        return f"the Kunlun runtime module '{RUNTIME_MODULE}' cannot be located ({exc}); {INSTALL_HINT}"
    if spec is None:
        return f"the Kunlun runtime module '{RUNTIME_MODULE}' is not installed; {INSTALL_HINT}"
    return None


def load_runtime() -> KunlunRuntime:
    """Import the runtime (after the environment is set) and describe it.

    Raises :class:`loongforge.errors.PluginError` (one line) when it is missing or fails to import.
    """
    from loongforge.errors import PluginError

    reason = missing_reason()
    if reason:
        raise PluginError(f"accelerator 'kunlun' is not available: {reason}")
    try:
        module = importlib.import_module(RUNTIME_MODULE)
    except Exception as exc:
        first = f"{type(exc).__name__}: {exc}".splitlines()[0]
        raise PluginError(f"accelerator 'kunlun': importing {RUNTIME_MODULE} failed: {first}") from exc
    import torch

    return KunlunRuntime(module, "cuda", torch.cuda)
