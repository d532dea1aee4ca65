"""LLM settings that megatron or the HF mapping would only refuse mid-run, or get silently wrong, are one-line
recipe errors at ``validate`` (review findings); ``lr_schedule: wsd`` runs (it passed validate, then failed at the
scheduler with megatron's own spelling).

NOTE: every megatron job here runs in a rank (``ranks``) or a subprocess, never in pytest's own process."""

from __future__ import annotations

from pathlib import Path

import loongforge
import pytest
from loongforge.cli import main

TINY = Path(__file__).resolve().parents[3] / "recipes" / "llm" / "tiny"


@pytest.mark.parametrize(("recipe", "args", "key", "message"), [
    ("llama_tiny.yaml", ["model.qkv_bias=true"], "model.qkv_bias", "q/k/v-only biases have no HF layout for llama"),
    ("qwen3_tiny.yaml", ["model.qkv_bias=true"], "model.qkv_bias", "no HF layout for qwen3"),
    ("qwen3_moe_tiny.yaml", ["parallel.tp=2", "--world-size", "2"], "parallel.sp", "need sequence parallelism"),
    ("qwen3_moe_tiny_ep2.yaml", ["train.stage=lora", "--world-size", "2"], "train.lora.targets",
     "LoRA on MoE expert MLPs"),
    ("qwen3_moe_tiny.yaml", ["model.num_attention_heads=8", "model.num_query_groups=4", "parallel.tp=4",
                             "parallel.sp=true", "parallel.ep=2", "parallel.etp=2", "checkpoint.save_format=[dist,hf]",
                             "--world-size", "4"], "parallel.etp", "parallel.etp 2 with tp 4 has no HF layout"),
    ("llama_tiny.yaml", ["parallel.cp=2", "kernels.layers=local", "--world-size", "2"], "kernels.layers",
     "context parallelism needs the loongforge or te layers"),
    ("llama_tiny.yaml", ["kernels.layers=te", "checkpoint.save_format=[dist,hf]"], "kernels.layers",
     "kernels.layers te cannot be used with an HF / PEFT export"),
])
def test_refused_at_validate(capsys, recipe, args, key, message):
    assert main(["validate", str(TINY / recipe), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"key '{key}'" in err and message in err, err


@pytest.mark.parametrize(("recipe", "args"), [
    ("qwen2_tiny.yaml", ["model.qkv_bias=true"]),
    ("qwen3_moe_tiny.yaml", ["parallel.tp=2", "parallel.sp=true", "--world-size", "2"]),
    ("qwen3_moe_tiny_ep2.yaml", ["train.stage=lora", "train.lora.targets=[qkv,proj]", "--world-size", "2"]),
    ("qwen3_moe_tiny.yaml", ["parallel.tp=2", "parallel.sp=true", "parallel.ep=2", "parallel.etp=1", "--world-size", "2"]),
    ("qwen3_moe_tiny.yaml", ["parallel.tp=2", "parallel.sp=true", "parallel.ep=2", "parallel.etp=1",
                             "checkpoint.save_format=[dist,hf]", "--world-size", "2"]),  # test_hf_io: the export
])
def test_the_allowed_neighbours_validate(capsys, recipe, args):
    assert main(["validate", str(TINY / recipe), *args]) == 0, capsys.readouterr().err


def _wsd_lrs(*, rank, world, run_dir):
    recipe = loongforge.load_recipe(TINY / "llama_tiny.yaml", [
        "train.lr_schedule=wsd", "train.steps=20", "train.warmup_steps=1", "train.lr=0.001", "train.min_lr=0.0001",
        "accelerator=cpu", "logging.console=false", "logging.tensorboard=false", "checkpoint.save_at_end=false"])
    job, runtime = loongforge.build_job(recipe, output_dir=run_dir)
    try:
        return [job.step()["lr"] for _ in range(20)]
    finally:
        job.close()
        runtime.logger.close()


def test_wsd_schedule_runs(tmp_path, ranks):
    """Warmup 1, then constant, then the final tenth (default wsd_decay_steps: 2 of 20) decays towards min_lr (the
    logged lr is the one a step used: computed before it)."""
    lrs = ranks(_wsd_lrs, world=1, out=tmp_path / "ranks", run_dir=tmp_path / "run")[0]
    assert lrs[0] == 0 and lrs[1:19] == pytest.approx([0.001] * 18) and 0.0001 < lrs[19] < 0.001, lrs


YARN = {"type": "yarn", "rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def test_rope_scaling_without_a_megatron_equivalent_is_refused(tmp_path, tiny_hf, capsys):
    """Linear (or dynamic) scaling used to train with plain RoPE, silently; it is refused, naming the file and the
    type. So is a YaRN attention_factor megatron cannot express."""
    hf = tiny_hf("qwen3", tmp_path / "q", rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert main(["validate", str(TINY / "llama_tiny.yaml"), "model.preset=null", f"model.hf={hf}"]) == 2
    err = capsys.readouterr().err
    assert "rope_scaling type 'linear' is not supported" in err and str(hf) in err and "key 'model.hf'" in err, err
    odd = tiny_hf("qwen3", tmp_path / "odd", rope_scaling={"rope_type": "yarn", "factor": 4.0, "attention_factor": 2.0})
    assert main(["validate", str(TINY / "llama_tiny.yaml"), "model.preset=null", f"model.hf={odd}"]) == 2
    assert "attention_factor 2.0 differs from YaRN's own" in capsys.readouterr().err


def _first_step_child(*, rank, world, hf, run_dir) -> tuple[float, list]:
    import torch

    recipe = loongforge.load_recipe(TINY / "llama_tiny.yaml", [
        "model.preset=null", f"model.hf={hf}", f"checkpoint.load={hf}", "train.stage=cpt", "data.format=synthetic",
        "data.seq_length=32", "train.global_batch_size=4", "train.micro_batch_size=2", "train.precision=fp32",
        "train.seed=7", "train.steps=2", "checkpoint.save_at_end=false", "accelerator=cpu", "logging.console=false",
        "logging.tensorboard=false"])
    job, runtime = loongforge.build_job(recipe, output_dir=run_dir)
    try:
        batches = job.schedule.microbatches(0, device=torch.device("cpu"))
        return job.step()["loss"], batches
    finally:
        job.close()
        runtime.logger.close()


def _first_step_loss(ranks, tmp_path, hf) -> tuple[float, list]:
    return ranks(_first_step_child, world=1, out=tmp_path / "ranks", hf=hf, run_dir=tmp_path / "run")[0]


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_gpt_yarn_trains_transformers_first_step_loss(tmp_path, tiny_hf, reference_loss, family, ranks):
    """YaRN on llama / qwen (e.g. Qwen3's long-context setting) goes to megatron's GPT ``yarn`` embedding with the
    cos/sin factor: over 32 tokens with an original context of 16 the first-step loss equals transformers' with
    YaRN, which differs from the unscaled model's; the export writes the scaling back."""
    from loongforge_megatron.models.hf_arch import arch_from_hf
    from loongforge_megatron.models.registry import hf_config

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    # NOTE: larger weights make attention (and so the positions) matter to the loss; llama's default init barely does
    hf = tiny_hf(family, tmp_path / "yarn", rope_scaling=yarn, initializer_range=0.5)
    plain = tiny_hf(family, tmp_path / "plain", initializer_range=0.5)
    ours, batches = _first_step_loss(ranks, tmp_path, hf)
    ref, unscaled = reference_loss(hf, batches), reference_loss(plain, batches)
    assert abs(ref - unscaled) > 5e-6 * abs(ref), (ref, unscaled)
    assert ours == pytest.approx(ref, rel=2e-6, abs=0), (ours, ref, unscaled)
    written = hf_config(arch_from_hf(hf), torch_dtype="float32")["rope_scaling"]
    assert written["rope_type"] == "yarn" and written["factor"] == 4.0 and written["truncate"] is True
    assert written["original_max_position_embeddings"] == 16


def test_deepseek_yarn_trains_transformers_first_step_loss(tmp_path, tiny_hf, reference_loss, ranks):
    """DeepSeek-V3's YaRN (frequencies, and mscale on the softmax scale) goes to megatron's MLA: the first-step loss
    equals transformers' with YaRN, which differs from the unscaled model's (so plain RoPE would fail here), and
    the export writes the scaling back."""
    from loongforge_megatron.models.hf_arch import arch_from_hf
    from loongforge_megatron.models.registry import hf_config

    hf = tiny_hf("deepseek_v3", tmp_path / "ds", rope_scaling=YARN)
    plain = tiny_hf("deepseek_v3", tmp_path / "plain")
    ours, batches = _first_step_loss(ranks, tmp_path, hf)
    ref, unscaled = reference_loss(hf, batches), reference_loss(plain, batches)
    assert abs(ref - unscaled) > 5e-6 * abs(ref), (ref, unscaled)
    assert ours == pytest.approx(ref, rel=2e-6, abs=0), (ours, ref, unscaled)
    written = hf_config(arch_from_hf(hf), torch_dtype="float32")["rope_scaling"]
    assert written["rope_type"] == "yarn" and written["factor"] == 40.0 and written["mscale_all_dim"] == 1.0


def test_auto_spec_keeps_our_layer_names_where_hf_weights_or_packed_sft_need_them(monkeypatch):
    """``kernels.layers: auto`` picks TransformerEngine only when it is installed and the recipe neither loads nor
    exports HF weights nor packs SFT sequences (TE is not installable here: its import is faked)."""
    import sys
    import types

    from loongforge_megatron.layers.selection import layer_set

    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    for over, spec in ((["checkpoint.save_format=[dist]"], "te"), (["checkpoint.save_format=[dist,hf]"], "loongforge"),
                       (["checkpoint.load=/some/hf"], "loongforge")):
        recipe = loongforge.load_recipe(TINY / "llama_tiny.yaml", ["kernels.layers=auto", *over])
        assert layer_set(recipe) == spec, over


def test_te_spec_without_transformer_engine_is_one_line(tmp_path, capsys):
    """``kernels.layers te`` validates anywhere (a recipe for a TE machine, checked on a laptop); training where
    TransformerEngine is missing stops with one line naming the key (it was an internal TypeError)."""
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("TransformerEngine is installed")
    import os
    import subprocess
    import sys

    recipe = str(TINY / "llama_tiny.yaml")
    assert main(["validate", recipe, "kernels.layers=te"]) == 0
    # NOTE: a subprocess: the job gets as far as megatron's process groups, which stay out of pytest's process
    proc = subprocess.run([sys.executable, "-m", "loongforge", "train", recipe, "kernels.layers=te", "accelerator=cpu",
                           "--output", str(tmp_path / "run")], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"})
    err = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "key 'kernels.layers'" in err and "needs TransformerEngine" in err, proc.stderr


def _hf_config_dir(out: Path, family: str, **over) -> Path:
    """An HF model directory holding only transformers' own config.json (validate reads no weights)."""
    import transformers as tf

    cls = {"mistral": tf.MistralConfig, "qwen2": tf.Qwen2Config}[family]
    out.mkdir(parents=True)
    cls(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, **over).to_json_file(out / "config.json")
    return out


def test_sliding_window_shorter_than_the_sequence_is_refused(tmp_path, capsys):
    """A Mistral config was read as llama and trained with full attention past its sliding_window, silently: a
    seq_length above the window is one line naming the key and the largest length that trains the HF model's
    attention; at or below the window it validates (the window masks nothing there), and the HF export writes a
    Mistral again (LlamaForCausalLM would attend past the window). Qwen's sliding_window counts only with
    use_sliding_window."""
    from loongforge_megatron.models.hf_arch import arch_from_hf
    from loongforge_megatron.models.registry import hf_config

    llama = ["validate", str(TINY / "llama_tiny.yaml"), "model.preset=null"]
    mistral = _hf_config_dir(tmp_path / "mistral", "mistral", sliding_window=32)
    assert main([*llama, f"model.hf={mistral}"]) == 2  # llama_tiny: seq_length 64
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "key 'data.seq_length'" in err and "sliding_window 32" in err, err
    assert "set data.seq_length <= 32" in err, err
    assert main([*llama, f"model.hf={mistral}", "data.seq_length=32"]) == 0, capsys.readouterr().err
    for name, family, over in (("full", "mistral", {"sliding_window": None}), ("wide", "mistral", {"sliding_window": 64}),
                               ("qwen", "qwen2", {"sliding_window": 32, "use_sliding_window": False})):
        hf = _hf_config_dir(tmp_path / name, family, **over)
        assert main([*llama, f"model.hf={hf}"]) == 0, (name, capsys.readouterr().err)
    qwen = _hf_config_dir(tmp_path / "qwen_sliding", "qwen2", sliding_window=32, use_sliding_window=True)
    assert main([*llama, f"model.hf={qwen}"]) == 2 and "sliding_window 32" in capsys.readouterr().err
    exported = hf_config(arch_from_hf(mistral))
    assert exported["model_type"] == "mistral" and exported["sliding_window"] == 32, exported
    assert exported["architectures"] == ["MistralForCausalLM"]
    assert hf_config(arch_from_hf(tmp_path / "full"))["model_type"] == "llama"
