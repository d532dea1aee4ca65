"""Run a synthetic recipe for a few steps under each named strategy in this (torchrun) process group and write
rank 0's losses as JSON. Used by the equivalence tests: ``torchrun --nproc-per-node N dist_driver.py OUT.json
STEPS RECIPE strategy[:shard_size] ...`` (RECIPE: a file name under recipes/embodied/; OUT.json holds each
spec's ``losses`` and the ``layouts`` of its first trainable weight); ``losses`` also runs
the one-process reference inside the test process. Environment: ``DIST_DRIVER_BACKEND`` (default gloo; nccl for
GPU runs) and ``DIST_DRIVER_OVERRIDES`` (more recipe overrides, space-separated)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch.distributed as dist

RECIPES = Path(__file__).resolve().parents[3] / "recipes" / "embodied"


def losses(recipe_name: str, spec: str, *, steps: int, extra: tuple[str, ...] = (),
           layout: dict | None = None) -> list[float]:
    """Losses of ``steps`` optimizer steps of ``recipe_name`` under ``spec`` (``strategy[:shard_size]``) in this
    process group, or in a private one-process group when none is initialised. ``layout``: filled with how the
    first trainable weight is held (mesh shape, dim names, placements; ``{}`` for a plain tensor)."""
    from loongforge.api import build_job, load_recipe

    strategy, _, shard = spec.partition(":")
    overrides = [f"parallel.strategy={strategy}", f"train.steps={steps}", "checkpoint.resume=never",
                 "checkpoint.save_at_end=false", "logging.console=false", "logging.tensorboard=false", *extra]
    if shard:
        overrides.append(f"parallel.shard_size={shard}")
    recipe = load_recipe(RECIPES / recipe_name, overrides)
    with tempfile.TemporaryDirectory() as tmp:
        job, _ = build_job(recipe, output_dir=tmp)
        try:
            if layout is not None:
                p = next(p for p in job.model.raw.parameters() if p.requires_grad)
                if hasattr(p, "device_mesh"):
                    layout.update(mesh=list(p.device_mesh.shape), names=list(p.device_mesh.mesh_dim_names or ()),
                                  placements=[str(x) for x in p.placements])
            return [job.step()["loss"] for _ in range(steps)]
        finally:
            job.close()


def main(out: str, steps: str, recipe_name: str, *strategies: str) -> None:
    backend = os.environ.get("DIST_DRIVER_BACKEND", "gloo")
    if backend == "nccl":
        import torch

        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.backends.cuda.matmul.allow_tf32 = False  # NOTE: fp32 comparisons against a one-process run
        torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group(backend)
    extra = tuple(os.environ.get("DIST_DRIVER_OVERRIDES", "").split())
    layouts: dict[str, dict] = {spec: {} for spec in strategies}
    results = {spec: losses(recipe_name, spec, steps=int(steps), extra=extra, layout=layouts[spec])
               for spec in strategies}
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"losses": results, "layouts": layouts}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(*sys.argv[1:])
