"""Tools that make one megatron-core module see the CPU where it hard-codes CUDA.

megatron-core writes ``torch.zeros(..., device="cuda")`` and ``device=torch.cuda.current_device()`` inside
long functions (the pipeline schedules, grad buffers, the RNG tracker). Copying those functions would fork
megatron; instead we replace the name ``torch`` *in that one module* by :class:`CpuTorch`, a thin proxy of the
real ``torch`` module that maps CUDA devices to the CPU. Every other module keeps the real ``torch``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from loongforge.accelerator.adaptation import Adaptation, replace_attr

# Factories whose ``device=`` argument megatron sets to "cuda" / torch.cuda.current_device().
_FACTORIES = frozenset(
    {"zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn", "randint", "as_tensor", "eye"}
)


def _cpu_device(device: Any) -> Any:
    """Map a CUDA device spec (``"cuda"``, ``"cuda:0"``, ``torch.device("cuda")``, an int index) to the CPU."""
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _factory(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    return wrapped


class _CpuEvent:
    """An event on the CPU "stream": work before it has already happened."""

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True


class _CpuStream:
    """The CPU's in-order execution seen as a "stream": waiting on it or on its events is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any):
        pass

    def record_event(self, event: Any = None) -> _CpuEvent:
        return _CpuEvent()

    def wait_event(self, event: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _CpuCuda:
    """``torch.cuda`` as seen by a patched module: the current device is the CPU, the current stream is the
    CPU's (synchronous) execution; anything else is forwarded to the real ``torch.cuda``."""

    def __init__(self, real: types.ModuleType):
        self._real = real
        self._stream = _CpuStream()

    def current_device(self) -> torch.device:
        return torch.device("cpu")

    def current_stream(self, device: Any = None) -> _CpuStream:
        return self._stream

    def Stream(self, *args: Any, **kwargs: Any) -> _CpuStream:  # noqa: N802 - mirrors torch.cuda.Stream
        return _CpuStream()

    def Event(self, *args: Any, **kwargs: Any) -> _CpuEvent:  # noqa: N802 - mirrors torch.cuda.Event
        return _CpuEvent()

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def synchronize(self, device: Any = None) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class CpuTorch:
    """A proxy of the ``torch`` module for one megatron module: CUDA devices become the CPU.

    NOTE: attribute access is forwarded, so ``torch.Tensor``, ``torch.distributed`` and ``torch.float32`` are
    the real objects (``isinstance`` checks keep working); only tensor factories and ``torch.cuda`` differ.
    """

    def __init__(self, real: types.ModuleType = torch):
        self.__dict__["_real"] = real
        self.__dict__["cuda"] = _CpuCuda(real.cuda)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._real, name)
        return _factory(value) if name in _FACTORIES else value

    def __repr__(self) -> str:
        return "<torch (CUDA devices mapped to cpu by loongforge_megatron.device_adapters)>"


def module_mentions(module_name: str, *needles: str) -> Callable[[Any], bool]:
    """An ``expect`` for :func:`replace_attr`: the module's source still contains every needle."""

    def expect(_original: Any) -> bool:
        import importlib

        source = inspect.getsource(importlib.import_module(module_name))
        return all(n in source for n in needles)

    return expect


def source_mentions(*needles: str) -> Callable[[Any], bool]:
    """An ``expect``: the replaced function's own source still contains every needle."""

    def expect(original: Any) -> bool:
        fn = getattr(original, "__func__", original)
        try:
            source = inspect.getsource(fn)
        except (OSError, TypeError):  # a builtin / C extension: not the Python code this was written for
            return False
        return all(n in source for n in needles)

    return expect


# NOTE: megatron's CUDA type checks and ``.cuda()`` calls happen on the thread that runs the wrapped call; a
# DataLoader or pin-memory thread never sets these, so it sees torch's own behaviour even while a wrapped call runs.
_CUDA_TYPE_NAMES: contextvars.ContextVar[bool] = contextvars.ContextVar("loongforge_cuda_type_names", default=False)
_CUDA_COPY_IDENTITY: contextvars.ContextVar[bool] = contextvars.ContextVar("loongforge_cuda_copy_identity",
                                                                            default=False)


def _type_with_cuda_names(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Tensor.type``: the no-argument form names a CPU tensor as its CUDA twin, inside :func:`cuda_type_names`."""

    def type_(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        if dtype is None and not kwargs and _CUDA_TYPE_NAMES.get() and self.device.type == "cpu":
            return original(self).replace("torch.", "torch.cuda.", 1)
        if dtype is None and not kwargs:
            return original(self)
        return original(self, dtype, non_blocking, **kwargs)

    type_.__wrapped__ = original
    return type_


def _cuda_as_identity(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Tensor.cuda``: a CPU tensor is returned as is, inside :func:`cuda_copy_as_identity`."""

    def cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if _CUDA_COPY_IDENTITY.get() and self.device.type == "cpu":
            return self
        return original(self, *args, **kwargs)

    cuda.__wrapped__ = original
    return cuda


def tensor_method_adaptations() -> list[Adaptation]:
    """The two ``torch.Tensor`` methods the CPU adaptations scope per call: installed for the run, they change
    behaviour only in the thread (context) of a call wrapped by :func:`with_cuda_type_names` /
    :func:`with_cuda_copy_as_identity`; everywhere else they are torch's own."""
    def torch_own(attr: str) -> Callable[[Any], bool]:
        return lambda original: original is getattr(torch._C.TensorBase, attr)  # nobody else replaced it

    return [
        replace_attr("tensor-type-cuda-names", "torch.Tensor.type", _type_with_cuda_names,
                     description="inside megatron's CUDA type checks only (this thread), a CPU tensor's type() "
                                 "is its CUDA twin's name", expect=torch_own("type")),
        replace_attr("tensor-cuda-identity", "torch.Tensor.cuda", _cuda_as_identity,
                     description="inside megatron calls that move a CPU tensor with .cuda() (this thread), "
                                 ".cuda() returns the tensor", expect=torch_own("cuda")),
    ]


@contextlib.contextmanager
def _flag(var: contextvars.ContextVar[bool]) -> Iterator[None]:
    token = var.set(True)
    try:
        yield
    finally:
        var.reset(token)


def cuda_type_names() -> contextlib.AbstractContextManager[None]:
    """While active, in this thread, ``tensor.type()`` names a CPU tensor as its CUDA twin (``torch.cuda.FloatTensor``).

    NOTE: megatron's optimizers accept a parameter only if ``param.type()`` is one of the CUDA names; the
    check is about the dtype, not the device. Only the no-argument form changes, only in this thread, and only
    while ``tensor-type-cuda-names`` (:func:`tensor_method_adaptations`) is applied.
    """
    return _flag(_CUDA_TYPE_NAMES)


def cuda_copy_as_identity() -> contextlib.AbstractContextManager[None]:
    """While active, in this thread, ``tensor.cuda()`` on a CPU tensor returns the tensor itself (it is already
    "on device"); needs ``tensor-cuda-identity`` (:func:`tensor_method_adaptations`) applied."""
    return _flag(_CUDA_COPY_IDENTITY)


def _while(ctx: Callable[[], contextlib.AbstractContextManager[None]]):
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with ctx():
                return fn(*args, **kwargs)

        return wrapped

    return wrap


with_cuda_type_names = _while(cuda_type_names)
"""Wrap a function (or a classmethod's function) to run under :func:`cuda_type_names`."""
with_cuda_copy_as_identity = _while(cuda_copy_as_identity)
"""Wrap a function to run under :func:`cuda_copy_as_identity`."""
