"""Bounds of a recipe: file size, nesting depth and the number of values once YAML aliases are expanded.

NOTE: a recipe is small. Without bounds a hostile or broken one exhausts the process: a "billion laughs" alias
bomb (``a: &a [x, x, ...]``, ``b: &b [*a, *a, ...]``) loads as shared references in microseconds but expands
when dumped (``validate --show``, the run's ``recipe.yaml``) until memory runs out, and a few thousand nested
brackets overflow PyYAML's recursive composer (``RecursionError``). Depth is checked on the event stream, which
PyYAML parses without recursion, before the document is composed.
"""

from __future__ import annotations

from typing import Any

import yaml

from loongforge.errors import RecipeError

MAX_BYTES = 8 * 2**20  # a recipe file (the shipped ones are a few KiB)
MAX_DEPTH = 64  # nested mappings / lists
MAX_VALUES = 1_000_000  # scalars, mappings and lists, every alias counted where it is used


def check_yaml_depth(text: str, *, file: str | None, what: str = "recipe") -> None:
    """Refuse ``text`` whose mappings / lists nest deeper than ``MAX_DEPTH`` (one line naming where)."""
    depth = 0
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_DEPTH:
                    mark = event.start_mark
                    raise RecipeError(f"{what} nests deeper than {MAX_DEPTH} levels at line {mark.line + 1}, column "
                                      f"{mark.column + 1}; a recipe is a few levels of sections and keys", file=file)
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
    except yaml.YAMLError:
        return  # NOTE: the loader reports the syntax error with its line


def check_size(data: Any, *, file: str | None) -> None:
    """Refuse a loaded recipe that nests deeper than ``MAX_DEPTH`` or holds more than ``MAX_VALUES`` values once
    its aliases are expanded. Iterative, and stops at the first bound crossed (its cost is bounded too)."""
    count = 0
    stack: list[tuple[Any, int, str]] = [(data, 0, "")]
    while stack:
        node, depth, key = stack.pop()
        count += 1
        if count > MAX_VALUES:
            raise RecipeError(f"expands to more than {MAX_VALUES:,} values (YAML aliases repeated inside each other?)",
                              key=key or None, file=file)
        if depth > MAX_DEPTH:
            raise RecipeError(f"nests deeper than {MAX_DEPTH} levels", key=key or None, file=file)
        if isinstance(node, dict):
            stack.extend((v, depth + 1, f"{key}.{k}" if key else str(k)) for k, v in node.items())
        elif isinstance(node, list | tuple):
            stack.extend((v, depth + 1, key) for v in node)
