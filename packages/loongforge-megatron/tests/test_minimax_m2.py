"""MiniMax-M2 from a checkpoint transformers saved: its config both ways, HF -> megatron -> HF bit-exact under tp 2 ep 2
and pp 2 ep 2, the first step's loss equal to transformers', and tp 2 + ep 2 equal to one process over 5 steps (the
whole-projection q / k norm summing its squares over TP)."""

from __future__ import annotations

import pytest
import torch

SEQ = 16
STEPS = 5


def _nontrivial(model) -> None:
    """Norm weights away from 1 and expert-score biases away from 0 (transformers inits them trivially)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.01 * torch.randn_like(b))


@pytest.fixture(scope="module")
def m2_hf(tmp_path_factory):
    """A tiny MiniMaxM2ForCausalLM saved by transformers: odd vocab, 6 heads over 2 kv heads of 8 dims (q norm over
    48 channels, k norm over 16), RoPE on 4 of each head's 8 dims, 6 routed experts, top-2."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.MiniMaxM2Config(vocab_size=509, hidden_size=48, intermediate_size=24, num_hidden_layers=2,
                             num_attention_heads=6, num_key_value_heads=2, head_dim=8, num_local_experts=6,
                             num_experts_per_tok=2, rotary_dim=4, max_position_embeddings=128, bos_token_id=1,
                             eos_token_id=2)
    model = tf.MiniMaxM2ForCausalLM(cfg)
    _nontrivial(model)
    out = tmp_path_factory.mktemp("m2") / "hf"
    model.save_pretrained(out)
    return out


def _recipe(tmp_path, hf_dir, *, name, parallel=None, **train):
    import yaml

    r = {
        "backend": "megatron",
        "model": {"hf": str(hf_dir)},
        "parallel": parallel or {},
        "data": {"format": "synthetic", "seq_length": SEQ},
        "train": {"stage": "cpt", "steps": 1, "global_batch_size": 4, "micro_batch_size": 2, "precision": "fp32",
                  "lr": 1e-3, "seed": 7, **train},
        "checkpoint": {"load": str(hf_dir), "save_at_end": False, "save_format": ["hf"]},
        "accelerator": "cpu",
        "logging": {"tensorboard": False},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(r))
    return path


def _train(*, rank, world, recipe_path, run_dir, export=None):
    """Step 1's micro-batches and every step's metrics, in a rank; ``export``: first write the loaded model as HF."""
    import loongforge

    job, _ = loongforge.build_job(loongforge.load_recipe(recipe_path), output_dir=run_dir)
    try:
        if export is not None:
            job.export("hf", export)
        batches = job.schedule.microbatches(0, device=torch.device("cpu"))
        metrics = [job.step() for _ in range(job.recipe.train.steps)]
    finally:
        job.close()
    return batches, metrics


def test_config_reads_and_writes_back(m2_hf):
    """config.json -> architecture -> the config an export writes: transformers reads the same model back."""
    import transformers as tf
    from loongforge_megatron.models.hf_arch import arch_from_hf
    from loongforge_megatron.models.registry import hf_config

    arch = arch_from_hf(m2_hf)
    assert (arch.family, arch.rotary_percent, arch.num_experts, arch.moe_ffn_hidden_size, arch.kv_heads) == (
        "minimax_m2", 0.5, 6, 24, 2)
    assert arch.moe_score_function == "sigmoid" and arch.moe_expert_bias and arch.qk_norm
    cfg = hf_config(arch)
    assert cfg["architectures"] == ["MiniMaxM2ForCausalLM"] and cfg["rotary_dim"] == 4
    back = tf.MiniMaxM2Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    src = tf.MiniMaxM2Config.from_pretrained(m2_hf)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_local_experts", "num_experts_per_tok",
                "num_key_value_heads", "head_dim", "rms_norm_eps"):
        assert getattr(back, key) == getattr(src, key), key
    assert back.rope_parameters["partial_rotary_factor"] == src.rope_parameters["partial_rotary_factor"] == 0.5
    assert back.rope_parameters["rope_theta"] == src.rope_parameters["rope_theta"]


@pytest.mark.parametrize(("tp", "pp", "ep"), [(2, 1, 2), (1, 2, 2)], ids=["tp2_ep2", "pp2_ep2"])
def test_hf_roundtrip_bit_exact(tmp_path, m2_hf, tp, pp, ep):
    """HF -> megatron (the q / k norm weights whole on every TP rank, experts split over EP) -> HF, bit-exact."""
    from loongforge.checkpoint import SafetensorsReader
    from loongforge_megatron.conversion import MegatronLayout, hf_to_megatron, megatron_to_hf

    layout = hf_to_megatron(m2_hf, tmp_path / "mg", tp=tp, pp=pp, ep=ep)
    assert layout.family == "minimax_m2"
    shard = SafetensorsReader(layout.rank_file(tmp_path / "mg", next(iter(layout.ranks()))))
    assert shard.get("decoder.layers.0.self_attention.q_layernorm.weight").shape == (48,)
    assert shard.get("decoder.layers.0.mlp.router.expert_bias").shape == (6,)
    megatron_to_hf(tmp_path / "mg", tmp_path / "hf")
    a, b = SafetensorsReader(m2_hf), SafetensorsReader(tmp_path / "hf")
    assert sorted(a.keys()) == sorted(b.keys())
    for k in a.keys():
        assert torch.equal(a.get(k), b.get(k)), k
    assert MegatronLayout.load(tmp_path / "mg").family == "minimax_m2"


def test_first_step_loss_equals_transformers(tmp_path, m2_hf, reference_loss, ranks):
    recipe = _recipe(tmp_path, m2_hf, name="cpt")
    batches, metrics = ranks(_train, world=1, out=tmp_path / "ranks", recipe_path=recipe, run_dir=tmp_path / "run")[0]
    ref = reference_loss(m2_hf, batches)
    assert metrics[0]["loss"] == pytest.approx(ref, rel=1e-4), (metrics[0]["loss"], ref)


def _even_vocab(hf_dir, out):
    """``hf_dir`` with its vocabulary cut to an even 508 tokens.

    NOTE: under tp 2 an odd vocabulary is padded by one row, whose zero logit joins the softmax of the vocab-
    parallel cross-entropy (about 1/vocab of extra loss, any family): the layout comparison uses an even one."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(hf_dir, out)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "vocab_size": 508}))
    tensors = load_file(out / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        tensors[name] = tensors[name][:508].contiguous()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.slow
def test_tp2_ep2_equals_one_process_over_5_steps(tmp_path, m2_hf, reference_loss, ranks):
    """One 2-rank launch at tp 2 (sequence parallel) and ep 2 (expert tp 1: the experts fold onto the TP ranks) trains 5 steps with one process's losses and grad
    norms; it loads and exports the checkpoint bit-exact, and its first loss is transformers'."""
    from loongforge.checkpoint import SafetensorsReader

    hf = _even_vocab(m2_hf, tmp_path / "even")
    one = ranks(_train, world=1, out=tmp_path / "one", recipe_path=_recipe(tmp_path, hf, name="one", steps=STEPS),
                run_dir=tmp_path / "run1")[0]
    recipe = _recipe(tmp_path, hf, name="tp2ep2", parallel={"tp": 2, "ep": 2, "etp": 1, "sp": True},
                     steps=STEPS)
    out = ranks(_train, world=2, out=tmp_path / "two", recipe_path=recipe, run_dir=tmp_path / "run2",
                export=tmp_path / "export")
    a, b = SafetensorsReader(hf), SafetensorsReader(tmp_path / "export")
    assert sorted(a.keys()) == sorted(b.keys())
    assert all(torch.equal(a.get(k), b.get(k)) for k in a.keys())
    ref = [m["loss"] for m in one[1]]
    assert len(set(ref)) == STEPS  # the model trains
    for _, metrics in out:
        assert [m["loss"] for m in metrics] == pytest.approx(ref, rel=1e-5)
        assert [m["grad_norm"] for m in metrics] == pytest.approx([m["grad_norm"] for m in one[1]], rel=1e-4)
    assert ref[0] == pytest.approx(reference_loss(hf, one[0]), rel=1e-4)


@pytest.mark.parametrize(("args", "key"), [
    (["parallel.tp=4", "--world-size", "4"], "not divisible by tp"),  # 2 kv heads: the k norm spans each once
    (["model.qk_norm=false"], "model.qk_norm"),
])
def test_bad_settings_are_one_line_errors(capsys, args, key):
    from pathlib import Path

    from loongforge.cli import main

    recipe = Path(__file__).resolve().parents[3] / "recipes" / "llm" / "tiny" / "minimax_m2_tiny.yaml"
    assert main(["validate", str(recipe), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and key in err, err
