from __future__ import annotations

from typing import Literal

import pytest
from loongforge import registry
from loongforge.backend import Backend, Job
from loongforge.recipe.schema import Section
from pydantic import Field


class ToyModel(Section):
    width: int = Field(8, ge=1)
    kind: Literal["mlp", "linear"] = "mlp"


class ToyData(Section):
    samples: int = Field(64, ge=1)


class ToyJob(Job):
    def __init__(self, recipe, runtime):
        import torch

        self.recipe, self.runtime = recipe, runtime
        torch.manual_seed(recipe.train.seed)
        self.w = torch.zeros(recipe.model.width, requires_grad=True)
        self.opt = torch.optim.SGD([self.w], lr=recipe.train.lr)
        self.target = torch.ones(recipe.model.width)
        self.i = 0

    def step(self):
        self.opt.zero_grad()
        loss = ((self.w - self.target) ** 2).mean()
        loss.backward()
        self.opt.step()
        self.i += 1
        m = {"loss": float(loss.detach()), "lr": self.recipe.train.lr, "samples_per_s": 10.0}
        self.runtime.logger.log(self.i, m)
        return m

    def run(self):
        while self.i < self.recipe.train.steps:
            last = self.step()
        return {"step": self.i, **last}


class ToyBackend(Backend):
    name = "toy"
    model_schema = ToyModel
    data_schema = ToyData

    def build(self, recipe, runtime):
        return ToyJob(recipe, runtime)


@pytest.fixture
def toy_backend(monkeypatch):
    """Register the toy backend in the backend registry for one test."""
    entries = registry.backends._scan()
    monkeypatch.setitem(entries, "toy", registry.Entry("loongforge.backends", "toy", "conftest:ToyBackend", "tests",
                                                        obj=ToyBackend, loaded=True))
    return ToyBackend
