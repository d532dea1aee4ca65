"""How evenly a MoE model's routers spread tokens: per-layer expert loads counted from the routing maps.

A forward hook on every megatron router adds ``routing_map.sum(0)`` (tokens sent to each expert) into one
``[num_layers, num_experts]`` counter on the device, during training forwards only; ``collect`` sums the counter
over all ranks (one all-reduce) and turns it into imbalance = max / mean - 1 per layer:

- over experts (``expert``): how far the busiest expert is above the average one;
- over expert-parallel ranks (``ep``, when ep > 1): the same for the contiguous blocks of ``num_experts / ep``
  experts each EP rank holds, i.e. the straggler factor of the All2All and the expert GEMMs.

The hook sees each routed token ``repeat`` times in a run where that is constant: without sequence parallelism
every TP rank routes the same tokens, and full recompute routes each micro-batch again in backward. The counts
are divided by it, so they are tokens; the ratios would not change either way.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist


class RouterLoad:
    """Expert loads of every MoE layer of this rank's model chunks (all ranks call :meth:`collect` together)."""

    def __init__(self, modules: Iterable[torch.nn.Module], *, num_layers: int, num_experts: int, ep: int,
                 device: torch.device, repeat: int = 1):
        from megatron.core.transformer.moe.router import Router

        if num_experts % ep:
            raise ValueError(f"{num_experts} experts do not split over ep = {ep}")
        self.ep, self.repeat = ep, repeat
        self.first_step = 1  # the first step the counts cover (a resume restores it)
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.int64, device=device)
        self.total = torch.zeros(num_layers, num_experts, dtype=torch.int64)  # whole run, on the host
        self.last = torch.zeros(num_layers, num_experts, dtype=torch.int64)  # the last collected step's counts
        for module in modules:
            for name, m in module.named_modules():
                # NOTE: multi-token prediction's routers number their layers from 1 again (not decoder layers)
                if isinstance(m, Router) and not (name.startswith("mtp.") or ".mtp." in name):
                    m.register_forward_hook(self._count)

    def _count(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not module.training:
            return
        routing_map = output[1]
        with torch.no_grad():
            # NOTE: megatron's layer_number is global and 1-based (pipeline offset included).
            self.counts[module.layer_number - 1] += routing_map.sum(0, dtype=torch.int64)

    def collect(self) -> dict[str, Any]:
        """Sum over ranks, reset, and return per-layer imbalance (``None`` for dense layers) plus the maxima."""
        counts = self.counts.clone()
        self.counts.zero_()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(counts)
        counts = counts.cpu() // self.repeat
        self.total += counts
        self.last = counts
        return imbalance(counts, ep=self.ep)

    def summary(self) -> dict[str, Any]:
        """Imbalance of the whole run's loads, per layer, and the loads themselves (tokens per expert)."""
        return {**imbalance(self.total, ep=self.ep), "tokens_per_expert": self.total.tolist()}


def imbalance(counts: torch.Tensor, *, ep: int) -> dict[str, Any]:
    """``counts[layer, expert]`` -> max/mean - 1 over experts and over EP ranks, per layer and the worst layer."""
    out: dict[str, Any] = {"expert": [], "ep": []}
    for row in counts.double():
        if row.sum() == 0:  # a dense layer (or no tokens yet)
            out["expert"].append(None)
            out["ep"].append(None)
            continue
        out["expert"].append(float(row.max() / row.mean() - 1))
        per_rank = row.view(ep, -1).sum(1)
        out["ep"].append(float(per_rank.max() / per_rank.mean() - 1) if ep > 1 else None)
    for key in ("expert", "ep"):
        vals = [v for v in out[key] if v is not None]
        out[f"max_{key}"] = max(vals) if vals else None
    return out
