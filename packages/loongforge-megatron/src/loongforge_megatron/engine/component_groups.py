"""A model component's own process groups (``parallel.components.<name>``), made from the resolved plan.

A colocated component (a VLM's vision tower and projector) runs on the language model's ranks with its own tensor
parallelism ``t``, a divisor of the language model's ``T``. Its grid is megatron-core's :class:`HyperCommGrid` over
the same ranks, in megatron's rank order, with the language model's TP dimension cut in two::

    [tp = t, hdp = T / t, cp, dp, pp]      (tp fastest, as ``tp-cp-ep-dp-pp``)

``tp``: the ranks that split one copy of the component; ``hdp`` ("encoder hetero-DP"): the copies inside one
language-model TP group, which encode *different* inputs of the micro-batch (``engine/encoder_split.py``) instead of
repeating the same work. Modules take these groups explicitly (megatron's :class:`ProcessGroupCollection` for its
own modules, the groups themselves for ours); megatron's ``parallel_state`` globals are never swapped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class ComponentGroups:
    """One component's layout on this rank: its tp / hdp sizes and ranks, their groups (None at size 1), its
    recompute mode, whether it runs outside the pipeline schedule (``engine/decoupled_encoder.py``) and the grid
    they come from."""

    name: str
    tp: int
    hdp: int
    tp_rank: int
    hdp_rank: int
    tp_group: Any
    hdp_group: Any
    recompute: str = "none"
    grid: Any = None
    decoupled: bool = False

    def collection(self) -> Any:
        """megatron's :class:`ProcessGroupCollection` for a megatron module of this component: the component's tp
        group; cp / pp / dp are the language model's (the grid shares those dimensions with it)."""
        from megatron.core.process_groups_config import ProcessGroupCollection

        groups = ProcessGroupCollection.use_mpu_process_groups()
        groups.tp = self.tp_group if self.tp_group is not None else _one_rank_group()
        return groups

    def mark_shards(self, module: torch.nn.Module) -> None:
        """Set each parameter's ``tensor_model_parallel`` so megatron's gradient norm counts every value once.

        NOTE: megatron counts a parameter on a rank when it is marked split or the rank is TP rank 0 of the
        language model. A shard of this component is held by ``hdp`` ranks of one language TP group: it stays
        marked on hdp rank 0 only; an unsplit parameter is unmarked (counted on language TP rank 0). A component
        split like the language model (hdp 1) keeps its layers' marks."""
        if self.hdp == 1:
            return
        for p in module.parameters():
            split = bool(getattr(p, "tensor_model_parallel", False)) and self.tp > 1
            p.tensor_model_parallel = split and self.hdp_rank == 0
            # NOTE: which shard this is, for a draw of the whole tensor (engine/weights.py's seeded_init)
            p.component_shard = (self.tp_rank, self.tp) if split else None

    def checkpoint_entries(self, prefixes: tuple[str, ...], *, tp: int) -> tuple:
        """The checkpoint layout's ``whole`` entries of this component (``prefixes``: its megatron names) under a
        language model at ``tp``: whole (tp 1), split over its own tp, or none (split like the language model)."""
        if self.tp == tp:
            return ()
        return prefixes if self.tp == 1 else tuple((p, self.tp) for p in prefixes)


_ONE_RANK: dict[int, Any] = {}
_GRIDS: list[Any] = []  # the grids made for this process's model-parallel state (released with it)


def release() -> None:
    """Destroy the components' groups (with megatron's model-parallel state: ``parallel_state.destroy``)."""
    for grid in _GRIDS:
        grid.destroy()
    _GRIDS.clear()
    _ONE_RANK.clear()


def _one_rank_group() -> Any:
    """This rank alone as a process group (megatron's modules at tp 1 still ask for a tp group).

    NOTE: collective: every rank creates every one-rank group, in the same order, the first time it is asked."""
    import torch.distributed as dist

    world = dist.get_world_size()
    if world not in _ONE_RANK:
        _ONE_RANK[world] = dist.new_subgroups(group_size=1)[0]
    return _ONE_RANK[world]


def component_tp(plan: Any, name: str, *, default: int | None = None) -> int:
    """``name``'s tensor parallelism: the plan's ``components.<name>.tp``, else ``default`` (a model kind's choice,
    e.g. 1: a small tower whole, its copies splitting the images), else the language model's."""
    if name in plan.components:
        return plan.components[name].tp
    return plan.tp if default is None else default


def component_groups(plan: Any, name: str, *, default_tp: int | None = None) -> ComponentGroups:
    """``name``'s groups on this rank from ``plan`` (a resolved :class:`~loongforge.parallel.plan.ParallelPlan`;
    ``default_tp``: :func:`component_tp`'s). Collective: every rank calls it, in the same order, before the model
    is built."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core.hyper_comm_grid import HyperCommGrid

    comp, t = plan.component(name), component_tp(plan, name, default=default_tp)
    if comp.first_rank or comp.world_size != plan.world_size:
        raise ValueError(f"parallel.components.{name}: a component on its own ranks (num_ranks) has no colocated grid")
    if plan.tp % t:
        raise ValueError(f"parallel.components.{name}.tp = {t} must divide parallel.tp = {plan.tp}")
    hdp = plan.tp // t
    if t == plan.tp:  # NOTE: the language model's own TP groups: no second communicator over the same ranks
        return ComponentGroups(name=name, tp=t, hdp=1, tp_rank=mpu.get_tensor_model_parallel_rank(), hdp_rank=0,
                               tp_group=mpu.get_tensor_model_parallel_group() if t > 1 else None, hdp_group=None,
                               recompute=comp.recompute, decoupled=comp.decoupled)
    grid = HyperCommGrid([t, hdp, plan.cp, plan.dp, plan.pp], ["tp", "hdp", "cp", "dp", "pp"])
    tp_group = grid.create_pg(["tp"]) if t > 1 else None
    hdp_group = grid.create_pg(["hdp"])
    _GRIDS.append(grid)
    return ComponentGroups(name=name, tp=t, hdp=hdp, tp_rank=dist.get_rank(tp_group) if tp_group else 0,
                           hdp_rank=dist.get_rank(hdp_group), tp_group=tp_group, hdp_group=hdp_group,
                           recompute=comp.recompute, grid=grid, decoupled=comp.decoupled)
