"""A plugin-provided kernel, as a Kunlun ops library would offer one (used by the kernel-override tests)."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, **_: object) -> torch.Tensor:
    """RMSNorm in plain torch, tagged so a test can tell it was chosen."""
    var = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(var + eps)).to(x.dtype) * weight


rms_norm.kunlun = True
