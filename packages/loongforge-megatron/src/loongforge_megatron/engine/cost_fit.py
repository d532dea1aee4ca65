"""The data-parallel balancer's cost model fitted from this run's own warm-up steps (``data.balance``).

During the first ``warmup_steps`` steps every forward of a micro-batch is timed (the accelerator synchronised on
both sides: only those steps pay for it) next to the micro-batch's ``cost_features`` (``data/datasets.py``).
After them, every rank's measurements are gathered, rank 0 fits ``a·Σl² + b·Σl + c + v·patches`` by least
squares (``loongforge.parallel.balance.fit_cost_model``) and sends it to all: the placement must be computed from
the same coefficients everywhere, or a sample would be trained twice and another not at all. The fit is used from
the next step on; the batch workers are restarted so they make the coming steps with it too.

NOTE: the forward alone is timed: inside megatron's schedule a backward is not a call of ours, and it scales with
the forward. The times are per micro-batch, so the DP gradient reduction (where ranks wait for each other) is
not in them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from loongforge.parallel.balance import LoadBalancer, fit_cost_model


class WarmupCostFit:
    """Times warm-up micro-batches and fits the balancer's cost model once, collectively."""

    def __init__(self, balancer: LoadBalancer, *, synchronize: Callable[[], None], first_step: int):
        self.balancer, self.synchronize = balancer, synchronize
        self.end = first_step + balancer.warmup_steps  # NOTE: a resumed run warms up again from its first step
        self.observed: list[tuple[tuple[float, float, float], float]] = []
        self.fitted = None

    def forward_step(self, fn: Callable[..., Any], *, step: int) -> Callable[..., Any]:
        """``fn`` (megatron's forward_step_func), timed while ``step`` is a warm-up step."""
        if step >= self.end:
            return fn

        def timed(data_iterator, model):
            batch = next(data_iterator)
            self.synchronize()
            start = time.perf_counter()
            out = fn(iter([batch]), model)
            self.synchronize()
            if isinstance(batch, dict) and "cost_features" in batch:
                self.observed.append((batch["cost_features"], time.perf_counter() - start))
            return out

        return timed

    def after_step(self, steps_done: int) -> bool:
        """Fit once the warm-up is over (every rank calls it); True when the balancer took a new model."""
        if steps_done != self.end:
            return False
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, self.observed)
        self.observed = []
        model = None
        if dist.get_rank() == 0:
            rows = [obs for part in every for obs in part]
            model = fit_cost_model([f for f, _ in rows], [t for _, t in rows]) if rows else None
        box = [model]
        dist.broadcast_object_list(box, src=0)
        self.fitted = box[0]
        self.balancer.use(self.fitted, from_step=steps_done)
        return self.fitted is not None
