"""LoongForge core: recipes, registries, accelerator API, parallel plan, launcher and CLI.

The public API::

    loongforge.load_recipe(path, overrides)  -> Recipe
    loongforge.train(recipe_or_path, output_dir=..., launch_config=...)
    loongforge.build_job(recipe, output_dir=...) -> (Job, Runtime)

NOTE: names resolve lazily (PEP 562) so that ``import loongforge.errors`` — used by kernel and plugin packages —
does not pull in pydantic, yaml or torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "build_job": "loongforge.api",
    "run_in_process": "loongforge.api",
    "train": "loongforge.api",
    "LaunchConfig": "loongforge.launcher",
    "LoongForgeError": "loongforge.errors",
    "RecipeError": "loongforge.errors",
    "Recipe": "loongforge.recipe",
    "load_recipe": "loongforge.recipe",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'loongforge' has no attribute {name!r}")
