"""The building blocks of the cpu adaptations: the per-module torch proxy, CUDA type names, the RNG tracker."""

from __future__ import annotations

import threading

import pytest
import torch
from loongforge.accelerator.adaptation import AdaptationSet
from loongforge.errors import AdaptationError
from loongforge_megatron.device_adapters.cpu_rng import cpu_tracker_class
from loongforge_megatron.device_adapters.cpu_torch import (
    CpuTorch,
    cuda_copy_as_identity,
    cuda_type_names,
    tensor_method_adaptations,
)


def test_cpu_torch_maps_cuda_devices_and_forwards_the_rest() -> None:
    t = CpuTorch()
    for device in ("cuda", "cuda:0", torch.device("cuda"), t.cuda.current_device(), 0):
        assert t.zeros(3, device=device).device.type == "cpu"
    assert t.tensor([1.0], device="cuda").device.type == "cpu"
    assert t.Tensor is torch.Tensor and t.float32 is torch.float32 and t.distributed is torch.distributed
    stream = t.cuda.current_stream()
    stream.wait_stream(t.cuda.Stream())
    with t.cuda.stream(stream):
        pass
    t.cuda.Stream().record_event().synchronize()
    t.cuda.synchronize()


def test_tensor_method_patches_are_scoped() -> None:
    x = torch.ones(2)
    type_, cuda = torch.Tensor.type, torch.Tensor.cuda
    with AdaptationSet(tensor_method_adaptations()):
        assert x.type() == "torch.FloatTensor"  # applied, but outside a wrapped call: torch's own
        with cuda_type_names():
            assert x.type() == "torch.cuda.FloatTensor"
            assert x.type(torch.float64).dtype == torch.float64
        assert x.type() == "torch.FloatTensor"
        with cuda_copy_as_identity():
            assert x.cuda() is x
    assert torch.Tensor.type is type_ and torch.Tensor.cuda is cuda
    assert "type" not in vars(torch.Tensor) and "cuda" not in vars(torch.Tensor)


def _type_in_thread(x: torch.Tensor) -> str:
    out: list[str] = []
    t = threading.Thread(target=lambda: out.append(x.type()))
    t.start()
    t.join()
    return out[0]


def test_other_threads_see_torchs_own_methods() -> None:
    """A DataLoader / pin-memory thread running while megatron's type check runs sees torch's ``type()``."""
    x = torch.ones(2)
    with AdaptationSet(tensor_method_adaptations()), cuda_type_names():
        assert x.type() == "torch.cuda.FloatTensor"
        assert _type_in_thread(x) == "torch.FloatTensor"


def test_tensor_methods_replaced_by_someone_else_are_refused(monkeypatch) -> None:
    monkeypatch.setattr(torch.Tensor, "type", lambda self, *a, **k: "other")
    with pytest.raises(AdaptationError, match="tensor-type-cuda-names"):
        AdaptationSet(tensor_method_adaptations()).check()


def test_cpu_rng_tracker_forks_the_cpu_generator() -> None:
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    tracker = cpu_tracker_class(CudaRNGStatesTracker)()
    assert isinstance(tracker, CudaRNGStatesTracker)
    torch.manual_seed(0)
    tracker.add("model-parallel-rng", 42)
    outside = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outside)  # the default stream is untouched
    with tracker.fork():
        b = torch.rand(3)
    torch.manual_seed(42)
    expected = torch.rand(6)
    assert torch.equal(torch.cat([a, b]), expected)  # the tracked stream continues where it stopped
