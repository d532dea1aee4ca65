"""A synthetic recipe's losses for a few steps under each named strategy, in the ranks of the workspace harness
(``ranks(run_strategies, world=N, ...)``, tests/support/rank_harness.py). Used by the equivalence tests: each spec
is ``strategy[:shard_size]``; a recipe is a file name under recipes/embodied/."""

from __future__ import annotations

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


def run_strategies(*, rank: int, world: int, recipe_name: str, steps: int, strategies: list[str],
                   extra: tuple[str, ...] = (), backend: str = "gloo") -> dict:
    """A rank of the harness: ``{"losses": {spec: [...]}, "layouts": {spec: {...}}}`` of each strategy in
    ``strategies`` on a ``world``-process ``backend`` group (nccl: one GPU per rank, fp32 matmuls)."""
    if backend == "nccl":
        import torch

        torch.cuda.set_device(rank)
        torch.backends.cuda.matmul.allow_tf32 = False  # NOTE: fp32 comparisons against a one-process run
        torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group(backend)
    try:
        layouts: dict[str, dict] = {spec: {} for spec in strategies}
        results = {spec: losses(recipe_name, spec, steps=steps, extra=extra, layout=layouts[spec])
                   for spec in strategies}
        return {"losses": results, "layouts": layouts}
    finally:
        dist.destroy_process_group()


def one_and_two_ranks(ranks, out: Path, *, env: dict, extra, recipe_name: str, strategies: list[str],
                      steps: int = 3, timeout_s: int = 600) -> tuple[list[float], dict]:
    """The one-process ddp losses of ``recipe_name`` and the result of one 2-rank launch of ``strategies``
    (``run_strategies``'s), for a policy's test that they agree."""
    common = dict(env=env, timeout_s=timeout_s, extra=extra, recipe_name=recipe_name, steps=steps)
    single = ranks(run_strategies, world=1, out=out / "one", strategies=["ddp"], **common)[0]["losses"]["ddp"]
    two = ranks(run_strategies, world=2, out=out / "two", strategies=strategies, **common)[0]
    return single, two
