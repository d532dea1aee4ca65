"""The record behind each sample index when epochs follow one another, each a seeded reshuffle of the records."""

from __future__ import annotations

import torch


class ShuffledEpochs:
    """``order(idx)``: the record of sample ``idx`` (epoch ``idx // n``; its permutation is seeded by the seed and the
    epoch, so every rank and a resumed run see the same order). The current epoch's permutation is cached."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed
        self._epoch: tuple[int, list[int]] | None = None

    def __call__(self, idx: int) -> int:
        epoch, i = divmod(idx, self.n)
        if self._epoch is None or self._epoch[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch = (epoch, torch.randperm(self.n, generator=g).tolist())
        return self._epoch[1][i]
