"""The layouts a VLM's ``vision`` component (its tower and projector) may take, checked on the resolved plan.

The tower lives on the language model's first pipeline stage with the language model's context and data
parallelism; what it takes for itself is its tensor parallelism (a divisor of the language model's: the copies in one
language TP group then encode different images, ``engine/encoder_split.py``), its recompute and its freeze
(``train.freeze``), and under pipeline parallelism whether it runs outside the schedule (``decoupled``,
``engine/decoupled_encoder.py``). Some families' may instead run on ranks of its own (``num_ranks``,
``engine/encoder_ranks.py``). Every other per-component size is refused with the keys and the values, before any
process group.
"""

from __future__ import annotations

from typing import Any

from loongforge.errors import RecipeError

COMPONENT = "vision"
_SAME = ("pp", "vpp", "cp", "ep")


def check_own_ranks(plan: Any) -> None:
    """Refuse an encoder on ranks of its own (``num_ranks``, ``engine/encoder_ranks.py``) that cannot run: the
    components are ``vision`` and ``language``; the encoder ranks are data parallel only (each holds the whole
    tower, and serves whole data-parallel ranks of the language model), the language model runs without pipeline
    or context parallelism."""
    key = "parallel.components"
    for name in plan.components:
        if name not in (COMPONENT, "language"):
            raise RecipeError(f"{key}.{name}: with num_ranks the components are '{COMPONENT}' (the tower and "
                              f"projector, on ranks of its own) and 'language' (the language model)",
                              key=f"{key}.{name}")
    if set(plan.components) != {COMPONENT, "language"}:
        raise RecipeError(f"{key}: with num_ranks both '{COMPONENT}' and 'language' set it (got "
                          f"{sorted(plan.components)})", key=f"{key}.{COMPONENT}.num_ranks")
    enc, lm = plan.components[COMPONENT], plan.components["language"]
    v = f"{key}.{COMPONENT}"
    for k in ("tp", "pp", "cp", "ep"):
        if getattr(enc, k) != 1:
            raise RecipeError(f"{v}.{k} = {getattr(enc, k)} with {v}.num_ranks = {enc.world_size}: an encoder on "
                              f"ranks of its own runs data parallel only (each rank holds the whole tower; got "
                              f"{k} = {getattr(enc, k)})", key=f"{v}.{k}")
    if enc.decoupled:
        raise RecipeError(f"{v}.decoupled = true with {v}.num_ranks = {enc.world_size}: decoupled is for a tower "
                          f"on the language model's first pipeline stage; an encoder on ranks of its own already "
                          f"runs outside the language model's schedule", key=f"{v}.decoupled")
    for k in ("pp", "cp"):
        if getattr(lm, k) != 1:
            raise RecipeError(f"{key}.language.{k} = {getattr(lm, k)} with {v}.num_ranks = {enc.world_size}: the "
                              f"language model beside an encoder on ranks of its own runs with tensor, sequence "
                              f"and data parallelism only (got {k} = {getattr(lm, k)})", key=f"{key}.language.{k}")
    if enc.world_size > lm.dp:
        raise RecipeError(f"{v}.num_ranks = {enc.world_size} > the language model's data-parallel size {lm.dp} "
                          f"({key}.language.num_ranks {lm.world_size} / tp {lm.tp}): each encoder rank serves "
                          f"whole data-parallel ranks", key=f"{v}.num_ranks")


def check_own_ranks_recipe(recipe: Any, plan: Any) -> None:
    """What an encoder on ranks of its own (``plan``: the full plan, split) does not train with."""
    n = f"parallel.components.{COMPONENT}.num_ranks = {plan.components[COMPONENT].world_size}"
    if recipe.train.stage == "lora":
        raise RecipeError(f"train.stage lora with {n}: LoRA trains beside a tower on the language model's ranks "
                          f"only", key="train.stage")
    if recipe.data.balance:
        raise RecipeError(f"data.balance with {n}: the encoder ranks read the batches as the data-parallel ranks "
                          f"are given them (remove data.balance)", key="data.balance")
    if plan.distributed_optimizer:
        raise RecipeError(f"parallel.distributed_optimizer = true with {n}: each rank set steps megatron's plain "
                          f"optimizer", key="parallel.distributed_optimizer")


def check_vision_component(plan: Any, *, heads: int, ffn: int, sizes: tuple[tuple[str, int], ...] = (),
                           own_ranks: bool = False, family: str = "this model") -> None:
    """Refuse a ``parallel.components`` layout the vision component cannot run. ``heads`` / ``ffn``: the tower's
    attention heads and MLP width (split by its tp); ``sizes``: more (what, size) pairs its tp must divide;
    ``own_ranks``: the model can run its encoder on ranks of its own (:func:`check_own_ranks`); ``family``: the
    model's, for the message where it cannot."""
    key = "parallel.components"
    if own_ranks and any(c.first_rank or c.world_size != plan.world_size for c in plan.components.values()):
        check_own_ranks(plan)
        return
    for name, comp in plan.components.items():
        if name != COMPONENT:
            raise RecipeError(f"{key}.{name}: this model has one separately laid-out component, '{COMPONENT}' (its "
                              f"tower and projector)", key=f"{key}.{name}")
        if comp.first_rank or comp.world_size != plan.world_size:
            raise RecipeError(f"{key}.{name}.num_ranks = {comp.world_size}: {family} runs its {name} component on "
                              f"the language model's ranks (a colocated grid); an encoder on ranks of its own is "
                              f"not done for it (docs/vlm.md lists the families that have one)",
                              key=f"{key}.{name}.num_ranks")
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


