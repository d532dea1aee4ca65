"""The fast path's adaptations of megatron-core 0.19 on CUDA without TransformerEngine or Apex.

Without TE/Apex, megatron falls back to per-tensor Python loops for its multi-tensor kernels:

- ``local_multi_tensor_l2_norm`` (grad clipping) calls ``torch.tensor([...cuda scalars...])``, which copies every
  parameter's norm to the host: one device synchronisation per parameter tensor, each step;
- ``local_multi_tensor_scale`` (grad clipping, and the bf16 main-param -> model-param copy after every step)
  does ``dst.copy_(src * scale)`` per tensor: a temporary fp32 tensor and two kernels per parameter.

Both are replaced by ``torch._foreach_*`` versions (horizontally fused kernels, no host sync). These apply only
when megatron is using its fallbacks (TE/Apex absent); with TE or Apex installed their kernels are used and this
list is empty.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from loongforge.accelerator.adaptation import Adaptation, replace_attr

from loongforge_megatron.device_adapters.cpu_torch import source_mentions

_CLIP = "megatron.core.optimizer.clip_grads"
_OPT = "megatron.core.optimizer.optimizer"


def foreach_l2_norm(chunk_size: int, noop_flag: Any, tensor_lists: Any, per_tensor: bool, *args: Any):
    """Drop-in for ``amp_C.multi_tensor_l2norm``: the L2 norm over all tensors, left on their device."""
    tensors = [t for ts in tensor_lists for t in ts]
    if not tensors:
        return torch.zeros(1, dtype=torch.float), None
    norms = torch._foreach_norm(tensors)
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))
    return total.reshape(1), None


def foreach_scale(chunk_size: int, noop_flag: Any, tensor_lists: Any, scale: float) -> None:
    """Drop-in for ``amp_C.multi_tensor_scale``: ``dst = src * scale`` over two tensor lists (dtypes may differ)."""
    src, dst = list(tensor_lists[0]), list(tensor_lists[1])
    if not src:
        return
    if scale == 1.0:
        torch._foreach_copy_(dst, src)
    elif all(s is d for s, d in zip(src, dst, strict=True)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def _replace(name: str, target: str, fn: Callable[..., Any], needles: tuple[str, ...], why: str) -> Adaptation:
    return replace_attr(name, target, lambda _original: fn, description=why, expect=source_mentions(*needles))


def _megatron_uses_fallbacks() -> bool:
    """True when megatron picked its local (per-tensor loop) multi-tensor implementations at import."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    return clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm


def cuda_adaptations() -> list[Adaptation]:
    """The named adaptations for device type ``cuda`` (empty when TE or Apex provides the fused kernels)."""
    if not _megatron_uses_fallbacks():
        return []
    scale_why = "multi-tensor scale/copy without a temporary per tensor (torch._foreach_mul / _foreach_copy_)"
    return [
        _replace("foreach-grad-norm", f"{_CLIP}.l2_norm_impl", foreach_l2_norm, ('device="cuda"',),
                 "grad-norm without one host sync per parameter (torch._foreach_norm, result stays on the GPU)"),
        _replace("foreach-scale:clip_grads", f"{_CLIP}.multi_tensor_scale_impl", foreach_scale,
                 ("dst.copy_(src * scale)",), scale_why),
        _replace("foreach-scale:optimizer", f"{_OPT}.multi_tensor_scale_impl", foreach_scale,
                 ("dst.copy_(src * scale)",), scale_why),
    ]
