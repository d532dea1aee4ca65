"""A distributed, stateful batch sampler whose position is a pure function of the optimizer step.

The global stream is the concatenation of seeded permutations of the dataset (one per epoch); optimizer step
``s`` consumes stream positions ``[s·G, (s+1)·G)`` for global batch ``G``, and data-parallel rank ``r`` takes the
``r``-th contiguous slice of it, cut into micro-batches. So the samples of a step do not depend on the number
of ranks (losses are comparable across process counts) and resuming at step ``s`` is exact: no iterator state
needs to be saved, only the step.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


class GlobalBatchSampler:
    """Yields this rank's micro-batches as lists of ``(position, index)``; position seeds per-sample noise."""

    def __init__(
        self, *, num_samples: int, global_batch: int, micro_batch: int, dp_rank: int, dp_size: int,
        seed: int, shuffle: bool = True, start_step: int = 0,
    ):
        if global_batch % (micro_batch * dp_size):
            raise ValueError(f"global batch {global_batch} is not divisible by micro batch {micro_batch} × dp {dp_size}")
        self.n, self.global_batch, self.micro_batch = num_samples, global_batch, micro_batch
        self.dp_rank, self.dp_size, self.seed, self.shuffle = dp_rank, dp_size, seed, shuffle
        self.accum = global_batch // (micro_batch * dp_size)
        self.start_step = start_step
        self._perm: tuple[int, torch.Tensor] | None = None

    def index(self, position: int) -> int:
        """Dataset index at a stream position."""
        epoch, i = divmod(position, self.n)
        if not self.shuffle:
            return i
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = (epoch, torch.randperm(self.n, generator=g))
        return int(self._perm[1][i])

    def step_microbatches(self, step: int) -> list[list[tuple[int, int]]]:
        """This rank's micro-batches of optimizer step ``step`` (0-based)."""
        local = self.global_batch // self.dp_size
        base = step * self.global_batch + self.dp_rank * local
        return [[(p, self.index(p)) for p in range(base + m * self.micro_batch, base + (m + 1) * self.micro_batch)]
                for m in range(self.accum)]

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        step = self.start_step
        while True:
            yield from self.step_microbatches(step)
            step += 1

    def state_dict(self, step: int) -> dict[str, int]:
        return {"step": step, "seed": self.seed, "num_samples": self.n, "global_batch": self.global_batch}
