"""CPT from checkpoints that transformers itself saved: our first-step loss equals transformers' (fp32, 1e-4 rel)."""

from __future__ import annotations

import loongforge
import pytest
import yaml

FAMILIES = ["llama", "qwen3", "qwen3_moe", "deepseek_v3", "kimi_k2", "glm4_moe"]


def cpt_recipe(tmp_path, hf_dir, *, model=None, parallel=None, **train):
    r = {
        "backend": "megatron",
        "model": {"hf": str(hf_dir), **(model or {})},
        "parallel": parallel or {},
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


def _first_step(*, rank, world, recipe_path, run_dir, metrics=False):
    """(step 1's micro-batches, our step-1 loss), in a rank (``ranks``): never in pytest's own process.
    ``metrics``: the step's whole metrics dict instead of the loss."""
    recipe = loongforge.load_recipe(recipe_path)
    job, _ = loongforge.build_job(recipe, output_dir=run_dir)
    try:
        import torch

        batches = job.schedule.microbatches(0, device=torch.device("cpu"))
        out = job.step()
    finally:
        job.close()
    return batches, out if metrics else out["loss"]


@pytest.mark.parametrize("family", FAMILIES)
def test_first_step_loss_equals_transformers(tmp_path, family, tiny_hf, reference_loss, ranks):
    hf_dir = tiny_hf(family, tmp_path / "hf")
    batches, ours = ranks(_first_step, world=1, out=tmp_path / "ranks", recipe_path=cpt_recipe(tmp_path, hf_dir),
                          run_dir=tmp_path / "run")[0]
    ref = reference_loss(hf_dir, batches)
    assert ours == pytest.approx(ref, rel=1e-4), (ours, ref)


@pytest.mark.parametrize("parallel", [{}, pytest.param({"pp": 2, "first_stage_layers": 1}, marks=pytest.mark.slow)],
                         ids=["one_rank", "pp2"])
def test_mtp_loss_equals_transformers(tmp_path, tiny_hf, mtp_hf, reference_loss, ranks, parallel):
    """DeepSeek-V3 with its multi-token-prediction layer loaded from the HF checkpoint: the next-token loss is
    transformers' and the MTP loss is transformers' MtpModel's (the MTP layer on the last pipeline stage)."""
    hf_dir = mtp_hf(tiny_hf("deepseek_v3", tmp_path / "hf"))
    world = parallel.get("pp", 1)
    recipe = cpt_recipe(tmp_path, hf_dir, model={"mtp_num_layers": 1, "mtp_loss_weight": 0.3}, parallel=parallel)
    out = ranks(_first_step, world=world, out=tmp_path / "ranks", recipe_path=recipe, run_dir=tmp_path / "run",
                metrics=True)
    batches, metrics = out[0]
    assert metrics["loss"] == pytest.approx(reference_loss(hf_dir, batches), rel=1e-4)
    assert metrics["mtp_loss"] == pytest.approx(mtp_hf.loss(hf_dir, batches), rel=1e-4)
