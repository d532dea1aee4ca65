"""Rectified-flow (flow-matching) training objective of latent diffusion transformers, for any model kind that
trains on it: the recipe keys, the per-sample noise level drawn by a dataset, and the loss.

A sample at noise level ``sigma`` in [0, 1] is ``x_t = (1 - sigma) * x_0 + sigma * noise``; the model sees the
timestep ``sigma * num_train_timesteps`` and predicts the velocity ``noise - x_0`` (what diffusers'
``FlowMatchEulerDiscreteScheduler`` integrates). ``sigma`` is drawn as ``u`` (uniform, or logit-normal:
``sigmoid(N(mean, std))``, diffusers' ``compute_density_for_timestep_sampling``) then shifted toward noise,
``shift * u / (1 + (shift - 1) * u)`` (the scheduler's ``shift``; 1 leaves it). ``sigma_range`` keeps it inside an
interval (a two-expert model trains one expert on its timesteps).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from loongforge_megatron.config import DataConfig

LOSS_KEY = "diffusion loss"
NUM_TRAIN_TIMESTEPS = 1000


class FlowMatchingData(DataConfig):
    """``data`` keys of the flow-matching objective (a kind's data section extends it)."""

    timestep_sampling: Literal["uniform", "logit_normal"] = Field(
        "uniform", description="how the noise level u is drawn before the shift: uniform on [0, 1] or "
        "sigmoid(N(logit_mean, logit_std))")
    logit_mean: float = Field(0.0, description="timestep_sampling logit_normal: mean of the normal")
    logit_std: float = Field(1.0, gt=0, description="timestep_sampling logit_normal: std of the normal")
    timestep_shift: float = Field(1.0, gt=0, description="sigma = shift * u / (1 + (shift - 1) * u): above 1 trains "
                                  "more on noisy timesteps (the scheduler's shift / flow_shift)")
    text_dropout: float = Field(0.1, ge=0, lt=1, description="probability that a sample's text embedding is "
                                "replaced by the empty prompt's (zeros), for classifier-free guidance")

    @model_validator(mode="after")
    def _logit_keys_need_logit_normal(self) -> FlowMatchingData:
        if self.timestep_sampling != "logit_normal" and (self.logit_mean != 0.0 or self.logit_std != 1.0):
            raise ValueError("data.logit_mean / data.logit_std shape timestep_sampling logit_normal; set "
                             "data.timestep_sampling: logit_normal or remove them")
        return self


@dataclass(frozen=True)
class FlowMatching:
    """The objective's values (from a recipe's :class:`FlowMatchingData`), drawn and applied per sample."""

    sampling: str = "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    shift: float = 1.0
    sigma_range: tuple[float, float] = (0.0, 1.0)
    num_train_timesteps: int = NUM_TRAIN_TIMESTEPS

    @classmethod
    def from_data(cls, data: Any, *, sigma_range: tuple[float, float] = (0.0, 1.0)) -> FlowMatching:
        return cls(sampling=data.timestep_sampling, logit_mean=data.logit_mean, logit_std=data.logit_std,
                   shift=data.timestep_shift, sigma_range=sigma_range)

    def draw_sigma(self, g: torch.Generator) -> torch.Tensor:
        """One sample's noise level (a 0-d float32 tensor) from the sample's own generator (resume is exact)."""
        if self.sampling == "logit_normal":
            u = torch.sigmoid(torch.randn((), generator=g, dtype=torch.float64) * self.logit_std + self.logit_mean)
        else:
            u = torch.rand((), generator=g, dtype=torch.float64)
        lo, hi = self.sigma_range
        return (lo + (hi - lo) * self.shifted(u)).float()

    def shifted(self, u: torch.Tensor) -> torch.Tensor:
        """``shift * u / (1 + (shift - 1) * u)``: the scheduler's timestep shift of noise levels ``u``."""
        return self.shift * u / (1 + (self.shift - 1) * u)

    def timesteps(self, sigmas: torch.Tensor) -> torch.Tensor:
        """The model's timestep input for noise levels ``sigmas`` ([b])."""
        return sigmas * self.num_train_timesteps


def add_noise(x0: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """``(1 - sigma) * x_0 + sigma * noise``, ``sigmas`` per sample ([b]) broadcast over the rest."""
    s = sigmas.view(-1, *([1] * (x0.dim() - 1))).to(x0.dtype)
    return (1 - s) * x0 + s * noise


def velocity(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The flow-matching target: ``noise - x_0``."""
    return noise - x0


def loss_func(output_tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Sum of squared errors and element count (megatron's per-token loss convention: the step divides by the
    global count, so the loss is the MSE over the whole global batch whatever the layout)."""
    total = output_tensor.sum()
    count = torch.tensor(output_tensor.numel(), dtype=torch.int, device=output_tensor.device)
    return total, count, {LOSS_KEY: torch.stack([total.detach(), count.detach().float()])}


def squared_error(pred: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Per-element squared error of a velocity prediction, in fp32 (summed by :func:`loss_func`)."""
    return (pred.float() - velocity(x0.float(), noise.float())).pow(2)
