"""Packed micro-batches of a diffusion transformer: samples of different sizes (videos, images) as one token
sequence, each attending only itself.

The samples' patch tokens are joined; ``bounds`` are the samples' token boundaries (the ``cu_seqlens`` of the
varlen attention). Under context parallelism rank r holds the contiguous tokens ``[r*T/cp, (r+1)*T/cp)``, which may
cut a sample: its queries there attend the sample's whole token sequence (Ulysses gathers it, the ring passes it
by) and its own text::

    tokens   [ sample 0 (12) | sample 1 (20)  | sample 2 (8) ]      T = 40, cp 2
    rank 0   [ sample 0 (12) | sample 1 (8)  ]                       texts of samples 0, 1
    rank 1                   [ sample 1 (12) | sample 2 (8) ]        texts of samples 1, 2
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Packing:
    """This CP rank's view of a packed micro-batch (host ints, built once per forward)."""

    counts: tuple[int, ...]  # tokens per sample
    bounds: tuple[int, ...]  # the samples' token boundaries in the whole packed sequence
    start: int  # this rank's tokens: [start, end)
    end: int
    first: int  # the samples this rank's tokens belong to: [first, last)
    last: int
    local_bounds: tuple[int, ...]  # those samples' boundaries clipped to this rank's tokens, from 0

    @classmethod
    def of(cls, grids: Sequence[Sequence[int]], *, cp_rank: int = 0, cp_size: int = 1) -> Packing:
        """The packing of samples with patch ``grids`` (frames, rows, columns) on CP rank ``cp_rank``."""
        return cls.of_counts([int(f) * int(h) * int(w) for f, h, w in grids], cp_rank=cp_rank, cp_size=cp_size)

    @classmethod
    def of_counts(cls, counts: Sequence[int], *, cp_rank: int = 0, cp_size: int = 1) -> Packing:
        """The packing of samples of ``counts`` tokens each on CP rank ``cp_rank``."""
        counts = tuple(int(c) for c in counts)
        bounds = [0]
        for c in counts:
            bounds.append(bounds[-1] + c)
        total = bounds[-1]
        if total % cp_size:
            raise ValueError(f"{total} packed tokens do not split over cp = {cp_size}")
        start, end = cp_rank * total // cp_size, (cp_rank + 1) * total // cp_size
        present = [i for i in range(len(counts)) if bounds[i] < end and bounds[i + 1] > start]
        first, last = present[0], present[-1] + 1
        local = [0] + [min(bounds[i + 1], end) - start for i in range(first, last)]
        return cls(counts=counts, bounds=tuple(bounds), start=start, end=end, first=first, last=last,
                   local_bounds=tuple(local))

    def segments(self, device: torch.device) -> Tensor:
        """``[T]``: the sample index of every packed token (what the ring attention masks by)."""
        return torch.repeat_interleave(torch.arange(len(self.counts), device=device),
                                       torch.tensor(self.counts, device=device))

    def per_token(self, x: Tensor) -> Tensor:
        """Per-sample rows ``[n, ...]`` -> this rank's tokens' rows ``[end - start, ...]``."""
        counts = torch.tensor(self.counts, device=x.device)
        return x.repeat_interleave(counts, dim=0)[self.start:self.end]

    def local(self, x: Tensor) -> Tensor:
        """This rank's rows of ``[T, ...]`` packed tokens."""
        return x[self.start:self.end]

    def present(self, x: Tensor) -> Tensor:
        """The rows ``[n, L, ...]`` of the samples this rank's tokens belong to, joined: ``[1, (last-first)*L, ...]``."""
        return x[self.first:self.last].flatten(0, 1)[None]


def attend_segments(q: Tensor, k: Tensor, v: Tensor, *, bounds_q: Sequence[int],
                    bounds_k: Sequence[int] | None = None) -> Tensor:
    """Full attention of ``[1, tq, heads, d]`` queries per segment over ``[1, tk, heads, d]`` keys / values ->
    ``[1, tq, heads * d]``. ``bounds_k`` None: the keys are ``len(bounds_q) - 1`` equal segments (texts)."""
    from loongforge_megatron.layers.varlen import varlen_attention

    if bounds_k is None:
        n = len(bounds_q) - 1
        per = k.shape[1] // n
        bounds_k = [i * per for i in range(n + 1)]
    cu_q = torch.tensor(bounds_q, dtype=torch.int32, device=q.device)
    cu_k = torch.tensor(bounds_k, dtype=torch.int32, device=q.device)
    longest_q = max(b - a for a, b in zip(bounds_q, bounds_q[1:], strict=False))
    longest_k = max(b - a for a, b in zip(bounds_k, bounds_k[1:], strict=False))
    out = varlen_attention(q[0], k[0], v[0], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=longest_q,
                           max_seqlen_k=longest_k, causal=False, bounds_q=list(bounds_q), bounds_k=list(bounds_k))
    return out.flatten(1)[None]
