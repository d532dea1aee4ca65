"""LoongForge core: recipes, registries, accelerator API, parallel plan, launcher and CLI.

The public API::

    loongforge.load_recipe(path, overrides)  -> Recipe
    loongforge.train(recipe_or_path, output_dir=..., launch_config=...)
    loongforge.build_job(recipe, output_dir=...) -> (Job, Runtime)
"""

from __future__ import annotations

__version__ = "0.1.0"

from loongforge.api import build_job, run_in_process, train  # noqa: E402
from loongforge.errors import LoongForgeError, RecipeError  # noqa: E402
from loongforge.launcher import LaunchConfig  # noqa: E402
from loongforge.recipe import Recipe, load_recipe  # noqa: E402

__all__ = [
    "LaunchConfig",
    "LoongForgeError",
    "Recipe",
    "RecipeError",
    "build_job",
    "load_recipe",
    "run_in_process",
    "train",
]
