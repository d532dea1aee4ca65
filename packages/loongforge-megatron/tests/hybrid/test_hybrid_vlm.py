"""The Qwen3.5 VLMs (``Qwen3_5ForConditionalGeneration``; MoE: ``Qwen3_5MoeForConditionalGeneration``) from
checkpoints transformers saved (GQA, both layer kinds, value heads twice the key heads, RoPE on a quarter of each
head): HF -> megatron (tp 2 / pp 2, MoE: / ep 2) -> HF bit-exact and loaded back by transformers; ``loongforge
train``'s first step on two records with images of two sizes gives the loss transformers computes on what its own
processor makes of them.

NOTE: every megatron job here runs in a rank (``ranks``), never in pytest's own process."""

from __future__ import annotations

import json
from pathlib import Path

import loongforge
import pytest
import torch
from vl_records import TEXTS, make_records, processor_loss, save_processor

RECIPE = Path(__file__).resolve().parents[4] / "recipes" / "vlm" / "qwen3_5_vl_tiny.yaml"


def save_qwen3_5_vl(out: Path, *, vocab: int, ids: dict[str, int], moe: bool = False) -> Path:
    """A tiny Qwen3_5ForConditionalGeneration, every weight perturbed (no norm at its init value); ``moe``: a
    Qwen3_5MoeForConditionalGeneration (4 experts, top 2, a gated shared expert)."""
    import transformers as tf

    prefix = "Qwen3_5Moe" if moe else "Qwen3_5"
    experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                   shared_expert_intermediate_size=24) if moe else dict(intermediate_size=96)
    cfg = getattr(tf, prefix + "Config")(
        text_config=dict(vocab_size=vocab, hidden_size=64, **experts, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                         linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
                         max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                         layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                          "mrope_interleaved": True, "partial_rotary_factor": 0.25}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=64,
                           patch_size=4, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16),
        tie_word_embeddings=False, **ids)
    torch.manual_seed(0)
    model = getattr(tf, prefix + "ForConditionalGeneration")(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # NOTE: the layer norms of the tower start at 1, the LM's zero-centred ones at 0, A_log around 1
            base = 1.0 if name.endswith(("norm1.weight", "norm2.weight", "merger.norm.weight", "A_log")) else 0.0
            p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3_5_vl") / "hf"
    ids, vocab = save_processor(out, TEXTS, family="qwen3_vl")  # NOTE: Qwen3.5 ships Qwen3-VL's processor
    # NOTE: transformers loads the processor with Qwen3.5's tokenizer class, which adds a token of its own
    return save_qwen3_5_vl(out, vocab=vocab + 3, ids=ids)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    ids = {"image_token_id": 300, "video_token_id": 301, "vision_start_token_id": 302, "vision_end_token_id": 303}
    return save_qwen3_5_vl(tmp_path_factory.mktemp("qwen3_5_moe_vl") / "hf", vocab=317, ids=ids, moe=True)


@pytest.mark.parametrize("which,ep", [("dense", 1), ("moe", 2)])
def test_hf_megatron_hf_is_bit_exact(tmp_path, request, which, ep):
    """HF -> megatron at tp 2 / pp 2 (MoE: / ep 2) -> HF gives the source's tensors bit for bit, and transformers
    loads the export into the source's model."""
    from loongforge.checkpoint import SafetensorsReader
    from loongforge_megatron.conversion import hf_to_megatron, megatron_to_hf
    from transformers import AutoModelForImageTextToText

    hf_dir = request.getfixturevalue("hf_dir" if which == "dense" else "moe_dir")
    layout = hf_to_megatron(hf_dir, tmp_path / "mg", tp=2, pp=2, ep=ep)
    assert layout.family == ("qwen3_5_vl" if which == "dense" else "qwen3_5_moe_vl")
    megatron_to_hf(tmp_path / "mg", tmp_path / "hf")
    a, b = SafetensorsReader(hf_dir), SafetensorsReader(tmp_path / "hf")
    assert sorted(a.keys()) == sorted(b.keys())
    assert any(k.startswith("model.visual.") for k in a.keys())
    for k in a.keys():
        assert torch.equal(a.get(k), b.get(k)), k
    want = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32).state_dict()
    got = AutoModelForImageTextToText.from_pretrained(tmp_path / "hf", dtype=torch.float32).state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def _steps(*, rank, world, overrides, run_dir):
    """Per data.pack false / true: (step 1's first micro-batch, every step's loss) of a job in a rank."""
    out = []
    for pack in ("false", "true"):
        recipe = loongforge.load_recipe(RECIPE, [*overrides, f"data.pack={pack}"])
        job, runtime = loongforge.build_job(recipe, output_dir=run_dir / pack)
        try:
            batch = job.schedule.microbatches(0, device=torch.device("cpu"))[0]
            out.append((batch, [job.step()["loss"] for _ in range(job.recipe.train.steps)]))
        finally:
            job.close()
            runtime.logger.close()
    return out


def test_sft_first_step_loss_equals_transformers_and_packed_equals_padded(tmp_path, hf_dir, ranks):
    """Both records in one micro-batch (rows padded): tokens and pixels are the processor's, and the first SFT step's
    loss is transformers' on the processor's batch (its multimodal positions from get_rope_index); packed into one
    row (the DeltaNet's state and convolution restarting at the record boundary), the two steps' losses are the
    padded rows'."""
    records = make_records(tmp_path / "data")
    over = [f"model={{hf: {hf_dir}}}", f"checkpoint.load={hf_dir}", "data.format=conversations",
            f"data.path={records}", "data.seq_length=96", "train.stage=sft", "train.global_batch_size=2",
            "train.micro_batch_size=2", "train.steps=2", "train.warmup_steps=0", "accelerator=cpu",
            "logging.console=false"]
    (b, losses), (packed, p_losses) = ranks(_steps, world=1, out=tmp_path / "ranks", run_dir=tmp_path / "run",
                                            overrides=over)[0]
    assert json.loads((hf_dir / "config.json").read_text())["model_type"] == "qwen3_5"
    ref = processor_loss(hf_dir, records, b, pixels="pixel_values")
    assert losses[0] == pytest.approx(ref, rel=1e-4), (losses[0], ref)
    assert len(packed["packed_seq_params"].cu_seqlens_q) == 3 and packed["tokens"].shape[0] == 1
    assert p_losses == pytest.approx(losses, rel=1e-5, abs=1e-6), (p_losses, losses)


def _lora_exports(*, rank, world, overrides, run_dir, export_root):
    job, runtime = loongforge.build_job(loongforge.load_recipe(RECIPE, overrides), output_dir=run_dir)
    try:
        for _ in range(job.recipe.train.steps):
            job.step()
        job.export("hf", export_root / "hf")
        job.export("peft", export_root / "peft")
    finally:
        job.close()
        runtime.logger.close()


def test_lora_adapts_the_deltanet_projections_and_loads_in_peft(tmp_path, hf_dir, ranks):
    """train.stage lora, targets [qkv, proj]: adapters on the language model's gated DeltaNet and gated attention
    projections (the tower stays as it is); the HF export is W + (alpha/r)·B A of the PEFT export's factors, and PEFT
    loads them into transformers' model, whose merged logits are our export's."""
    import transformers as tf
    from peft import PeftModel
    from safetensors.torch import load_file

    records = make_records(tmp_path / "data")
    over = [f"model={{hf: {hf_dir}}}", f"checkpoint.load={hf_dir}", "data.format=conversations",
            f"data.path={records}", "data.seq_length=96", "train.stage=lora", "train.global_batch_size=2",
            "train.micro_batch_size=2", "train.steps=2", "train.lr=0.05", "train.warmup_steps=0",
            "train.lora={rank: 4, alpha: 8, targets: [qkv, proj]}", "accelerator=cpu", "logging.console=false"]
    ranks(_lora_exports, world=1, out=tmp_path / "ranks", run_dir=tmp_path / "run", overrides=over,
          export_root=tmp_path)
    base, merged = load_file(hf_dir / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    adapters = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert {m.split(".")[-1] for m in config["target_modules"]} == {
        "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj"}
    assert all(".language_model." in m for m in config["target_modules"])
    assert merged.keys() == base.keys()
    for name in sorted(base):
        prefix = "base_model.model." + name[: -len("weight")]
        if prefix + "lora_A.weight" not in adapters:
            assert torch.equal(merged[name], base[name]), name
            continue
        a, b = adapters[prefix + "lora_A.weight"], adapters[prefix + "lora_B.weight"]
        assert torch.allclose(merged[name], base[name] + (8 / 4) * b @ a, rtol=0, atol=1e-5), name
    model = tf.AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(model, tmp_path / "peft")
    loaded = {k.replace(".default.weight", ".weight"): v for k, v in peft_model.state_dict().items() if ".lora_" in k}
    assert sorted(loaded) == sorted(adapters)
    tokens = torch.randint(0, 290, (2, 16), generator=torch.Generator().manual_seed(0))
    ours = tf.AutoModelForImageTextToText.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        want, got = ours(input_ids=tokens).logits, peft_model.merge_and_unload().eval()(input_ids=tokens).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_the_mtp_layer_converts_both_ways(tmp_path, hf_dir):
    """A checkpoint with the published multi-token-prediction layer (``mtp.*`` at the top level, its decoder
    layer a full-attention one): kept bit for bit through megatron at tp 2 / pp 2."""
    import shutil

    from loongforge.checkpoint import SafetensorsReader
    from loongforge_megatron.conversion import hf_to_megatron, megatron_to_hf
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(hf_dir, src)
    tensors = load_file(src / "model.safetensors")
    full = "model.language_model.layers.1."  # NOTE: the full-attention layer of the tiny config
    g = torch.Generator().manual_seed(5)
    tensors.update({"mtp.layers.0." + k[len(full):]: v + 0.1 * torch.randn(v.shape, generator=g)
                    for k, v in tensors.items() if k.startswith(full)})
    h = 64
    tensors.update({"mtp.fc.weight": torch.randn(h, 2 * h, generator=g), "mtp.norm.weight": torch.randn(h, generator=g),
                    "mtp.pre_fc_norm_embedding.weight": torch.randn(h, generator=g),
                    "mtp.pre_fc_norm_hidden.weight": torch.randn(h, generator=g)})
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    layout = hf_to_megatron(src, tmp_path / "mg", tp=2, pp=2)
    assert layout.mtp_layers == 1
    megatron_to_hf(tmp_path / "mg", tmp_path / "hf")
    a, b = SafetensorsReader(src), SafetensorsReader(tmp_path / "hf")
    assert sorted(a.keys()) == sorted(b.keys())
    for k in a.keys():
        assert torch.equal(a.get(k), b.get(k)), k


@pytest.mark.parametrize("rope,message", [
    ({"mrope_section": [2, 2, 2]}, "sums to 6, not half the rotary dims (text_config.head_dim 32 x partial_rotary_factor 0.25: 4)"),
    ({"partial_rotary_factor": "quarter"}, "partial_rotary_factor' must be a number in (0, 1], got 'quarter'"),
])
def test_convert_refuses_rotary_sections_the_partial_rope_cannot_hold(tmp_path, hf_dir, capsys, rope, message):
    """A config whose multimodal rotary sections do not cover the rotated quarter of each head is one line."""
    import shutil

    from loongforge.cli import main

    src = tmp_path / "src"
    shutil.copytree(hf_dir, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["text_config"]["rope_parameters"].update(rope)
    (src / "config.json").write_text(json.dumps(cfg))
    capsys.readouterr()
    assert main(["convert", str(src), str(tmp_path / "mg"), "--to", "megatron"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "text_config.rope_parameters" in err and message in err, err
