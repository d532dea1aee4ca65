"""GPU: a DeepSeek-V3.2 training step runs its sparse attention through the kernel registry's sparse MLA kernel
(Triton, or TileLang where selected), in bf16, and trains (finite losses, the indexer's loss reported)."""

from __future__ import annotations

import math

import pytest
import yaml


def _train_on_cuda(*, rank, world, recipe_path, run_dir):
    import loongforge
    from loongforge_megatron.layers.sparse_attention import SparseMLAttention

    job, _ = loongforge.build_job(loongforge.load_recipe(recipe_path), output_dir=run_dir)
    try:
        metrics = [job.step() for _ in range(job.recipe.train.steps)]
        phase = next(m.phase for c in job.chunks for m in c.modules() if isinstance(m, SparseMLAttention))
        return metrics, phase.kernel_calls, phase.layers
    finally:
        job.close()


@pytest.mark.gpu
def test_sparse_mla_kernel_runs_inside_a_deepseek_v32_training_step(tmp_path, ranks):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    recipe = {
        "backend": "megatron",
        "model": {"preset": "deepseek-v3.2-tiny", "dsa": {"topk": 16, "warmup_steps": 1}},
        "data": {"format": "synthetic", "seq_length": 128},
        "train": {"steps": 3, "global_batch_size": 4, "micro_batch_size": 2, "precision": "bf16", "lr": 1e-3},
        "kernels": {"layers": "loongforge"},
        "checkpoint": {"save_at_end": False},
        "accelerator": "cuda",
        "logging": {"tensorboard": False},
    }
    path = tmp_path / "v32.yaml"
    path.write_text(yaml.safe_dump(recipe))
    metrics, calls, layers = ranks(_train_on_cuda, world=1, out=tmp_path / "ranks", recipe_path=path,
                                   run_dir=tmp_path / "run")[0]
    assert [m["dsa_sparse"] for m in metrics] == [0.0, 1.0, 1.0]
    # NOTE: the two sparse steps, two micro-batches each, in every layer (the warm-up attends densely)
    assert calls == 2 * 2 * layers > 0
    assert all(math.isfinite(m["loss"]) and m["dsa_indexer_loss"] > 0 for m in metrics)
