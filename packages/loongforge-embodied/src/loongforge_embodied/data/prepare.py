"""``loongforge data prepare`` for the embodied backend."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from loongforge.errors import RecipeError

if TYPE_CHECKING:
    from loongforge.recipe.schema import Recipe


def prepare(recipe: Recipe, *, force: bool = False) -> Path:
    """Record ``data.record`` into ``data.root`` (skipped when already recorded, unless ``force``)."""
    d = recipe.data
    if d.format != "lerobot":
        raise RecipeError("only data.format 'lerobot' has a preparation step (synthetic needs none)", key="data.format")
    if d.record is None:
        raise RecipeError("set data.record (what to record) to prepare data.root", key="data.record")
    from loongforge_embodied.data.record import record_pusht

    rc = d.record
    return record_pusht(d.root, repo_id=d.repo_id, episodes=rc.episodes, max_steps=rc.max_steps,
                        image_size=rc.image_size, seed=rc.seed, force=force,
                        workers=rc.workers, noise=rc.noise)
