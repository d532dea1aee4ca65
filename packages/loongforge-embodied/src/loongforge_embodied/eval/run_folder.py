"""What ``serve`` / ``eval`` read from a run folder's ``recipe.yaml``: the data section's environment, dataset,
recorded seed and task, read through the core's bounded recipe reader and checked for type.

NOTE: the saved recipe is read as plain data, not validated as a recipe again: a run folder from an older
version still serves. Bounds (size, nesting, YAML aliases) and types of the keys read here are checked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

KEYS = {"root": str, "task": str, "record.env": str, "record.seed": int}


def run_data(path: str | Path) -> dict[str, Any]:
    """``data.root``, ``data.task``, ``data.record.env``, ``data.record.seed`` of ``path/recipe.yaml`` (absent
    keys and an absent file: nothing), under those dotted names; a malformed file is a one-line RecipeError."""
    from loongforge.errors import RecipeError
    from loongforge.recipe import limits
    from loongforge.recipe.loader import read_yaml

    file = Path(path) / "recipe.yaml"
    if not file.exists():
        return {}
    recipe = read_yaml(file)
    limits.check_size(recipe, file=str(file))
    out: dict[str, Any] = {}
    for dotted, kind in KEYS.items():
        node: Any = recipe.get("data")
        parts = dotted.split(".")
        for i, part in enumerate(parts):
            if node is None:
                break
            if not isinstance(node, dict):
                raise RecipeError(f"must be a mapping (got {type(node).__name__})",
                                  key=".".join(["data", *parts[:i]]), file=str(file))
            node = node.get(part)
        if node is None:
            continue
        if type(node) is not kind:
            raise RecipeError(f"must be {'an integer' if kind is int else 'a string'} (got {type(node).__name__})",
                              key=f"data.{dotted}", file=str(file))
        out[dotted] = node
    return out
