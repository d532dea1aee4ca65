"""Pick the implementation of one kernel call: the Triton kernel or the plain-torch reference.

A kernel function's ``impl`` keyword says which: ``auto`` (or None) uses Triton on CUDA tensors, and on CPU
tensors only when Triton's interpreter is active; an explicit ``triton`` that cannot run raises
:class:`KernelUnavailableError`. Runs never set it themselves: the core's kernel registry pins it per provider
(``providers.py``), under the registry's one selection rule (the recipe's ``kernels.provider``).
"""

from __future__ import annotations

import functools

import torch

# NOTE: ``loongforge.errors`` imports nothing (core's package names resolve lazily): no pydantic / pyyaml needed
from loongforge.errors import PluginError

CHOICES = ("auto", "torch", "triton")

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # NOTE: triton is optional (macOS, CPU-only installs); the references still work.
    triton = None
    tl = None
    HAS_TRITON = False


class KernelUnavailableError(PluginError, RuntimeError):
    """An explicitly requested kernel implementation cannot run on these tensors."""


def jit(fn):
    """``triton.jit`` when Triton is installed, else the plain function (never called then)."""
    return triton.jit(fn) if HAS_TRITON else fn


@jit
def _probe_kernel(X):
    pass


@functools.cache  # NOTE: fixed once both are imported; it is on every kernel call's path
def _interpreted() -> tuple[bool, bool]:
    """(our kernels, Triton's own standard library) were decorated under ``TRITON_INTERPRET=1``."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_probe_kernel, InterpretedFunction), isinstance(tl.standard.sum, InterpretedFunction)


def interpreter_active() -> bool:
    """True when Triton's interpreter runs these kernels, so they work on CPU tensors.

    NOTE: Triton reads TRITON_INTERPRET when ``@triton.jit`` decorates, its own standard library included,
    so both triton and this package must be imported with it set; we look at what the decorators produced.
    """
    return HAS_TRITON and all(_interpreted())


def triton_unavailable_reason(device_type: str) -> str | None:
    """None when the Triton kernels can run on ``device_type`` tensors, else why not (one line)."""
    if not HAS_TRITON:
        return "triton is not installed (pip install triton)"
    ours, stdlib = _interpreted()
    if ours != stdlib:  # a half-interpreted process runs nothing correctly, on any device
        first = "triton" if ours else "loongforge_kernels"
        return f"TRITON_INTERPRET changed after {first} was imported; set it (or not) before importing either"
    if device_type == "cuda" or ours:
        return None
    if device_type == "cpu":
        return (
            "Triton kernels run on CPU tensors only under Triton's interpreter: "
            "set TRITON_INTERPRET=1 before Python imports triton"
        )
    return f"these Triton kernels target CUDA, not '{device_type}'"


def resolve(impl: str | None, tensor: torch.Tensor) -> str:
    """Return ``"triton"`` or ``"torch"`` for a call on ``tensor``; ``impl=None`` means ``auto``."""
    choice = impl or "auto"
    if choice == "torch":
        return "torch"
    if choice not in CHOICES:
        raise KernelUnavailableError(f"kernel implementation {choice!r} is not one of {', '.join(CHOICES)}")
    reason = triton_unavailable_reason(tensor.device.type)
    if choice == "triton":
        if reason:
            raise KernelUnavailableError(f"Triton kernels requested but unusable: {reason}")
        return "triton"
    return "torch" if reason else "triton"


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def num_warps_for(block: int) -> int:
    """Warps for a kernel whose program holds ``block`` elements in registers (Liger's rule of thumb)."""
    if block >= 32768:
        return 32
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    return 4


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; a small number on CPU so the interpreter runs few programs."""
    if device.type == "cuda":
        return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 2


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
