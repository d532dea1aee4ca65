from __future__ import annotations

import json
import shutil

import pytest
import torch
from loongforge.checkpoint import SafetensorsReader
from loongforge.errors import CheckpointError
from loongforge_megatron.conversion import MegatronLayout, hf_to_megatron, megatron_to_hf, reshard

LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2), (2, 1, 2)]
FAMILIES = ["llama", "qwen3", "qwen3_moe", "deepseek_v3"]


def assert_same_hf(a_dir, b_dir):
    a, b = SafetensorsReader(a_dir), SafetensorsReader(b_dir)
    assert sorted(a.keys()) == sorted(b.keys())
    for k in a.keys():
        x, y = a.get(k), b.get(k)
        assert x.dtype == y.dtype and torch.equal(x, y), k


def read_all(root):
    layout = MegatronLayout.load(root)
    return {r: dict((k, SafetensorsReader(layout.rank_file(root, r)).get(k))
                    for k in SafetensorsReader(layout.rank_file(root, r)).keys()) for r in layout.ranks()}


# NOTE: every family at every layout, and the DeepSeek-V3-architecture presets (Kimi-K2) and GLM-4.5 at one
# tp / pp / ep layout
CASES = [(f, *layout) for f in FAMILIES for layout in LAYOUTS] + [("kimi_k2", 2, 2, 2), ("glm4_moe", 2, 2, 2)]


@pytest.mark.parametrize("family,tp,pp,ep", CASES)
def test_roundtrip_bit_exact(tiny_hf, tmp_path, family, tp, pp, ep):
    src = tiny_hf(family)
    layout = hf_to_megatron(src, tmp_path / "mg", tp=tp, pp=pp, ep=ep)
    assert layout.family == family
    for rank in layout.ranks():
        assert layout.rank_file(tmp_path / "mg", rank).is_file()
    megatron_to_hf(tmp_path / "mg", tmp_path / "hf")
    assert_same_hf(src, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    assert (tmp_path / "hf" / "tokenizer_config.json").is_file()
    assert not list(tmp_path.glob("*.tmp-*"))


@pytest.mark.parametrize("tp,pp,ep", [(2, 2, 2), (1, 1, 1)])
def test_roundtrip_mtp_bit_exact(tiny_hf, mtp_hf, tmp_path, tp, pp, ep):
    """A DeepSeek-V3 checkpoint with its multi-token-prediction layer (and the embedding / head copies it
    carries): on the last stage as megatron's mtp.layers.0, experts over EP, and back bit-exact."""
    src = tmp_path / "src"
    shutil.copytree(tiny_hf("deepseek_v3"), src)
    mtp_hf(src)
    layout = hf_to_megatron(src, tmp_path / "mg", tp=tp, pp=pp, ep=ep)
    assert layout.mtp_layers == 1
    shards = read_all(tmp_path / "mg")
    last = shards[(0, pp - 1, ep - 1, 0)]
    assert "mtp.layers.0.eh_proj.weight" in last
    assert f"mtp.layers.0.mtp_model_layer.mlp.experts.local_experts.{4 // ep - 1}.linear_fc1.weight" in last
    # the last stage's own embedding copy for the shifted tokens
    assert "embedding.word_embeddings.weight" in last
    megatron_to_hf(tmp_path / "mg", tmp_path / "hf")
    assert_same_hf(src, tmp_path / "hf")


@pytest.mark.parametrize("family,tp,pp,vpp", [("llama_tied", 2, 2, 1), ("llama_tied", 1, 1, 1),
                                              ("qwen2", 2, 2, 2), ("qwen3_moe", 1, 2, 2)])
def test_roundtrip_variants(tiny_hf, tmp_path, family, tp, pp, vpp):
    """Tied embeddings (Llama 3.2), Qwen2 q/k/v biases, virtual pipeline chunks."""
    src = tiny_hf(family)
    layout = hf_to_megatron(src, tmp_path / "mg", tp=tp, pp=pp, vpp=vpp, ep=1)
    shards = read_all(tmp_path / "mg")
    last = shards[(0, pp - 1, 0, vpp - 1)]
    if family == "llama_tied":
        # megatron keeps output_layer.weight on the last stage only when it differs from the first
        assert ("output_layer.weight" in last) == (pp > 1)
        if pp > 1:
            assert torch.equal(last["output_layer.weight"], shards[(0, 0, 0, 0)]["embedding.word_embeddings.weight"])
    if family == "qwen2":
        assert "decoder.layers.0.self_attention.linear_qkv.bias" in last
    if vpp > 1:
        # 4 layers, pp=2, vpp=2: stage 0 holds global layers 0 (chunk 0) and 2 (chunk 1), each as local 0
        assert {k.split(".")[2] for k in shards[(0, 0, 0, 1)] if k.startswith("decoder.layers")} == {"0"}
    megatron_to_hf(tmp_path / "mg", tmp_path / "hf")
    assert_same_hf(src, tmp_path / "hf")
    assert layout.padded_vocab_size == 128 * tp


@pytest.mark.parametrize("family,src_layout,dst_layout", [
    ("llama", (2, 2, 1), (1, 1, 1)),
    ("deepseek_v3", (2, 2, 1), (1, 1, 1)),
    ("qwen3_moe", (2, 1, 2), (1, 2, 1)),
])
def test_reshard_equals_direct_conversion(tiny_hf, tmp_path, family, src_layout, dst_layout):
    src = tiny_hf(family)
    (tp, pp, ep), (tp2, pp2, ep2) = src_layout, dst_layout
    hf_to_megatron(src, tmp_path / "a", tp=tp, pp=pp, ep=ep)
    reshard(tmp_path / "a", tmp_path / "b", tp=tp2, pp=pp2, ep=ep2)
    hf_to_megatron(src, tmp_path / "c", tp=tp2, pp=pp2, ep=ep2)
    b, c = read_all(tmp_path / "b"), read_all(tmp_path / "c")
    assert b.keys() == c.keys()
    for rank in b:
        assert b[rank].keys() == c[rank].keys()
        assert all(torch.equal(b[rank][k], c[rank][k]) for k in b[rank]), rank
    assert MegatronLayout.load(tmp_path / "b") == MegatronLayout.load(tmp_path / "c")


def test_hf_export_shards_with_index(tiny_hf, tmp_path):
    src = tiny_hf("llama")
    hf_to_megatron(src, tmp_path / "mg", tp=2)
    megatron_to_hf(tmp_path / "mg", tmp_path / "hf", max_shard_bytes=20_000)
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "hf").glob("model-*-of-*.safetensors"))) > 1
    assert_same_hf(src, tmp_path / "hf")


def test_refuses_to_overwrite(tiny_hf, tmp_path):
    src = tiny_hf("llama")
    hf_to_megatron(src, tmp_path / "mg")
    with pytest.raises(CheckpointError, match="not empty"):
        hf_to_megatron(src, tmp_path / "mg", tp=2)
    assert MegatronLayout.load(tmp_path / "mg").tp == 1
    hf_to_megatron(src, tmp_path / "mg", tp=2, force=True)
    assert MegatronLayout.load(tmp_path / "mg").tp == 2
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "x").write_text("x")
    with pytest.raises(CheckpointError, match="not empty"):
        megatron_to_hf(tmp_path / "mg", tmp_path / "hf")
    with pytest.raises(CheckpointError, match="not empty"):
        reshard(tmp_path / "mg", tmp_path / "hf")


def test_mismatched_architecture_names_the_tensor(tiny_hf, tmp_path):
    # a Qwen3 checkpoint declared as llama: q_norm/k_norm are unexpected
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.k_norm\.weight'"):
        hf_to_megatron(tiny_hf("qwen3"), tmp_path / "a", family="llama")
    # a Llama checkpoint declared as qwen3: q_norm missing
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.0\.self_attn\.k_norm\.weight'"):
        hf_to_megatron(tiny_hf("llama"), tmp_path / "b", family="qwen3")
    # config.json that disagrees with the weights: mis-shaped tensor named
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in tiny_hf("llama").iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((bad / "config.json").read_text())
    cfg["num_key_value_heads"] = 4
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json does not match the weights: tensor "
                                              r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \(16, 32\) "
                                              r"but the config \(.*num_key_value_heads 4.*\) gives \(32, 32\)"):
        hf_to_megatron(bad, tmp_path / "c")
    assert not (tmp_path / "c").exists() and not list(tmp_path.glob("*.tmp-*"))
    with pytest.raises(CheckpointError, match="model_type 'gpt2' is not supported"):
        cfg["model_type"] = "gpt2"
        (bad / "config.json").write_text(json.dumps(cfg))
        hf_to_megatron(bad, tmp_path / "d")


def test_bad_parallel_sizes(tiny_hf, tmp_path):
    with pytest.raises(CheckpointError, match="4 layers, not divisible by pp \\* vpp = 3 \\* 1 = 3; give first_stage_layers"
                       " / last_stage_layers \\(convert: --first-stage-layers / --last-stage-layers\\)"):
        hf_to_megatron(tiny_hf("llama"), tmp_path / "a", pp=3)
    with pytest.raises(CheckpointError, match="not divisible by ep=3"):
        hf_to_megatron(tiny_hf("qwen3_moe"), tmp_path / "b", ep=3)


@pytest.mark.parametrize("family,pp,vpp,first,last", [
    ("llama", 2, 1, 1, None),  # 1 + 3
    ("deepseek_v3", 3, 1, 1, 1),  # 1 + 2 + 1: the dense first layer alone on stage 0
    ("qwen3_moe", 2, 2, None, 2),  # 2 + 2 with vpp: chunks of 1 layer each
])
def test_uneven_pipeline_split_roundtrip(tiny_hf, tmp_path, family, pp, vpp, first, last):
    """first/last-stage layer counts (DeepSeek-V3's 61 layers need one): shards land where megatron builds them,
    the layout file records the split, online shards equal offline ones, and HF comes back bit-exact."""
    from loongforge.parallel.layers import chunk_layer_counts, layer_ranges
    from loongforge_megatron.conversion import shard_state_dict_for_rank

    src = tiny_hf(family)
    layout = hf_to_megatron(src, tmp_path / "mg", pp=pp, vpp=vpp, first_stage_layers=first, last_stage_layers=last)
    loaded = MegatronLayout.load(tmp_path / "mg")
    assert (loaded.first_stage_layers, loaded.last_stage_layers) == (first, last)
    shards = read_all(tmp_path / "mg")
    ranges = layer_ranges(chunk_layer_counts(4, pp=pp, vpp=vpp, first=first, last=last))
    for (tp, p, ep, v), sd in shards.items():
        local = {int(k.split(".")[2]) for k in sd if k.startswith("decoder.layers.")}
        assert local == set(range(len(ranges[(p, v)]))), (p, v, local)
        online = shard_state_dict_for_rank(src, tp_rank=tp, tp_size=1, pp_rank=p, pp_size=pp, ep_rank=ep,
                                           vpp_rank=v, vpp_size=vpp, first_stage_layers=first, last_stage_layers=last)
        assert online.keys() == sd.keys() and all(torch.equal(online[k], sd[k]) for k in sd)
    megatron_to_hf(tmp_path / "mg", tmp_path / "hf")
    assert_same_hf(src, tmp_path / "hf")
    reshard(tmp_path / "mg", tmp_path / "even", pp=2)  # uneven -> even
    megatron_to_hf(tmp_path / "even", tmp_path / "hf2")
    assert_same_hf(src, tmp_path / "hf2")
    assert layout == loaded


def test_uneven_split_bad_sizes_name_the_key(tiny_hf, tmp_path):
    with pytest.raises(CheckpointError, match="layout: first_stage_layers \\+ last_stage_layers exceed"):
        hf_to_megatron(tiny_hf("llama"), tmp_path / "mg", pp=2, first_stage_layers=3, last_stage_layers=3)
