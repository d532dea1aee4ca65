"""What a hybrid LM recipe cannot train is refused at validate with one line naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest
from loongforge.cli import main

RECIPES = Path(__file__).parents[4] / "recipes" / "llm" / "tiny"


@pytest.mark.parametrize("override, words", [
    ("parallel.cp=2", "key 'parallel.cp'"),
    ("parallel.tp=4 model.num_query_groups=4", "linear_num_key_heads 2 does not split over parallel.tp 4"),
    ("model.linear_num_value_heads=3", "must be a multiple of linear_num_key_heads"),
    ("model.layer_types=[full_attention]", "layer_types has 1 entries for 4 layers"),
])
def test_validate_refuses(override, words, capsys):
    argv = ["validate", str(RECIPES / "qwen3.5_tiny.yaml"), "accelerator=cpu", *override.split()]
    if "parallel" in override:
        argv.append("parallel.dp=1")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and words in err, err
