"""LoRA on a hybrid LM (Qwen3.5: split DeltaNet projections): ``train.lora.targets [qkv, proj]`` adapts the gated
DeltaNet's input / output projections and the gated attention's; the HF export is W + (alpha/r)·B A of the PEFT
export's factors, and PEFT loads the adapters into transformers' model, whose merged logits are our export's."""

from __future__ import annotations

import json

import loongforge
import pytest
import torch
import yaml


def _lora_exports(*, rank, world, recipe_path, run_dir, export_root):
    job, runtime = loongforge.build_job(loongforge.load_recipe(recipe_path), output_dir=run_dir)
    try:
        losses = [job.step()["loss"] for _ in range(job.recipe.train.steps)]
        job.export("hf", export_root / "hf")
        job.export("peft", export_root / "peft")
        return losses
    finally:
        job.close()
        runtime.logger.close()


@pytest.mark.parametrize("family", ["qwen3_5"])
def test_lora_on_the_deltanet_projections_merges_and_loads_in_peft(hybrid_hf, tmp_path, ranks, family):
    import transformers as tf
    from peft import PeftModel
    from safetensors.torch import load_file

    hf_dir = hybrid_hf(family)
    r = {"backend": "megatron", "model": {"hf": str(hf_dir)}, "data": {"format": "synthetic", "seq_length": 24},
         "train": {"stage": "lora", "steps": 2, "global_batch_size": 2, "micro_batch_size": 1, "precision": "fp32",
                   "lr": 0.05, "seed": 7, "lora": {"rank": 4, "alpha": 8, "targets": ["qkv", "proj"]}},
         "checkpoint": {"load": str(hf_dir), "save_at_end": False}, "accelerator": "cpu",
         "logging": {"tensorboard": False}}
    path = tmp_path / "lora.yaml"
    path.write_text(yaml.safe_dump(r))
    ranks(_lora_exports, world=1, out=tmp_path / "ranks", recipe_path=path, run_dir=tmp_path / "run",
          export_root=tmp_path)
    base, merged = load_file(hf_dir / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    adapters = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert {m.split(".")[-1] for m in config["target_modules"]} == {
        "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj"}
    assert merged.keys() == base.keys()
    adapted = 0
    for name in sorted(base):
        prefix = "base_model.model." + name[: -len("weight")]
        if prefix + "lora_A.weight" not in adapters:
            assert torch.equal(merged[name], base[name]), name
            continue
        a, b = adapters[prefix + "lora_A.weight"], adapters[prefix + "lora_B.weight"]
        assert torch.allclose(merged[name], base[name] + (8 / 4) * b @ a, rtol=0, atol=1e-5), name
        assert not torch.equal(merged[name], base[name]), name
        adapted += 1
    assert adapted == len(adapters) // 2 and adapted > 0
    model = tf.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(model, tmp_path / "peft")
    tokens = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(0))
    ours = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        want, got = ours(input_ids=tokens).logits, peft_model.merge_and_unload().eval()(input_ids=tokens).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
