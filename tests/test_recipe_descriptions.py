"""A shipped recipe whose description names its GPU count launches that many processes by default
(``loongforge train`` starts ``parallel.min_world_size()``: tp*pp*cp*dp, dp 1 when unset)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from loongforge.cli import main
from loongforge.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1] / "recipes"
RECIPES = sorted(p for p in ROOT.rglob("*.yaml") if not p.name.startswith("_"))
COUNT = re.compile(r"\b(\d+|one) GPUs?\b")


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_described_gpu_count_is_the_default_world_size(recipe, capsys):
    loaded = load_recipe(recipe)
    counts = {1 if n == "one" else int(n) for n in COUNT.findall(loaded.description)}
    if not counts:
        pytest.skip("the description names no GPU count")
    assert counts == {loaded.parallel.min_world_size()}, (loaded.description, loaded.parallel)
    assert main(["validate", str(recipe)]) == 0, capsys.readouterr().err
