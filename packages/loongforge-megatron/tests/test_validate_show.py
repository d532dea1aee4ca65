"""``loongforge validate --show`` prints the model's resolved architecture (the preset's / HF config's sizes with
the recipe's overrides), not null for every key the recipe left to the preset; what it prints validates back."""

from __future__ import annotations

from pathlib import Path

import loongforge
import pytest
import yaml
from loongforge.cli import main
from loongforge_megatron.config import arch_keys

RECIPES = Path(__file__).resolve().parents[3] / "recipes"


@pytest.mark.parametrize(("recipe", "over"), [
    ("llm/tiny/llama_tiny.yaml", []),
    ("llm/tiny/llama_tiny.yaml", ["model.num_layers=2", "model.num_query_groups=4"]),
    ("llm/tiny/qwen3_moe_tiny.yaml", []),
    ("llm/tiny/llama_tiny.yaml", ["model.preset=deepseek-v3-tiny"]),
    ("vlm/llava_tiny.yaml", []),
    ("diffusion/dit_tiny.yaml", []),
])
def test_show_prints_the_resolved_architecture(tmp_path, capsys, recipe, over):
    path = RECIPES / recipe
    assert main(["validate", str(path), *over, "--show"]) == 0, capsys.readouterr().err
    shown = yaml.safe_load(capsys.readouterr().out)
    model = shown["model"]
    want = loongforge.load_recipe(path, over).model.arch()
    is_dit = want.spec_name == "dit"
    assert model["family"] == want.family
    assert all(model.get(k) is not None for k in arch_keys() if k in model), model
    for key in ("num_layers", "hidden_size", "num_attention_heads"):
        assert model[key] == getattr(want, key), (key, model)
    if not is_dit:
        assert model["vocab_size"] == want.vocab_size and model["ffn_hidden_size"] == want.ffn_hidden_size
        assert ("moe_topk" in model) == want.is_moe and ("patch_size" not in model)
    # NOTE: what --show prints is a recipe: it validates and resolves to the same architecture
    again = tmp_path / "shown.yaml"
    again.write_text(yaml.safe_dump(shown, sort_keys=False))
    assert main(["validate", str(again)]) == 0, capsys.readouterr().err
    got = loongforge.load_recipe(again).model.arch()
    derived = {"num_query_groups", "head_dim"}  # NOTE: shown explicitly (kv heads = heads, head_dim = hidden / heads)
    assert got.model_dump(exclude=derived) == want.model_dump(exclude=derived)
    assert (got.kv_heads, got.head_dim if is_dit else got.kv_channels) == (
        want.kv_heads, want.head_dim if is_dit else want.kv_channels)


def test_show_of_an_hf_model(tmp_path, tiny_hf, capsys):
    """An HF directory's config.json fills the keys the same way."""
    hf = tiny_hf("qwen3", tmp_path / "q")
    assert main(["validate", str(RECIPES / "llm/tiny/llama_tiny.yaml"), "model.preset=null", f"model.hf={hf}",
                 "--show"]) == 0, capsys.readouterr().err
    model = yaml.safe_load(capsys.readouterr().out)["model"]
    assert model["family"] == "qwen3" and model["hf"] == str(hf) and model["qk_norm"] is True
    assert model["num_layers"] == 2 and model["head_dim"] == 16 and model["num_query_groups"] == 2
