"""Recipes: YAML files validated into typed configs."""

from loongforge.recipe.loader import (
    apply_overrides,
    dump_recipe,
    load_recipe,
    resolve_extends,
    validate_recipe,
)
from loongforge.recipe.schema import Recipe

__all__ = ["Recipe", "apply_overrides", "dump_recipe", "load_recipe", "resolve_extends", "validate_recipe"]
