"""CPT from checkpoints that transformers itself saved: our first-step loss equals transformers' (fp32, 1e-4 rel)."""

from __future__ import annotations

import loongforge
import pytest
import yaml

FAMILIES = ["llama", "qwen3", "qwen3_moe", "deepseek_v3"]


def cpt_recipe(tmp_path, hf_dir, **train):
    r = {
        "backend": "megatron",
        "model": {"hf": str(hf_dir)},
        "data": {"format": "synthetic", "seq_length": 32},
        "train": {"stage": "cpt", "steps": 2, "global_batch_size": 4, "micro_batch_size": 2, "precision": "fp32",
                  "lr": 1e-3, "seed": 7, **train},
        "checkpoint": {"load": str(hf_dir), "save_at_end": False},
        "accelerator": "cpu",
        "logging": {"tensorboard": False},
    }
    path = tmp_path / "cpt.yaml"
    path.write_text(yaml.safe_dump(r))
    return path


@pytest.mark.parametrize("family", FAMILIES)
def test_first_step_loss_equals_transformers(tmp_path, family, tiny_hf, reference_loss):
    hf_dir = tiny_hf(family, tmp_path / "hf")
    recipe = loongforge.load_recipe(cpt_recipe(tmp_path, hf_dir))
    job, _ = loongforge.build_job(recipe, output_dir=tmp_path / "run")
    try:
        import torch

        batches = job.schedule.microbatches(0, device=torch.device("cpu"))
        ours = job.step()["loss"]
    finally:
        job.close()
    ref = reference_loss(hf_dir, batches)
    assert ours == pytest.approx(ref, rel=1e-4), (ours, ref)
