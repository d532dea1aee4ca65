"""Flow-matching noise for the zero-padded action dims of policies that pad actions to a fixed width (LeRobot's
pi05 and SmolVLA draw noise for all ``max_action_dim`` columns)."""

from __future__ import annotations

import torch


def pad_noise(noise: torch.Tensor, dim: int) -> torch.Tensor:
    """``noise`` (B, chunk, action_dim) widened to ``dim`` columns: the extra columns of each sample come from a
    generator seeded by its own noise, so a sample is identical on any rank and in any batch."""
    extra = dim - noise.shape[-1]
    if extra <= 0:
        return noise
    cols = []
    for sample in noise:
        seed = int(sample.float().flatten().view(torch.int32).to(torch.int64).sum()) & 0x7FFF_FFFF
        g = torch.Generator().manual_seed(seed)
        cols.append(torch.randn(*sample.shape[:-1], extra, generator=g))
    return torch.cat([noise, torch.stack(cols).to(noise)], dim=-1)
