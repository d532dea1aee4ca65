"""Multimodal RoPE of the Qwen-VL language models: every token has three positions (time, row, column); text
tokens have the same one three times, an image's tokens their frame, row and column on its merged-patch grid,
offset to follow the text before it.

:class:`MRoPE` is the rotary embedding of the language model (``GPTModel.rotary_pos_emb`` with megatron's
``mrope`` position type); :func:`mrope_positions` computes a sample's ``[3, s]`` positions as transformers'
``get_rope_index`` does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class MRoPE(nn.Module):
    """Frequencies ``[s, b, 1, rotary dim]`` for ``position_ids [3, b, s]``. ``mrope_section`` splits the half
    rotary dimension's frequencies among time / row / column: in consecutive blocks (Qwen2-VL / 2.5-VL), or
    ``interleaved`` (Qwen3-VL: frequency j takes axis j % 3 while that axis has frequencies left, else time).
    ``rotary_percent``: the leading share of each head's dims that rotates (the rest passes through)."""

    def __init__(self, *, kv_channels: int, rotary_base: float, interleaved: bool = False,
                 rotary_percent: float = 1.0):
        super().__init__()
        self.dim, self.base, self.interleaved = int(kv_channels * rotary_percent), float(rotary_base), interleaved

    def axis_of_frequency(self, section: Sequence[int], device: torch.device) -> torch.Tensor:
        half = self.dim // 2
        if sum(section) != half:
            raise ValueError(f"mrope_section {list(section)} must sum to the rotary dims / 2 = {half}")
        if not self.interleaved:
            return torch.repeat_interleave(torch.arange(3, device=device), torch.tensor(section, device=device))
        axis = torch.zeros(half, dtype=torch.long, device=device)
        for a in (1, 2):
            axis[a: section[a] * 3: 3] = a
        return axis

    def forward(self, position_ids: torch.Tensor, mrope_section: Sequence[int], cp_group=None) -> torch.Tensor:
        device = position_ids.device
        inv_freq = 1.0 / self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float, device=device) / self.dim)
        freqs = position_ids.float()[..., None] * inv_freq  # [3, b, s, half]
        axis = self.axis_of_frequency(mrope_section, device)
        freqs = freqs.gather(0, axis.view(1, 1, 1, -1).expand(1, *freqs.shape[1:])).squeeze(0)  # [b, s, half]
        emb = torch.cat([freqs, freqs], dim=-1)
        # NOTE: under context parallelism ``position_ids`` are this rank's tokens' already (the micro-batch's
        # context-parallel slice), so the rows are too: ``cp_group`` needs no slicing here
        return emb.transpose(0, 1).unsqueeze(2).contiguous()


def mrope_positions(ids: Sequence[int], *, grids: Sequence[Sequence[int]], image_token: int, video_token: int | None,
                    merge: int, time_scale: Sequence[float] = ()) -> torch.Tensor:
    """``[3, len(ids)]`` positions of one sample: a run of image (or video) placeholder tokens takes the next grid
    of ``grids`` (t, h, w in patches; ``merge`` x ``merge`` patches per token) and positions ``start + (frame *
    time_scale, row, column)``; the next text starts at ``start + max(h, w) / merge`` (transformers' rule).
    ``time_scale``: per video, the positions one frame advances (images: 1)."""
    out: list[torch.Tensor] = []
    pos, i, n, k, v = 0, 0, len(ids), 0, 0
    vision = {image_token} | ({video_token} if video_token is not None else set())
    while i < n:
        if ids[i] not in vision:
            j = i
            while j < n and ids[j] not in vision:
                j += 1
            out.append(torch.arange(pos, pos + j - i).expand(3, -1))
            pos += j - i
            i = j
            continue
        tok = ids[i]
        if k >= len(grids):
            raise ValueError(f"more image / video placeholder runs than the {len(grids)} grids given")
        t, h, w = (int(x) for x in grids[k])
        gh, gw = h // merge, w // merge
        scale = 1.0
        if tok == video_token:
            scale = float(time_scale[v]) if v < len(time_scale) else 1.0
            v += 1
        k += 1
        tt = (torch.arange(t) * scale).long().view(t, 1, 1).expand(t, gh, gw)
        hh = torch.arange(gh).view(1, gh, 1).expand(t, gh, gw)
        ww = torch.arange(gw).view(1, 1, gw).expand(t, gh, gw)
        grid = torch.stack([tt, hh, ww]).reshape(3, -1) + pos
        if i + grid.shape[1] > n or any(x != tok for x in ids[i:i + grid.shape[1]]):
            raise ValueError(f"a placeholder run at token {i} is shorter than its grid's {grid.shape[1]} tokens")
        out.append(grid)
        i += grid.shape[1]
        pos += max(gh, gw)
    return torch.cat(out, dim=1) if out else torch.zeros(3, 0, dtype=torch.long)
