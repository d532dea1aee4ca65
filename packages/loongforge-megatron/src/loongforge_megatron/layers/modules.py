"""Kernel-backed modules for the ``loongforge`` layer spec. Kernels come through core's kernel registry
(``loongforge.kernels.select_op``): Triton on GPU when ``loongforge-kernels`` is installed, torch elsewhere."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def _moe_permute(tokens, indices, *, num_experts):
    """loongforge-kernels' ``moe_permute`` reference semantics (a negative index: a dropped slot, no row)."""
    flat = indices.reshape(-1).long()
    dropped = flat < 0
    order = torch.argsort(torch.where(dropped, torch.iinfo(torch.int64).max, flat), stable=True)
    row_id = torch.empty_like(order)
    row_id[order] = torch.arange(flat.numel(), device=flat.device)
    row_id = row_id.masked_fill(dropped, -1)
    keep = ~dropped
    src = torch.arange(flat.numel(), device=flat.device) // indices.shape[1]
    out = tokens.new_zeros(flat.numel(), tokens.shape[1]).index_put((row_id[keep],), tokens.index_select(0, src[keep]))
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).index_add_(
        0, flat.clamp(min=0), keep.long())
    return out, row_id.view(indices.shape).to(torch.int32), counts


def _moe_unpermute(permuted, row_id_map, probs=None):
    t, k = row_id_map.shape
    flat = row_id_map.reshape(-1).long()
    rows = permuted.index_select(0, flat.clamp(min=0)).view(t, k, -1).float()
    w = (flat >= 0).view(t, k, 1).float()
    if probs is not None:
        w = w * probs.float().unsqueeze(-1)
    return (rows * w).sum(1).to(permuted.dtype)


_FALLBACK = {
    "moe_permute": _moe_permute,
    "moe_unpermute": _moe_unpermute,
    "rms_norm": lambda x, weight, eps=1e-6: F.rms_norm(x, (x.shape[-1],), weight.to(x.dtype), eps),
    "swiglu": lambda x: F.silu(x[..., : x.shape[-1] // 2]) * x[..., x.shape[-1] // 2 :],
}


def kernel(op: str, *, provider: str, device_type: str, accelerator: Any = None):
    """The op's implementation for ``device_type``; plain torch when no provider is installed and ``provider``
    is ``auto`` (an explicitly requested provider that cannot serve raises)."""
    from loongforge.errors import PluginError
    from loongforge.kernels import select_op

    try:
        return select_op(op, provider=provider, device_type=device_type, accelerator=accelerator)
    except PluginError:
        if provider != "auto":
            raise
        return _FALLBACK[op]


class KernelRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` (same parameter name ``weight``) whose forward runs the fused RMSNorm kernel.

    Built like a megatron norm; marks its weight ``sequence_parallel`` so megatron all-reduces its gradient over
    TP under sequence parallelism."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, provider: str = "auto", accelerator: Any = None,
                 **_: Any):
        if config.normalization != "RMSNorm":
            raise ValueError(f"the loongforge spec supports RMSNorm, not {config.normalization!r}")
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.provider, self.accelerator = provider, accelerator
        self._impl = None
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._impl is None:
            self._impl = kernel("rms_norm", provider=self.provider, device_type=x.device.type, accelerator=self.accelerator)
        return self._impl(x, self.weight, self.eps)


class KernelSwiGLU(torch.nn.Module):
    """MLP activation on megatron's fused fc1 output ``[..., 2F]``: silu(first half) * second half."""

    def __init__(self, config: Any = None, provider: str = "auto", accelerator: Any = None, **_: Any):
        super().__init__()
        self.provider, self.accelerator = provider, accelerator
        self._impl = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._impl is None:
            self._impl = kernel("swiglu", provider=self.provider, device_type=x.device.type, accelerator=self.accelerator)
        return self._impl(x)
