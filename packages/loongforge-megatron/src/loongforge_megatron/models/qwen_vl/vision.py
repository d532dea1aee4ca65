"""Qwen2.5-VL's vision tower as one plain torch module, whole on every rank or split over its component's tp group
(``tower_parallel.py``), with its own recompute (``parallel.components.vision.recompute``: full / selective / none): a 3-D patch embedding (temporal x
2-D patches), blocks of RMSNorm -> attention with 2-D rotary positions -> RMSNorm -> SwiGLU, where most blocks attend
within windows of merged patches and a few (``fullatt_block_indexes``) over the whole image, and the 2x2 patch merger
(RMSNorm, MLP) that turns four patches into one language-model embedding.

Parameter names are transformers' (``Qwen2_5_VisionTransformerPretrainedModel``), so the HF name map is a prefix.
Every image is attended on its own: the blocks see all images of a micro-batch back to back with their boundaries
(``cu_seqlens``), and :func:`block_attention` is the one place attention runs: ``varlen_attn`` (flash, no mask) on
CUDA in bf16, one SDPA per block elsewhere (``layers/varlen.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from loongforge_megatron.models.qwen_vl.tower_parallel import column, row


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def blocks(cu_seqlens: torch.Tensor, device: torch.device):
    """The blocks ``[cu_seqlens[i], cu_seqlens[i+1])`` as packed-sequence params (boundaries read to the host once
    per tower forward, not once per layer)."""
    from loongforge_megatron.engine.packing import packed_seq_params

    return packed_seq_params(cu_seqlens.tolist(), device=device)


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params) -> torch.Tensor:
    """Bidirectional attention within each block of ``params`` (:func:`blocks`) of ``q, k, v`` ``[t, heads, dim]``
    -> ``[t, heads, dim]``; no attention across blocks (images, or windows of one image)."""
    from loongforge_megatron.engine.packing import bounds_of
    from loongforge_megatron.layers.varlen import varlen_attention

    bounds = bounds_of(params)
    return varlen_attention(q, k, v, cu_seqlens_q=params.cu_seqlens_q, cu_seqlens_k=params.cu_seqlens_kv,
                            max_seqlen_q=params.max_seqlen_q, max_seqlen_k=params.max_seqlen_kv, causal=False,
                            bounds_q=bounds, bounds_k=bounds)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    """Split over ``groups`` (tp > 1): this rank's ``heads / tp`` heads (q / k / v rows of each, a column-parallel
    ``qkv``). ``recompute``: the attention itself recomputed in the backward (the tower's selective recompute)."""

    def __init__(self, dim: int, heads: int, groups: Any = None, *, recompute: bool = False):
        super().__init__()
        tp = 1 if groups is None else groups.tp
        if heads % tp:
            raise ValueError(f"vision tower: {heads} heads do not split over tp {tp}")
        self.heads, self.recompute = heads // tp, recompute
        self.qkv = column(dim, 3 * dim, groups=groups, stride=3)
        self.proj = row(dim, dim, groups=groups)

    def forward(self, x: torch.Tensor, cu_seqlens: Any, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv(x).reshape(t, 3, self.heads, -1).unbind(1)
        dtype = q.dtype
        # NOTE: the rotation in fp32 (transformers' apply_rotary_pos_emb_vision)
        q, k = q.float(), k.float()
        cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
        q, k = (q * cos + _rotate_half(q) * sin).to(dtype), (k * cos + _rotate_half(k) * sin).to(dtype)
        if self.recompute and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            out = checkpoint(block_attention, q, k, v, cu_seqlens, use_reentrant=False)
        else:
            out = block_attention(q, k, v, cu_seqlens)
        return self.proj(out.reshape(t, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int, *, bias: bool = True, groups: Any = None):
        super().__init__()
        self.gate_proj = column(dim, hidden, bias=bias, groups=groups)
        self.up_proj = column(dim, hidden, bias=bias, groups=groups)
        self.down_proj = row(hidden, dim, bias=bias, groups=groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, groups: Any = None, *, recompute: str = "none"):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(dim), RMSNorm(dim)
        self.attn = Attention(dim, heads, groups, recompute=recompute == "selective")
        self.mlp = SwiGLU(dim, hidden, groups=groups)

    def forward(self, x, cu_seqlens, cos, sin):
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, *, patch: int, temporal: int, channels: int, dim: int, bias: bool = False):
        super().__init__()
        self.shape = (channels, temporal, patch, patch)
        self.dim = dim
        self.proj = nn.Conv3d(channels, dim, kernel_size=self.shape[1:], stride=self.shape[1:], bias=bias)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = pixels.reshape(-1, *self.shape).to(self.proj.weight.dtype)
        return self.proj(x).reshape(-1, self.dim)


class PatchMerger(nn.Module):
    def __init__(self, *, dim: int, context: int, merge: int, groups: Any = None):
        super().__init__()
        self.width = context * merge * merge
        self.ln_q = RMSNorm(context)
        self.mlp = nn.Sequential(column(self.width, self.width, groups=groups), nn.GELU(),
                                 row(self.width, dim, groups=groups))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).reshape(-1, self.width))


def patch_positions(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """(row, column) of every patch ``[patches, 2]``, on the host, in the order the processor flattens them: merge
    x merge blocks one after another, each block row-major."""
    out = []
    for t, h, w in grid_thw.tolist():
        rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        hw = torch.stack([rows.transpose(1, 2).reshape(-1), cols.transpose(1, 2).reshape(-1)], dim=-1)
        out.append(hw.repeat(t, 1))
    return torch.cat(out)


def window_order(grid_thw: torch.Tensor, *, merge: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(merged-patch order that puts each attention window's patches together, window bounds over patches).

    A window is ``window`` merged patches square (``window_size // patch // merge``), tiled from the image's top
    left; edge windows are smaller. Bounds are cumulative patch counts (``merge**2`` patches per merged one). Both
    on the host."""
    order, bounds, base = [], [0], 0
    unit = merge * merge
    for t, h, w in grid_thw.tolist():
        gh, gw = h // merge, w // merge
        index = torch.arange(t * gh * gw).view(t, gh, gw)
        for ti in range(t):
            for r in range(0, gh, window):
                for c in range(0, gw, window):
                    cell = index[ti, r:r + window, c:c + window].reshape(-1)
                    order.append(cell + base)
                    bounds.append(bounds[-1] + cell.numel() * unit)
        base += t * gh * gw
    return torch.cat(order), torch.tensor(bounds, dtype=torch.int32)


def rotary_2d(pos: torch.Tensor, *, theta: float, half: int, order: torch.Tensor | None = None,
              unit: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin ``[patches, head_dim]`` of the 2-D rotary embedding: half the channels rotate with the row, half
    with the column; ``order`` reorders merged patches (window attention)."""
    # NOTE: computed in fp32 here, not a buffer: casting the module to bf16 would round the frequencies
    inv_freq = 1.0 / theta ** (torch.arange(0, half, 2, dtype=torch.float, device=pos.device) / half)
    freqs = (pos[..., None].float() * inv_freq).flatten(1)  # [patches, head_dim / 2]
    if order is not None:
        freqs = freqs.view(-1, unit, freqs.shape[-1])[order].reshape(freqs.shape)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def host_grids(grid_thw: torch.Tensor) -> torch.Tensor:
    """The grids on the host, where the tower's metadata (positions, windows, boundaries) is made.

    NOTE: the data pipeline keeps a micro-batch's grids there (its ``host_keys``), so this reads nothing back from
    the device; grids given on the device (a direct call of the model) are read back once here."""
    return grid_thw.cpu()


def image_bounds(grid_thw: torch.Tensor) -> torch.Tensor:
    """Cumulative patch counts per temporal frame of every image (full attention within a frame)."""
    sizes = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
    return F.pad(sizes.cumsum(0), (1, 0)).to(torch.int32)


def run_block(block: nn.Module, *args: Any, recompute: bool) -> torch.Tensor:
    """One block, its activations recomputed in the backward when ``recompute`` (the tower's full recompute)."""
    if recompute and torch.is_grad_enabled():
        from torch.utils.checkpoint import checkpoint

        return checkpoint(block, *args, use_reentrant=False)
    return block(*args)


class VisionTower(nn.Module):
    """Qwen2.5-VL's ViT: ``pixel_values [patches, channels * temporal * patch * patch]`` (the processor's) and
    ``grid_thw [images, 3]`` -> one embedding per merged patch ``[patches / merge**2, out_hidden_size]``."""

    def __init__(self, cfg: Mapping[str, Any], *, groups: Any = None, recompute: str = "none"):
        super().__init__()
        dim, heads = cfg["hidden_size"], cfg["num_heads"]
        self.full_recompute = recompute == "full"
        self.merge = cfg.get("spatial_merge_size", 2)
        self.window = cfg.get("window_size", 112) // cfg.get("patch_size", 14) // self.merge
        self.full = set(cfg.get("fullatt_block_indexes", []))
        self.patch_embed = PatchEmbed(patch=cfg.get("patch_size", 14), temporal=cfg.get("temporal_patch_size", 2),
                                      channels=cfg.get("in_channels", 3), dim=dim)
        self.theta = float((cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        self.half = dim // heads // 2  # NOTE: each of the two axes rotates half of a head's channels
        self.blocks = nn.ModuleList(Block(dim, heads, cfg["intermediate_size"], groups, recompute=recompute)
                                    for _ in range(cfg["depth"]))
        self.merger = PatchMerger(dim=cfg["out_hidden_size"], context=dim, merge=self.merge, groups=groups)

    def forward(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(pixels)
        unit, dev, grid = self.merge * self.merge, x.device, host_grids(grid_thw)
        order, windows = window_order(grid, merge=self.merge, window=self.window)
        images, windows = blocks(image_bounds(grid), dev), blocks(windows, dev)
        restore = torch.argsort(order).to(dev, non_blocking=True)
        order = order.to(dev, non_blocking=True)
        x = x.view(-1, unit, x.shape[-1])[order].reshape(x.shape)
        pos = patch_positions(grid, self.merge).to(dev, non_blocking=True)
        cos, sin = rotary_2d(pos, theta=self.theta, half=self.half, order=order, unit=unit)
        for i, block in enumerate(self.blocks):
            x = run_block(block, x, images if i in self.full else windows, cos, sin, recompute=self.full_recompute)
        return self.merger(x)[restore]
