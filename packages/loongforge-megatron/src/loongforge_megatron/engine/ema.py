"""Exponential moving average of the trained weights (``train.ema_decay``), as many diffusion and VLA
recipes report their results with.

Each rank keeps fp32 copies of the parameters it holds (its tensor / pipeline / expert shards; data-parallel
replicas hold equal copies), updated after every optimizer step with ``ema = decay * ema + (1 - decay) * param``.
The averages are saved with the rank's checkpoint (resume is exact) and are the weights the HF export writes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class ModelEMA:
    """fp32 averages of the trainable parameters of ``chunks`` (the unwrapped model chunks of this rank)."""

    def __init__(self, chunks: list[torch.nn.Module], decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"ema decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.params = [[(n, p) for n, p in chunk.named_parameters() if p.requires_grad] for chunk in chunks]
        self.shadow = [{n: p.detach().float().clone() for n, p in named} for named in self.params]

    @torch.no_grad()
    def reset(self) -> None:
        """Restart the averages at the current weights (a resume into a run saved without EMA)."""
        for named, shadow in zip(self.params, self.shadow, strict=True):
            for n, p in named:
                shadow[n].copy_(p.detach())

    @torch.no_grad()
    def update(self) -> None:
        for named, shadow in zip(self.params, self.shadow, strict=True):
            if named:
                avg = [shadow[n] for n, _ in named]
                torch._foreach_lerp_(avg, [p.detach().float() for _, p in named], 1.0 - self.decay)

    def state_dict(self) -> list[dict[str, torch.Tensor]]:
        return self.shadow

    def load_state_dict(self, state: list[dict[str, torch.Tensor]]) -> None:
        if len(state) != len(self.shadow) or any(set(s) != set(m) for s, m in zip(state, self.shadow, strict=True)):
            raise ValueError("the saved EMA weights are for other parameters")
        for mine, saved in zip(self.shadow, state, strict=True):
            for name, value in saved.items():
                if value.shape != mine[name].shape:
                    raise ValueError(f"the saved EMA of '{name}' has shape {tuple(value.shape)}, the model "
                                     f"{tuple(mine[name].shape)}")
                mine[name].copy_(value)

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """The averages in the parameters (cast to their dtype) for the ``with`` body; the trained weights after."""
        with torch.no_grad():
            backup = [[p.detach().clone() for _, p in named] for named in self.params]
            for named, shadow in zip(self.params, self.shadow, strict=True):
                for n, p in named:
                    p.copy_(shadow[n])
        try:
            yield
        finally:
            with torch.no_grad():
                for named, saved in zip(self.params, backup, strict=True):
                    for (_, p), value in zip(named, saved, strict=True):
                        p.copy_(value)
