"""Backend ``toy``: fits a linear model to synthetic data with data parallelism, using only the accelerator API.

It exists so the example plugin can run a recipe without installing a heavy backend; everything device-specific
goes through ``runtime.accelerator`` (device, seeding, collective backend, kernel overrides).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from loongforge.backend import Backend, Job
from loongforge.kernels import select_op
from pydantic import BaseModel, ConfigDict


class ToyModel(BaseModel):
    model_config = ConfigDict(extra="forbid")
    width: int = 8


class ToyJob(Job):
    """One rank: y = norm(x) @ w, data split across ranks, gradients averaged with all-reduce."""

    def __init__(self, recipe: Any, runtime: Any):
        self.recipe, self.runtime, self.acc = recipe, runtime, runtime.accelerator
        runtime.init_distributed()
        runtime.seed(recipe.train.seed)
        width, dev = recipe.model.width, self.acc.device()
        self.norm = select_op("rms_norm", provider="torch", device_type=self.acc.device_type, accelerator=self.acc)
        self.w = torch.zeros(width, 1, device=dev, requires_grad=True)
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(64, width, generator=gen).to(dev)
        self.y = self.norm(self.x, torch.ones(width, device=dev)) @ torch.randn(width, 1, generator=gen).to(dev)
        self.step_index = 0

    def step(self) -> dict[str, float]:
        world, rank = dist.get_world_size(), dist.get_rank()
        x, y = self.x[rank::world], self.y[rank::world]
        loss = ((self.norm(x, torch.ones_like(x[0])) @ self.w - y) ** 2).mean()
        loss.backward()
        dist.all_reduce(self.w.grad)
        with torch.no_grad():
            self.w -= self.recipe.train.lr * self.w.grad / world
            self.w.grad.zero_()
        total = loss.detach().clone()
        dist.all_reduce(total)
        self.step_index += 1
        return {"loss": total.item() / world}

    def run(self) -> dict[str, Any]:
        metrics: dict[str, float] = {}
        while self.step_index < self.recipe.train.steps:
            metrics = self.step()
            if self.runtime.logger is not None:
                self.runtime.logger.log(self.step_index, metrics)
        return metrics

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class ToyBackend(Backend):
    name = "toy"
    model_schema = ToyModel

    def build(self, recipe: Any, runtime: Any) -> Job:
        return ToyJob(recipe, runtime)
