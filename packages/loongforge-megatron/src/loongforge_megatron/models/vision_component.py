"""The layouts a VLM's ``vision`` component (its tower and projector) may take, checked on the resolved plan.

The tower lives on the language model's first pipeline stage with the language model's context and data
parallelism; what it takes for itself is its tensor parallelism (a divisor of the language model's: the copies in one
language TP group then encode different images, ``engine/encoder_split.py``), its recompute and its freeze
(``train.freeze``), and under pipeline parallelism whether it runs outside the schedule (``decoupled``,
``engine/decoupled_encoder.py``). Every other per-component size is refused with the keys and the values, before any
process group.
"""

from __future__ import annotations

from typing import Any

from loongforge.errors import RecipeError

COMPONENT = "vision"
_SAME = ("pp", "vpp", "cp", "ep")


def check_vision_component(plan: Any, *, heads: int, ffn: int, sizes: tuple[tuple[str, int], ...] = ()) -> None:
    """Refuse a ``parallel.components`` layout the vision component cannot run. ``heads`` / ``ffn``: the tower's
    attention heads and MLP width (split by its tp); ``sizes``: more (what, size) pairs its tp must divide."""
    key = "parallel.components"
    for name, comp in plan.components.items():
        if name != COMPONENT:
            raise RecipeError(f"{key}.{name}: this model has one separately laid-out component, '{COMPONENT}' (its "
                              f"tower and projector)", key=f"{key}.{name}")
        if comp.first_rank or comp.world_size != plan.world_size:
            raise RecipeError(f"{key}.{name}.num_ranks = {comp.world_size}: the {name} component runs on the "
                              f"language model's ranks (a colocated grid); an encoder on ranks of its own is not "
                              f"supported", key=f"{key}.{name}.num_ranks")
        for k in _SAME:
            mine, glob = getattr(comp, k), getattr(plan, k)
            if mine != glob:
                raise RecipeError(f"{key}.{name}.{k} = {mine} but parallel.{k} = {glob}: the {name} tower runs on "
                                  f"the language model's first pipeline stage with its context, expert and data "
                                  f"parallelism; per component only tp and recompute are set (got {k} = {mine})",
                                  key=f"{key}.{name}.{k}")
        if comp.etp != comp.tp:
            raise RecipeError(f"{key}.{name}.etp = {comp.etp}: the {name} tower has no experts (got etp = "
                              f"{comp.etp})", key=f"{key}.{name}.etp")
        if comp.sp and not plan.sp:
            raise RecipeError(f"{key}.{name}.sp = true but parallel.sp = false: the {name} tower runs without "
                              f"sequence parallelism (got sp = true)", key=f"{key}.{name}.sp")
        if comp.decoupled and plan.pp == 1:
            raise RecipeError(f"{key}.{name}.decoupled = true needs pipeline parallelism (parallel.pp > 1, got "
                              f"parallel.pp = 1): the {name} tower runs outside the pipeline schedule",
                              key=f"{key}.{name}.decoupled")
        if plan.tp % comp.tp:
            raise RecipeError(f"{key}.{name}.tp = {comp.tp} must divide parallel.tp = {plan.tp} ({plan.tp} % "
                              f"{comp.tp} = {plan.tp % comp.tp}): the {name} tower's copies share one language TP "
                              f"group", key=f"{key}.{name}.tp")
        for what, n in (("attention heads", heads), ("MLP width", ffn), *sizes):
            if n % comp.tp:
                raise RecipeError(f"{key}.{name}.tp = {comp.tp}: the {name} tower's {what} {n} do not split over "
                                  f"it ({n} % {comp.tp} = {n % comp.tp})", key=f"{key}.{name}.tp")


