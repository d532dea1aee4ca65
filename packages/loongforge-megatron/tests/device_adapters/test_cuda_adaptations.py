"""The CUDA fast path's stand-ins for megatron's no-TE/Apex fallbacks, and the fused-Adam switch.

The stand-ins are plain torch (``_foreach_*``), so their math is checked here on CPU tensors against the
fallbacks they replace; on a GPU they run in every training step (benchmarks/llm_throughput.py).
"""

from __future__ import annotations

import pytest
import torch
from loongforge.accelerator.adaptation import AdaptationSet, resolve
from loongforge_megatron.device_adapters import adaptations_for
from loongforge_megatron.device_adapters.cuda import cuda_adaptations, foreach_l2_norm, foreach_scale
from loongforge_megatron.engine.optimizer import use_fused_torch_adam
from megatron.core import utils


def _tensors(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) for shape in ((7,), (3, 5), (1,), (64, 33))]


def test_cuda_list_replaces_megatron_fallbacks_and_applies_cleanly() -> None:
    adaptations = adaptations_for("cuda")  # no TE / Apex in this environment
    names = {a.name for a in adaptations}
    assert names == {"foreach-grad-norm", "foreach-scale:clip_grads", "foreach-scale:optimizer"}
    from megatron.core.optimizer import clip_grads, optimizer

    before = (clip_grads.l2_norm_impl, clip_grads.multi_tensor_scale_impl, optimizer.multi_tensor_scale_impl)
    with AdaptationSet(cuda_adaptations()):
        assert clip_grads.l2_norm_impl is foreach_l2_norm
        assert clip_grads.multi_tensor_scale_impl is optimizer.multi_tensor_scale_impl is foreach_scale
    assert (clip_grads.l2_norm_impl, clip_grads.multi_tensor_scale_impl, optimizer.multi_tensor_scale_impl) == before
    owner, attr = resolve("megatron.core.optimizer.clip_grads.l2_norm_impl")
    assert getattr(owner, attr) is utils.local_multi_tensor_l2_norm


def test_foreach_l2_norm_matches_the_fallback_norm() -> None:
    ts = _tensors()
    norm, per_tensor = foreach_l2_norm(2048 * 32, None, [ts], False)
    expected = torch.linalg.vector_norm(torch.cat([t.reshape(-1) for t in ts]))
    assert per_tensor is None and norm.shape == (1,)
    torch.testing.assert_close(norm[0], expected, rtol=1e-6, atol=0)
    assert foreach_l2_norm(1, None, [[]], False)[0].item() == 0.0


@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_foreach_scale_matches_the_fallback(scale: float) -> None:
    src = _tensors(1)
    for dst_dtype in (torch.float32, torch.bfloat16):
        dst = [torch.empty_like(t, dtype=dst_dtype) for t in src]
        ref = [torch.empty_like(t, dtype=dst_dtype) for t in src]
        foreach_scale(0, None, [src, dst], scale)
        utils.local_multi_tensor_scale(0, None, [src, ref], scale)
        for a, b in zip(dst, ref, strict=True):
            assert torch.equal(a, b)
    inplace = [t.clone() for t in src]  # grad clipping scales the grads in place: [grads, grads]
    foreach_scale(0, None, [inplace, inplace], scale)
    for a, b in zip(inplace, src, strict=True):
        assert torch.equal(a, b * scale)


def test_fused_adam_switch_leaves_cpu_parameters_alone() -> None:
    class Wrapped:  # the shape of a megatron optimizer: the torch optimizer under .optimizer
        def __init__(self, opt):
            self.optimizer = opt

    cpu = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))])
    assert use_fused_torch_adam(Wrapped(cpu)) == 0
    assert not cpu.param_groups[0].get("fused")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_fused_adam_switch_matches_foreach_on_gpu() -> None:
    class Wrapped:
        def __init__(self, opt):
            self.optimizer = opt

    params = [torch.nn.Parameter(t.cuda()) for t in _tensors(2)]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fused = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    plain = torch.optim.AdamW(twins, lr=1e-2, weight_decay=0.1, foreach=True)
    assert use_fused_torch_adam(Wrapped(fused)) == 1
    for step in range(5):
        for p, q in zip(params, twins, strict=True):
            p.grad = torch.randn_like(p, generator=torch.Generator("cuda").manual_seed(step))
            q.grad = p.grad.clone()
        fused.step()
        plain.step()
    for p, q in zip(params, twins, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
