"""What a hybrid LM recipe cannot train is refused at validate with one line naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest
from loongforge.cli import main

RECIPES = Path(__file__).parents[4] / "recipes" / "llm" / "tiny"


@pytest.mark.parametrize("override, words", [
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


@pytest.mark.parametrize("family, preset, cls", [("qwen3_next", "qwen3-next-tiny", "Qwen3NextConfig"),
                                                 ("qwen3_5", "qwen3.5-tiny", "Qwen3_5TextConfig"),
                                                 ("qwen3_5_moe", "qwen3.5-moe-tiny", "Qwen3_5MoeTextConfig")])
def test_exported_config_reads_back(tmp_path, family, preset, cls):
    """A preset's HF export config is what transformers reads (pattern, DeltaNet heads, partial RoPE, experts),
    and reads back into the same architecture."""
    import transformers
    from loongforge_megatron.models.registry import all_specs

    spec = all_specs()[family]
    arch = spec.arch(dict(spec.presets[preset]))
    cfg = spec.hf_config(arch, torch_dtype="float32")
    getattr(transformers, cls)(**cfg).to_json_file(tmp_path / "config.json")
    hf = getattr(transformers, cls).from_pretrained(tmp_path)
    assert hf.layer_types == arch.layers and hf.linear_num_value_heads == arch.linear_num_value_heads
    assert hf.rope_parameters["partial_rotary_factor"] == arch.rotary_percent
    import json

    back = spec.arch_from_hf(json.loads((tmp_path / "config.json").read_text()), path=tmp_path)
    keep = {"family", "full_attention_interval", "layer_types", "init_std"}
    assert back.model_dump(exclude=keep) == arch.model_dump(exclude=keep)
    assert back.layers == arch.layers
