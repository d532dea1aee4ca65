"""``train.freeze`` refuses, before any step, an entry that matches no parameter and a freeze of everything."""

from __future__ import annotations

import pytest
import torch
from loongforge.errors import RecipeError
from loongforge_megatron.freeze import check_freeze, freeze

GROUPS = {"vision": ("vision.",), "language": ("decoder.",)}


def _chunk() -> torch.nn.Module:
    m = torch.nn.Module()
    m.vision, m.decoder = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    return m


def test_entry_matching_nothing_is_refused_naming_it():
    with pytest.raises(RecipeError, match=r"train.freeze \['decoder.layers.9.\*'\] match\(es\) no parameter"):
        freeze([_chunk()], ["vision", "decoder.layers.9.*"], groups=GROUPS)
    chunk = _chunk()
    assert freeze([chunk], ["vision", "decoder.b*"], groups=GROUPS) == 3
    assert [n for n, p in chunk.named_parameters() if p.requires_grad] == ["decoder.weight"]


@pytest.mark.parametrize("entries", [["vision", "language"], ["*"], ["**"]])
def test_freezing_everything_is_refused_at_validate(entries):
    with pytest.raises(RecipeError, match="freezes the whole model"):
        check_freeze(entries, groups=GROUPS, stage="sft")
    check_freeze(entries, groups=GROUPS, stage="lora")  # NOTE: the adapters train


def test_unknown_group_is_refused_at_validate():
    with pytest.raises(RecipeError, match="'projector' is not a module group"):
        check_freeze(["projector"], groups=GROUPS, stage="sft")
    check_freeze(["vision"], groups=GROUPS, stage="sft")


def test_pattern_outside_the_models_modules_is_refused_at_validate():
    names = ["embedding.word_embeddings.weight", "decoder.layers.0.mlp.linear_fc1.weight", "output_layer.weight"]
    for entry in ("decoder.layers.1.*", "vision.*", "decoder.layers.0.mlp.experts.*"):
        with pytest.raises(RecipeError, match="matches no parameter of this model"):
            check_freeze([entry], groups={}, stage="sft", names=names)
    # NOTE: only the module path is checked: a leaf the name map spells otherwise is left to the build
    for entry in ("decoder.layers.0.*", "decoder.layers.0.mlp.weight?", "decoder.layers.1*", "embedding.*"):
        check_freeze([entry], groups={}, stage="sft", names=names)
