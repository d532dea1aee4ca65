"""config.json against the weights: every family's config that disagrees with its safetensors headers is refused
(online load, model.hf, convert) with one line naming the file, the key, its value and the tensor's shape; a
generated set of malformed configs and layout files gives one-line errors (exit 2), never a traceback."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from loongforge.cli import main
from loongforge.errors import CheckpointError, RecipeError

ids = {"image_token_id": 300, "video_token_id": 301, "vision_start_token_id": 302, "vision_end_token_id": 303}
_TEXT = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None,
             eos_token_id=None)
_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=64, patch_size=4,
               spatial_merge_size=2, temporal_patch_size=2)


def _vlm(kind: str):
    """(config, model class) of a tiny VLM of ``kind`` (built by transformers)."""
    import transformers as tf

    if kind == "qwen2_5_vl":
        cfg = tf.Qwen2_5_VLConfig(
            text_config=dict(_TEXT, num_hidden_layers=2, rope_parameters={
                "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
            vision_config=dict(_VISION, window_size=16, fullatt_block_indexes=[1]), tie_word_embeddings=False, **ids)
        return cfg, tf.Qwen2_5_VLForConditionalGeneration
    if kind in ("qwen3_vl", "qwen3_vl_moe"):
        moe = kind.endswith("moe")
        prefix = "Qwen3VLMoe" if moe else "Qwen3VL"
        experts = dict(moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2) if moe else {}
        cfg = getattr(tf, prefix + "Config")(
            text_config=dict(_TEXT, num_hidden_layers=2, head_dim=16, rope_parameters={
                "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], "mrope_interleaved": True},
                **experts),
            vision_config=dict(_VISION, num_position_embeddings=16, deepstack_visual_indexes=[0]),
            tie_word_embeddings=False, **ids)
        return cfg, getattr(tf, prefix + "ForConditionalGeneration")
    assert kind == "llava"
    vision = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                                 image_size=32, patch_size=8, hidden_act="quick_gelu")
    text = tf.LlamaConfig(**{**_TEXT, "vocab_size": 256, "num_hidden_layers": 2})
    cfg = tf.LlavaConfig(vision_config=vision, text_config=text, image_token_index=255, projector_hidden_act="gelu",
                         vision_feature_layer=-2, vision_feature_select_strategy="default", image_seq_length=16,
                         tie_word_embeddings=False)
    return cfg, tf.LlavaForConditionalGeneration


VLMS = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "llava")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_hf):
    """family -> a tiny transformers-saved checkpoint (the LLMs: conftest's ``tiny_hf``)."""
    root = tmp_path_factory.mktemp("cfgcheck")
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            if name == "dit":
                from diffusers import DiTTransformer2DModel

                torch.manual_seed(0)
                DiTTransformer2DModel(num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=8,
                                      num_layers=2, sample_size=8, patch_size=2,
                                      num_embeds_ada_norm=10).save_pretrained(root / name)
                cache[name] = root / name
            elif name in VLMS:
                cfg, cls = _vlm(name)
                torch.manual_seed(0)
                cls(cfg).save_pretrained(root / name)
                cache[name] = root / name
            else:
                cache[name] = tiny_hf(name)
        return cache[name]

    return get


def lying(src: Path, dst: Path, change) -> Path:
    """``src``'s weights (linked) with its config.json changed by ``change(cfg)``."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f.resolve())
    cfg = json.loads((src / "config.json").read_text())
    out = change(cfg)
    (dst / "config.json").write_text(out if isinstance(out, str) else json.dumps(cfg if out is None else out))
    return dst


def setter(path: str, value):
    def change(cfg):
        node, *keys = cfg, *path.split(".")
        for k in keys[:-1]:
            node = node[k]
        if value is _DELETE:
            node.pop(keys[-1], None)
        else:
            node[keys[-1]] = value
    return change


_DELETE = object()

# family, config key, a value that disagrees with the weights, what the error must name
DISAGREE = [
    ("llama", "hidden_size", 48, "hidden_size 48"),
    ("qwen2", "num_key_value_heads", 4, "num_key_value_heads 4"),
    ("qwen3", "head_dim", 8, "head_dim 8"),
    ("qwen3_moe", "moe_intermediate_size", 24, "moe_intermediate_size 24"),
    ("deepseek_v3", "qk_nope_head_dim", 16, "qk_nope_head_dim 16"),
    ("kimi_k2", "hidden_size", 128, "hidden_size 128"),
    ("kimi_k2", "kv_lora_rank", 32, "kv_lora_rank 32"),
    ("kimi_k2", "moe_intermediate_size", 32, "moe_intermediate_size 32"),
    ("kimi_k2", "qk_rope_head_dim", 16, "qk_rope_head_dim 16"),
    ("glm4_moe", "partial_rotary_factor", 0.3, "partial_rotary_factor"),
    ("qwen2_5_vl", "vision_config.hidden_size", 48, "vision_config.hidden_size 48"),
    ("qwen2_5_vl", "vision_config.intermediate_size", 96, "vision_config.intermediate_size 96"),
    ("qwen2_5_vl", "text_config.rope_parameters.mrope_section", _DELETE, "mrope_section"),
    ("qwen2_5_vl", "image_token_id", 10**9, "image_token_id"),
    ("qwen3_vl", "vision_config.num_position_embeddings", 25, "vision_config.num_position_embeddings 25"),
    ("qwen3_vl_moe", "text_config.moe_intermediate_size", 32, "text_config.moe_intermediate_size 32"),
    ("llava", "vision_config.intermediate_size", 96, "vision_config.intermediate_size 96"),
    ("llava", "text_config.hidden_size", 96, "text_config.hidden_size 96"),
    ("dit", "attention_head_dim", 8, "attention_head_dim 8"),
    ("dit", "num_embeds_ada_norm", 20, "num_embeds_ada_norm 20"),
    ("dit", "out_channels", 4, "out_channels 4"),
]


@pytest.mark.parametrize("family,key,value,named", DISAGREE, ids=[f"{f}-{k}" for f, k, _, _ in DISAGREE])
def test_a_config_that_disagrees_with_the_weights_is_refused_at_load_and_in_convert(
        tmp_path, checkpoints, capsys, family, key, value, named):
    from loongforge_megatron.conversion import shard_state_dict_for_rank
    from loongforge_megatron.models.hf_arch import arch_from_hf

    bad = lying(checkpoints(family), tmp_path / "bad", setter(key, value))
    # online load (each rank's shards) and model.hf (the recipe's architecture): before anything is built
    with pytest.raises(CheckpointError, match="config.json") as load:
        shard_state_dict_for_rank(bad, tp_rank=0, tp_size=1)
    assert named in str(load.value) and "\n" not in str(load.value), load.value
    with pytest.raises(RecipeError) as arch:
        arch_from_hf(bad)
    assert named in str(arch.value), arch.value
    capsys.readouterr()
    assert main(["convert", str(bad), str(tmp_path / "mg"), "--to", "megatron"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and named in err, err
    assert not (tmp_path / "mg").exists()


def test_the_unchanged_checkpoints_pass(tmp_path, checkpoints):
    from loongforge_megatron.models.hf_arch import arch_from_hf

    for family in ("kimi_k2", "glm4_moe", *VLMS, "dit"):
        assert arch_from_hf(checkpoints(family)) is not None


def test_a_mismatch_names_key_value_and_shape(tmp_path, checkpoints):
    from loongforge_megatron.conversion import hf_to_megatron

    bad = lying(checkpoints("kimi_k2"), tmp_path / "bad", setter("kv_lora_rank", 32))
    with pytest.raises(CheckpointError) as e:
        hf_to_megatron(bad, tmp_path / "mg")
    assert str(e.value) == (f"{bad / 'config.json'} does not match the weights: tensor "
                            "'model.layers.0.self_attn.kv_a_layernorm.weight' has shape (16,) but the config "
                            "(kv_lora_rank 32) gives (32,)")


def test_integer_weights_are_refused_at_load(tmp_path, checkpoints, capsys):
    from loongforge_megatron.conversion import shard_state_dict_for_rank
    from safetensors.torch import load_file, save_file

    src = checkpoints("llama")
    bad = tmp_path / "i32"
    shutil.copytree(src, bad)
    tensors = load_file(bad / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"].to(torch.int32)
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"tensor 'model\.layers\.1\.mlp\.up_proj\.weight' is stored as int32"):
        shard_state_dict_for_rank(bad, tp_rank=0, tp_size=1)
    capsys.readouterr()
    assert main(["convert", str(bad), str(tmp_path / "mg"), "--to", "megatron"]) == 2
    assert "is stored as int32" in capsys.readouterr().err


def test_an_export_never_writes_a_config_that_disagrees_with_its_tensors(tmp_path, checkpoints):
    from loongforge_megatron.conversion import hf_to_megatron, megatron_to_hf

    hf_to_megatron(checkpoints("kimi_k2"), tmp_path / "mg")
    assets = tmp_path / "mg" / "hf_assets" / "config.json"
    cfg = json.loads(assets.read_text())
    assets.write_text(json.dumps({**cfg, "hidden_size": 128}))
    with pytest.raises(CheckpointError, match=r"the exported config.json does not match the weights: tensor "
                                              r"'lm_head.weight' has shape \(100, 32\) but the config "
                                              r"\(vocab_size 100, hidden_size 128\) gives \(100, 128\); nothing"):
        megatron_to_hf(tmp_path / "mg", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    assets.write_text(json.dumps(cfg))
    out = megatron_to_hf(tmp_path / "mg", tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["hidden_size"] == 32


# ---------------------------------------------------------------- generated malformed configs / layout files
def _int_keys(cfg: dict, prefix: str = "") -> list[str]:
    """Size keys whose change must be refused: integer values the name maps read (per family below)."""
    return [prefix + k for k, v in cfg.items() if k in _SIZE_KEYS and isinstance(v, int) and not isinstance(v, bool)]


_SIZE_KEYS = {"hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
              "num_hidden_layers", "moe_intermediate_size", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
              "qk_nope_head_dim", "v_head_dim", "n_routed_experts", "num_experts", "head_dim", "depth",
              "out_hidden_size", "patch_size", "spatial_merge_size", "temporal_patch_size", "attention_head_dim",
              "num_embeds_ada_norm", "in_channels", "out_channels", "num_layers"}
_BAD_VALUES = [lambda v: v + 1, lambda v: 0, lambda v: -3, lambda v: 2**20, lambda v: 10**9, lambda v: str(v),
               lambda v: [v], lambda v: True]
_STRUCTURAL = {
    "json-list": lambda cfg: "[1, 2, 3]",
    "json-string": lambda cfg: '"llama"',
    "empty": lambda cfg: "",
    "truncated": lambda cfg: json.dumps(cfg)[:-7],
    "deep-100k": lambda cfg: "[" * 100_000 + "]" * 100_000,
    "deep-object": lambda cfg: '{"a":' * 100_000 + "1" + "}" * 100_000,
    "model-type-list": lambda cfg: {**cfg, "model_type": ["llama"]},
    "model-type-unknown": lambda cfg: {**cfg, "model_type": "gpt2"},
    "layers-minus-one": lambda cfg: _text_layers(cfg, -1),
    "layers-plus-one": lambda cfg: _text_layers(cfg, +1),
    "nested-deep": lambda cfg: {**cfg, "quantization": json.loads('{"a":' * 40 + "1" + "}" * 40)},
    "size-float": lambda cfg: _text(cfg, "hidden_size" if "num_layers" not in cfg else "attention_head_dim", 64.5),
}


def _text(cfg: dict, key: str, value) -> dict:
    """``cfg`` with its language model's ``key`` set (a VLM's is in text_config)."""
    if isinstance(cfg.get("text_config"), dict):
        return {**cfg, "text_config": {**cfg["text_config"], key: value}}
    return {**cfg, key: value}


def _text_layers(cfg: dict, delta: int) -> dict:
    t = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    key = "num_layers" if "num_layers" in t else "num_hidden_layers"  # NOTE: a diffusers DiT's
    return _text(cfg, key, t[key] + delta)


# NOTE: keys a family's model does not read (Qwen3-MoE's dense intermediate_size with every layer MoE; MLA's
# head_dim / num_key_value_heads): any value of theirs describes the same weights
_UNUSED = {("qwen3_moe", "intermediate_size"), ("kimi_k2", "head_dim"), ("kimi_k2", "num_key_value_heads")}
_FAMILIES = ("llama", "qwen3_moe", "kimi_k2", "qwen2_5_vl", "llava", "dit")


def _cases(cfg: dict, family: str) -> list[tuple[str, object]]:
    keys = [k for k in _int_keys(cfg) if (family, k) not in _UNUSED]
    for sub in ("text_config", "vision_config"):
        if isinstance(cfg.get(sub), dict):
            keys += _int_keys(cfg[sub], sub + ".")
    cases: list[tuple[str, object]] = []
    for i, key in enumerate(sorted(keys)):
        for j, bad in enumerate(_BAD_VALUES):
            if (i + j) % 3 == 0:  # NOTE: a spread of (key, value) pairs, not every product: the suite stays fast
                node = cfg
                for k in key.split(".")[:-1]:
                    node = node[k]
                cases.append((f"{family}:{key}={bad(node[key.split('.')[-1]])!r:.20}", setter(key, bad(node[key.split(".")[-1]]))))
    cases += [(f"{family}:{name}", make) for name, make in _STRUCTURAL.items()]
    if family in ("qwen2_5_vl", "llava"):
        cases += [(f"{family}:vision_config-string", setter("vision_config", "clip")),
                  (f"{family}:text_config-list", setter("text_config", [1]))]
    return cases


def test_generated_malformed_configs_are_one_line_errors(tmp_path, checkpoints, capsys):
    failures, total = [], 0
    for family in _FAMILIES:
        src = checkpoints(family)
        cfg = json.loads((src / "config.json").read_text())
        for n, (name, change) in enumerate(_cases(cfg, family)):
            total += 1
            bad = lying(src, tmp_path / f"{family}-{n}", lambda c, change=change: change(c))
            capsys.readouterr()
            rc = main(["convert", str(bad), str(tmp_path / f"{family}-{n}-out"), "--to", "megatron"])
            err = capsys.readouterr().err
            if rc != 2 or not err.startswith("error: ") or err.count("\n") != 1 or "config.json" not in err:
                failures.append(f"{name}: rc {rc}: {err[:300]}")
    assert total >= 100 and not failures, f"{len(failures)} of {total}:\n" + "\n".join(failures)


_LAYOUT_CASES = {
    "json-list": lambda d: "[]",
    "deep": lambda d: "[" * 100_000 + "]" * 100_000,
    "truncated": lambda d: json.dumps(d)[:-3],
    "unknown-key": lambda d: {**d, "tensor_parallel": 2},
    "format": lambda d: {**d, "format": "megatron/9"},
    "family-unknown": lambda d: {**d, "family": "gpt9"},
    "family-int": lambda d: {**d, "family": 3},
    "tp-string": lambda d: {**d, "tp": "2"},
    "tp-zero": lambda d: {**d, "tp": 0},
    "tp-huge": lambda d: {**d, "tp": 10**9},
    "tp-two": lambda d: {**d, "tp": 2},
    "pp-two": lambda d: {**d, "pp": 2},
    "ep-float": lambda d: {**d, "ep": 1.5},
    "etp-three": lambda d: {**d, "etp": 3},
    "whole-int": lambda d: {**d, "whole": 3},
    "whole-pair-tp": lambda d: {**d, "whole": [["vision.", 3]]},
    "hf-config-list": lambda d: {**d, "hf_config": [1]},
    "hf-config-missing": lambda d: {k: v for k, v in d.items() if k != "hf_config"},
    "layers-plus-one": lambda d: {**d, "hf_config": {**d["hf_config"], "num_hidden_layers": 5}},
    "layers-huge": lambda d: {**d, "hf_config": {**d["hf_config"], "num_hidden_layers": 10**9}},
    "hidden-string": lambda d: {**d, "hf_config": {**d["hf_config"], "hidden_size": "32"}},
    "heads-missing": lambda d: {**d, "hf_config": {k: v for k, v in d["hf_config"].items()
                                                  if k != "num_attention_heads"}},
    "vocab-zero": lambda d: {**d, "hf_config": {**d["hf_config"], "vocab_size": 0}},
}


def test_tampered_layout_files_are_one_line_errors(tmp_path, checkpoints, capsys):
    from loongforge_megatron.conversion import hf_to_megatron

    mg = tmp_path / "mg"
    hf_to_megatron(checkpoints("llama"), mg)
    layout = json.loads((mg / "loongforge_layout.json").read_text())
    failures = []
    for name, change in _LAYOUT_CASES.items():
        out = change(layout)
        (mg / "loongforge_layout.json").write_text(out if isinstance(out, str) else json.dumps(out))
        capsys.readouterr()
        rc = main(["convert", str(mg), str(tmp_path / f"hf-{name}"), "--to", "hf"])
        err = capsys.readouterr().err
        if rc != 2 or not err.startswith("error: ") or err.count("\n") != 1:
            failures.append(f"{name}: rc {rc}: {err[:300]}")
    assert not failures, "\n".join(failures)


def test_validate_refuses_model_hf_and_checkpoint_load_that_disagree_with_their_weights(tmp_path, checkpoints,
                                                                                        capsys):
    recipe = Path(__file__).resolve().parents[4] / "recipes" / "llm" / "tiny" / "llama_tiny.yaml"
    bad = lying(checkpoints("llama"), tmp_path / "bad", setter("intermediate_size", 96))
    for args in ([f"model.hf={bad}", "model.preset=null", f"checkpoint.load={bad}"],
                 [f"checkpoint.load={bad}"]):
        capsys.readouterr()
        assert main(["validate", str(recipe), "data.format=synthetic", *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "intermediate_size 96" in err and "does not match the weights" in err, err


def test_a_config_json_that_is_no_regular_file_is_one_line(tmp_path, checkpoints, capsys):
    import os

    for kind in ("fifo", "directory"):
        bad = lying(checkpoints("llama"), tmp_path / kind, lambda c: "{}")
        (bad / "config.json").unlink()
        os.mkfifo(bad / "config.json") if kind == "fifo" else (bad / "config.json").mkdir()
        capsys.readouterr()
        assert main(["convert", str(bad), str(tmp_path / f"{kind}-out"), "--to", "megatron"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "config.json" in err, err
