"""Qwen3-VL's vision tower as one plain torch module, whole on every rank or split over its component's tp group: a 3-D patch embedding plus a
learned position table resampled (bilinear, corners aligned) to each image's patch grid, blocks of LayerNorm ->
full attention per image with 2-D rotary positions -> LayerNorm -> GELU MLP, the 2x2 patch merger, and the
deepstack mergers that turn the outputs of some blocks (``deepstack_visual_indexes``) into features the language
model adds to the image tokens' hidden states after its first layers.

Parameter names are transformers' (``Qwen3VLVisionModel``); the attention is :mod:`.vision`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from loongforge_megatron.models.qwen_vl.tower_parallel import column, row
from loongforge_megatron.models.qwen_vl.vision import (
    Attention,
    PatchEmbed,
    blocks,
    host_grids,
    image_bounds,
    patch_positions,
    rotary_2d,
    run_block,
)

_ACTS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu, "silu": F.silu}


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str, groups: Any = None):
        super().__init__()
        if act not in _ACTS:
            raise ValueError(f"qwen3_vl: vision hidden_act '{act}' (supported: {', '.join(_ACTS)})")
        self.act = _ACTS[act]
        self.linear_fc1, self.linear_fc2 = column(dim, hidden, groups=groups), row(hidden, dim, groups=groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, act: str, groups: Any = None, *, recompute: str = "none"):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim, eps=1e-6), nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, heads, groups, recompute=recompute == "selective")
        self.mlp = MLP(dim, hidden, act, groups)

    def forward(self, x, cu_seqlens, cos, sin):
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class Merger(nn.Module):
    """merge x merge patches -> one language-model embedding; ``postshuffle``: the norm after the patches are
    concatenated (the deepstack mergers) instead of before."""

    def __init__(self, *, dim: int, context: int, merge: int, postshuffle: bool, groups: Any = None):
        super().__init__()
        self.width, self.postshuffle = context * merge * merge, postshuffle
        self.norm = nn.LayerNorm(self.width if postshuffle else context, eps=1e-6)
        self.linear_fc1, self.linear_fc2 = (column(self.width, self.width, groups=groups),
                                            row(self.width, dim, groups=groups))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.reshape(-1, self.width)) if self.postshuffle else self.norm(x).reshape(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


def interpolated_positions(grid_thw: torch.Tensor, *, side: int, merge: int,
                           positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(table indices, weights) ``[patches, 4]`` that resample a ``side`` x ``side`` learned table bilinearly, with
    aligned corners, to every patch of every image (patches in the processor's merge-block order); on the host, as
    ``grid_thw`` and ``positions`` (:func:`patch_positions`, made here when not given)."""
    pos = patch_positions(grid_thw, merge) if positions is None else positions
    sizes = torch.repeat_interleave(grid_thw[:, 1:], grid_thw.prod(-1), dim=0)
    src = pos.float() * (side - 1) / (sizes - 1).clamp(min=1)  # [patches, 2]: row, column on the table
    low = src.floor()
    taps = torch.stack([low, low + 1], dim=-1).long().clamp(0, side - 1)  # [patches, 2 axes, 2 taps]
    w = (1 - (src[..., None] - torch.stack([low, low + 1], dim=-1)).abs()).clamp(min=0)
    index = (taps[:, 0, :, None] * side + taps[:, 1, None, :]).reshape(-1, 4)
    weight = (w[:, 0, :, None] * w[:, 1, None, :]).reshape(-1, 4)
    return index, weight


class VisionTower3(nn.Module):
    """``pixel_values``, ``grid_thw`` -> (one embedding per merged patch, the deepstack features: one such tensor
    per ``deepstack_visual_indexes`` block)."""

    def __init__(self, cfg: Mapping[str, Any], *, groups: Any = None, recompute: str = "none"):
        super().__init__()
        dim, heads = cfg["hidden_size"], cfg["num_heads"]
        self.full_recompute = recompute == "full"
        self.merge = cfg.get("spatial_merge_size", 2)
        self.patch_embed = PatchEmbed(patch=cfg.get("patch_size", 16), temporal=cfg.get("temporal_patch_size", 2),
                                      channels=cfg.get("in_channels", 3), dim=dim, bias=True)
        self.pos_embed = nn.Embedding(cfg["num_position_embeddings"], dim)
        self.side = int(cfg["num_position_embeddings"] ** 0.5)
        self.theta = float((cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        self.half = dim // heads // 2
        act = cfg.get("hidden_act", "gelu_pytorch_tanh")
        self.blocks = nn.ModuleList(Block(dim, heads, cfg["intermediate_size"], act, groups, recompute=recompute)
                                    for _ in range(cfg["depth"]))
        out = cfg["out_hidden_size"]
        self.merger = Merger(dim=out, context=dim, merge=self.merge, postshuffle=False, groups=groups)
        self.deepstack = list(cfg.get("deepstack_visual_indexes", []))
        self.deepstack_merger_list = nn.ModuleList(
            Merger(dim=out, context=dim, merge=self.merge, postshuffle=True, groups=groups) for _ in self.deepstack)

    def forward(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        x = self.patch_embed(pixels)
        dev, grid = x.device, host_grids(grid_thw)
        pos = patch_positions(grid, self.merge)
        index, weight = (t.to(dev, non_blocking=True) for t in interpolated_positions(
            grid, side=self.side, merge=self.merge, positions=pos))
        x = x + (self.pos_embed(index) * weight[..., None].to(x.dtype)).sum(1)
        cos, sin = rotary_2d(pos.to(dev, non_blocking=True), theta=self.theta, half=self.half)
        bounds = blocks(image_bounds(grid), dev)
        features = []
        for i, block in enumerate(self.blocks):
            x = run_block(block, x, bounds, cos, sin, recompute=self.full_recompute)
            if i in self.deepstack:
                features.append(self.deepstack_merger_list[self.deepstack.index(i)](x))
        return self.merger(x), features
