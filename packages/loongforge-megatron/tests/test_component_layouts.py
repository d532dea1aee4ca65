"""Per-component layouts (``parallel.components.<name>``) the VLMs cannot run are refused by ``loongforge validate``,
before any process group: exit 2, one line naming the keys and what was asked (the arithmetic where there is some)."""

from __future__ import annotations

from pathlib import Path

import pytest

VLM = Path(__file__).resolve().parents[3] / "recipes" / "vlm"


@pytest.mark.parametrize(("recipe", "overrides", "needles"), [
    ("qwen2_5_vl_tiny", ["parallel.tp=2", "parallel.components.vision.tp=3"],
     ["key 'parallel.components.vision.tp'", "parallel.components.vision.tp = 3 must divide parallel.tp = 2",
      "2 % 3 = 2, 3 % 2 = 1"]),
    ("llava_tiny", ["parallel.tp=2", "parallel.components.vision.tp=3"],
     ["parallel.components.vision.tp = 3 must divide parallel.tp = 2"]),
    ("qwen2_5_vl_tiny", ["parallel.components.vision.tp=4"],
     ["parallel.components.vision: tp*pp*cp = 4*1*1 = 4 does not divide world size 2"]),
    ("qwen2_5_vl_tiny", ["parallel.components.vision.pp=2"],
     ["key 'parallel.components.vision.pp'", "parallel.components.vision.pp = 2 but parallel.pp = 1", "(got pp = 2)"]),
    ("qwen2_5_vl_tiny", ["parallel.components.vision.cp=2"],
     ["key 'parallel.components.vision.cp'", "parallel.components.vision.cp = 2 but parallel.cp = 1", "(got cp = 2)"]),
    ("qwen2_5_vl_tiny", ["parallel.components.vision.etp=2"],
     ["key 'parallel.components.vision.etp'", "has no experts (got etp = 2)"]),
    ("qwen2_5_vl_tiny", ["parallel.components.vision.recompute=some"],
     ["parallel.components.vision.recompute"]),
    ("qwen2_5_vl_tiny", ["parallel.components={vision: {num_ranks: 1}, language: {num_ranks: 1}}"],
     ["key 'parallel.components.", "num_ranks"]),
    ("qwen2_5_vl_tiny", ["parallel.components={vision: {num_ranks: 1}, language: {num_ranks: 2}}"],
     ["parallel.components num_ranks vision=1 + language=2 = 3 != world size 2"]),
    ("qwen2_5_vl_tiny", ["parallel.components={vision: {num_ranks: 1}, language: {tp: 2}}"],
     ["either every component sets num_ranks or none does (missing on ['language'])"]),
    ("qwen3_vl_moe_tiny", ["parallel.components.vision.ep=2"],
     ["key 'parallel.components.vision.ep'", "parallel.components.vision.ep = 2 but parallel.ep = 1"]),
    ("qwen2_5_vl_tiny", ["parallel.components.audio.tp=1"], ["key 'parallel.components.audio'"]),
    ("llava_tiny", ["parallel.components.vision.pp=2"], ["key 'parallel.components.vision.pp'", "got pp"]),
    ("llava_tiny", ["parallel.components.vision.cp=2"], ["key 'parallel.components.vision.cp'", "got cp"]),
    ("llava_tiny", ["parallel.components={vision: {num_ranks: 1}, language: {num_ranks: 1}}"],
     ["key 'parallel.components."]),
    ("llava_tiny", ["parallel.tp=2", "parallel.components.vision.tp=2", "parallel.components.vision.sp=true"],
     ["key 'parallel.components.vision.sp'"]),
    ("qwen2_5_vl_tiny", ["parallel.components.vision.decoupled=true"],
     ["key 'parallel.components.vision.decoupled'",
      "decoupled = true needs pipeline parallelism (parallel.pp > 1, got parallel.pp = 1)"]),
    ("llava_tiny", ["parallel.components.vision.decoupled=true"], ["key 'parallel.components.vision.decoupled'"]),
])
def test_impossible_component_layouts_are_refused_at_validate(capsys, recipe, overrides, needles):
    from loongforge.cli import main

    assert main(["validate", str(VLM / f"{recipe}.yaml"), *overrides, "--world-size", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, err
