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
    ("qwen2_5_vl_tiny", ["parallel.components={vision: {num_ranks: 1}, language: {num_ranks: 2}}"],
     ["parallel.components num_ranks vision=1 + language=2 = 3 != world size 2"]),
    ("qwen2_5_vl_tiny", ["parallel.components={vision: {num_ranks: 1}, language: {tp: 2}}"],
     ["either every component sets num_ranks or none does (missing on ['language'])"]),
    ("qwen3_vl_moe_tiny", ["parallel.components.vision.ep=2"],
     ["key 'parallel.components.vision.ep'", "parallel.components.vision.ep = 2 but parallel.ep = 1"]),
    ("qwen2_5_vl_tiny", ["parallel.components.audio.tp=1"], ["key 'parallel.components.audio'"]),
    ("llava_tiny", ["parallel.components.vision.pp=2"], ["key 'parallel.components.vision.pp'", "got pp"]),
    ("llava_tiny", ["parallel.components.vision.cp=2"], ["key 'parallel.components.vision.cp'", "got cp"]),
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


OWN_RANKS = "parallel.components={vision: {num_ranks: 1}, language: {num_ranks: 2}}"


@pytest.mark.parametrize(("over", "needles"), [
    (["parallel.components={vision: {num_ranks: 1, pp: 1, tp: 1, decoupled: true}, language: {num_ranks: 2}}"],
     ["key 'parallel.components.vision.decoupled'", "num_ranks = 1"]),
    (["parallel.components={vision: {num_ranks: 2, tp: 2}, language: {num_ranks: 1}}"],
     ["key 'parallel.components.vision.tp'", "vision.tp = 2 with parallel.components.vision.num_ranks = 2"]),
    (["parallel.components={vision: {num_ranks: 2}, language: {num_ranks: 1}}"],
     ["key 'parallel.components.vision.num_ranks'",
      "num_ranks = 2 > the language model's data-parallel size 1 (parallel.components.language.num_ranks 1 / tp 1)"]),
    (["parallel.components={vision: {num_ranks: 1}, language: {num_ranks: 2, pp: 2}}"],
     ["key 'parallel.components.language.pp'", "language.pp = 2 with parallel.components.vision.num_ranks = 1"]),
    (["parallel.components={vision: {num_ranks: 1}, llm: {num_ranks: 2}}"],
     ["key 'parallel.components.llm'", "'vision'", "'language'"]),
    ([OWN_RANKS, "train.stage=lora"], ["key 'train.stage'", "num_ranks = 1"]),
])
def test_encoder_ranks_layouts_refused_at_validate(capsys, over, needles):
    """An encoder on ranks of its own (num_ranks) that cannot run: one line naming the keys and the arithmetic."""
    from loongforge.cli import main

    assert main(["validate", str(VLM / "qwen2_5_vl_tiny.yaml"), *over, "--world-size", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, err


def test_encoder_ranks_validate(capsys):
    """Qwen2.5-VL's / LLaVA's tower on one rank, the language model on two (dp 2, or tp 2): layouts validate
    accepts."""
    from loongforge.cli import main

    tp2 = "parallel.components={vision: {num_ranks: 1}, language: {num_ranks: 2, tp: 2}}"
    for recipe in ("qwen2_5_vl_tiny", "llava_tiny"):
        for layout in (OWN_RANKS, tp2):
            assert main(["validate", str(VLM / f"{recipe}.yaml"), layout, "--world-size", "3"]) == 0, \
                capsys.readouterr().err


@pytest.mark.parametrize("recipe", ["qwen3_vl_tiny", "qwen3_vl_moe_tiny", "qwen3_5_vl_tiny"])
def test_encoder_ranks_of_other_families_refused_at_validate(capsys, recipe):
    """Only Qwen2.5-VL and LLaVA run their encoder on ranks of their own."""
    from loongforge.cli import main

    path = VLM / f"{recipe}.yaml"
    assert main(["validate", str(path), OWN_RANKS, "--world-size", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "key 'parallel.components.vision.num_ranks'" in err, err
    assert f"{recipe.removesuffix('_tiny')} runs its vision component" in err and "not done for it" in err, err
