"""Our names and shard shapes must be megatron-core's own: build real tiny GPTModels (local spec, TP=1, CPU)
in a subprocess and compare. The name lists are written out so an upgrade that renames anything fails loudly.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from loongforge.errors import CheckpointError
from loongforge_megatron.conversion import shard_state_dict_for_rank

PROBE = Path(__file__).with_name("_megatron_probe.py")
ATTN = "decoder.layers.*.self_attention."
COMMON = {"embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight",
          "decoder.layers.*.input_layernorm.weight", "decoder.layers.*.pre_mlp_layernorm.weight",
          ATTN + "linear_proj.weight"}
DENSE = {"decoder.layers.*.mlp.linear_fc1.weight", "decoder.layers.*.mlp.linear_fc2.weight"}
ROUTED = {"decoder.layers.*.mlp.router.weight",
          "decoder.layers.*.mlp.experts.local_experts.*.linear_fc1.weight",
          "decoder.layers.*.mlp.experts.local_experts.*.linear_fc2.weight"}
GQA = {ATTN + "linear_qkv.weight"}
QK_NORM = {ATTN + "q_layernorm.weight", ATTN + "k_layernorm.weight"}
MLA = {ATTN + n for n in ("linear_q_down_proj.weight", "q_layernorm.weight", "linear_q_up_proj.weight",
                          "linear_kv_down_proj.weight", "kv_layernorm.weight", "linear_kv_up_proj.weight")}
# megatron-core 0.19.2, get_gpt_layer_local_spec / get_gpt_decoder_block_spec(use_transformer_engine=False)
NAMES = {
    "llama": COMMON | GQA | DENSE,
    "llama_tied": (COMMON - {"output_layer.weight"}) | GQA | DENSE,
    "qwen2": COMMON | GQA | DENSE | {ATTN + "linear_qkv.bias"},
    "qwen3": COMMON | GQA | QK_NORM | DENSE,
    "qwen3_moe": COMMON | GQA | QK_NORM | ROUTED,
    "deepseek_v3": COMMON | MLA | DENSE | ROUTED | {
        "decoder.layers.*.mlp.router.expert_bias",
        "decoder.layers.*.mlp.shared_experts.linear_fc1.weight",
        "decoder.layers.*.mlp.shared_experts.linear_fc2.weight"},
}
FAMILY = {"llama_tied": "llama"}


def template(name: str) -> str:
    return re.sub(r"local_experts\.\d+\.", "local_experts.*.", re.sub(r"layers\.\d+\.", "layers.*.", name))


@pytest.fixture(scope="module")
def megatron_shapes(tiny_hf, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("probe")
    configs = {n: (FAMILY.get(n, n), json.loads((tiny_hf(n) / "config.json").read_text())) for n in NAMES}
    (tmp / "in.json").write_text(json.dumps(configs))
    proc = subprocess.run([sys.executable, str(PROBE), str(tmp / "in.json"), str(tmp / "out.json")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {n: {k: tuple(v) for k, v in d.items()} for n, d in json.loads((tmp / "out.json").read_text()).items()}


@pytest.mark.parametrize("name", sorted(NAMES))
def test_megatron_names_are_pinned(megatron_shapes, name):
    assert {template(k) for k in megatron_shapes[name]} == NAMES[name]


@pytest.mark.parametrize("name", sorted(NAMES))
def test_tp1_shard_matches_megatron_model(megatron_shapes, tiny_hf, name):
    sd = shard_state_dict_for_rank(tiny_hf(name), tp_rank=0, tp_size=1, family=FAMILY.get(name, name),
                                   expected_shapes=megatron_shapes[name])
    assert set(sd) == set(megatron_shapes[name])


def _tp_dim(name: str) -> int | None:
    """Megatron's partition dim for a parameter (None: replicated), from the layer types of the local spec."""
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "word_embeddings.weight",
                      "output_layer.weight", "_proj.weight")):
        return 0
    return None


@pytest.mark.parametrize("name", sorted(NAMES))
def test_tp2_shard_shapes_follow_megatron_partitioning(megatron_shapes, tiny_hf, name):
    for rank in (0, 1):
        sd = shard_state_dict_for_rank(tiny_hf(name), tp_rank=rank, tp_size=2, family=FAMILY.get(name, name))
        for k, full in megatron_shapes[name].items():
            dim = _tp_dim(k)
            want = list(full)
            if "word_embeddings" in k or "output_layer" in k:
                want[0] = 256 // 2  # vocab 100 padded to a multiple of 128 * tp
            elif dim is not None:
                want[dim] //= 2
            assert tuple(sd[k].shape) == tuple(want), k


def test_shape_check_names_the_tensor(megatron_shapes, tiny_hf):
    # loading a Qwen3 checkpoint into a Llama-shaped megatron model (qwen3 family, no q/k norm expected)
    expected = dict(megatron_shapes["qwen3"])
    expected.pop("decoder.layers.0.self_attention.k_layernorm.weight")
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'decoder\.layers\.0\.self_attention\.k_layernorm"):
        shard_state_dict_for_rank(tiny_hf("qwen3"), tp_rank=0, tp_size=1, expected_shapes=expected)
    expected = dict(megatron_shapes["llama"])
    expected["decoder.layers.1.mlp.linear_fc2.weight"] = (32, 128)
    with pytest.raises(CheckpointError, match=r"tensor 'decoder\.layers\.1\.mlp\.linear_fc2\.weight' has shape"):
        shard_state_dict_for_rank(tiny_hf("llama"), tp_rank=0, tp_size=1, expected_shapes=expected)
