"""Run the synthetic tiny-VLA recipe for a few steps under each named strategy in this (torchrun) process group
and write rank 0's losses as JSON. Used by the equivalence tests: ``torchrun --nproc-per-node N dist_driver.py
OUT.json STEPS strategy[:shard_size] ...``."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch.distributed as dist

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "embodied" / "tiny_vla_synthetic.yaml"


def main(out: str, steps: str, *strategies: str) -> None:
    from loongforge.api import build_job, load_recipe

    dist.init_process_group("gloo")
    results: dict[str, list[float]] = {}
    for spec in strategies:
        strategy, _, shard = spec.partition(":")
        overrides = [f"parallel.strategy={strategy}", f"train.steps={steps}", "checkpoint.resume=never",
                     "checkpoint.save_at_end=false", "logging.console=false", "logging.tensorboard=false"]
        if shard:
            overrides.append(f"parallel.shard_size={shard}")
        recipe = load_recipe(RECIPE, overrides)
        with tempfile.TemporaryDirectory() as tmp:
            job, _ = build_job(recipe, output_dir=tmp)
            results[spec] = [job.step()["loss"] for _ in range(int(steps))]
            job.close()
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(*sys.argv[1:])
