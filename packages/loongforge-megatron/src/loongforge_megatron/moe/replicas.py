"""In-training expert replicas (``model.moe.replica_slots_per_rank``): every ``model.moe.replica_interval`` steps the
router's live loads (the counts ``engine/router_load.py`` already sums over all ranks for the metrics) feed
:func:`~loongforge_megatron.moe.placement.plan`, and every MoE layer (``layers/ep_moe_layer.py``) dispatches by the
new plan from the next step on.

Every rank makes the same plan from the same all-reduced loads (the planner is deterministic), so no plan is
communicated. Until the first plan, a plan for equal loads fills the spare slots.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable

import numpy as np
import torch
import torch.distributed as dist

from loongforge_megatron.moe.placement import Placement, Topology, plan


def ranks_per_node(ep: int) -> int:
    """EP ranks that share a node: the launcher's processes per node, as far as they divide ``ep``."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) or ep
    return math.gcd(ep, local)


class ReplicaSchedule:
    """Plans replicas for the EP MoE layers of this rank's model chunks and hands each layer its part."""

    def __init__(self, modules: Iterable[torch.nn.Module], *, num_layers: int, num_experts: int, ep: int,
                 slots_per_rank: int, interval: int):
        from loongforge_megatron.layers.ep_moe_layer import EPMoELayer

        self.layers = [m for module in modules for m in module.modules()
                       if isinstance(m, EPMoELayer) and m.replica_slots]
        self.topology = Topology(ranks=ep, ranks_per_node=ranks_per_node(ep))
        self.slots, self.interval = slots_per_rank, interval
        self.window = np.zeros((num_layers, num_experts))
        self.placement: Placement = plan(np.ones((num_layers, num_experts)), self.topology, slots_per_rank)
        self.plans = 0  # plans made from loads
        self._apply()

    def _apply(self) -> None:
        for layer in self.layers:
            i = layer.layer_number - 1  # NOTE: megatron's global, 1-based layer number
            layer.set_placement(self.placement.slot_expert[i], self.placement.slot_share[i])

    def reduce_grads(self) -> None:
        """Every layer's replica gradients into its home experts' (after the backward, before the optimizer)."""
        for layer in self.layers:
            layer.reduce_replica_grads()

    def after_step(self, step: int, loads: torch.Tensor) -> None:
        """Add one step's loads ``[layers, experts]`` (all ranks'); every ``interval`` steps plan again from them."""
        self.window += loads.double().numpy()
        if step % self.interval == 0 and self.window.sum() > 0:
            self.placement = plan(self.window, self.topology, self.slots, previous=self.placement)
            self.window[:] = 0
            self.plans += 1
            self._apply()

    def metrics(self) -> dict[str, float]:
        """Since the last call, over all ranks: ``moe_replica_token_share`` (the fraction of routed tokens computed
        on replica slots) and ``moe_ep_imbalance_replicas`` (the tokens each EP rank computed, max / mean - 1,
        worst layer: ``moe_ep_imbalance`` with the replicas taking their share)."""
        rows = self.window.shape[0]
        local = torch.zeros(rows + 3, dtype=torch.float64)
        for layer in self.layers:
            local[layer.layer_number - 1] += layer.replica_tokens[1]
            local[rows:rows + 2] += layer.replica_tokens
            layer.replica_tokens.zero_()
        local[rows + 2] = self.layers[0].ep_rank if self.layers else 0
        if dist.is_initialized() and dist.get_world_size() > 1:
            device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
            parts = [torch.zeros_like(local, device=device) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, local.to(device))
            every = torch.stack(parts).cpu()
        else:
            every = local[None]
        per_ep = torch.zeros(self.topology.ranks, rows, dtype=torch.float64)
        per_ep.index_add_(0, every[:, rows + 2].long(), every[:, :rows])
        out: dict[str, float] = {}
        replica, total = every[:, rows].sum(), every[:, rows + 1].sum()
        if total > 0:
            out["moe_replica_token_share"] = float(replica / total)
            used = per_ep.sum(0) > 0
            mean = per_ep[:, used].mean(0)
            out["moe_ep_imbalance_replicas"] = float((per_ep[:, used].max(0).values / mean - 1).max())
        return out
