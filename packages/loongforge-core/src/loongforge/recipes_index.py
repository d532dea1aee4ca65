"""Find the shipped recipes (``loongforge recipes``)."""

from __future__ import annotations

import os
from pathlib import Path


def recipes_root() -> Path | None:
    """``$LOONGFORGE_RECIPES``, else ``./recipes``, else the ``recipes/`` folder of a source checkout."""
    env = os.environ.get("LOONGFORGE_RECIPES")
    if env:
        return Path(env)
    if (Path.cwd() / "recipes").is_dir():
        return Path.cwd() / "recipes"
    for parent in Path(__file__).resolve().parents:
        if (parent / "recipes").is_dir() and (parent / "packages").is_dir():
            return parent / "recipes"
    return None


def list_recipes(root: Path | None = None) -> list[tuple[Path, str, str]]:
    """(path, backend, description) of every recipe under ``root``; unreadable files are reported as such."""
    root = root or recipes_root()
    if root is None or not root.is_dir():
        return []
    out = []
    for path in sorted(root.rglob("*.yaml")):
        if path.name.startswith("_"):
            continue  # shared bases, only meant to be extended
        try:
            from loongforge.recipe.loader import resolve_extends

            data = resolve_extends(path)
            desc = str(data.get("description", "")).strip().splitlines()[0] if data.get("description") else ""
            backend = str(data.get("backend", "(inherited)"))
        except Exception as exc:  # a broken recipe must not hide the others
            desc, backend = f"unreadable: {exc}".splitlines()[0], "?"
        out.append((path, backend, desc))
    return out
