"""From random init (no checkpoint.load) the same recipe and seed start from the same model at any layout: the tiny
LLM, MoE and DiT recipes at tp 2, pp 2, ep 2 (MoE) and dp 2 give the one-process losses (fp32, CPU gloo).

megatron alone draws each pipeline stage from ``seed + 100 * pp_rank`` and each rank's experts / shards in build
order; the specs redraw every random tensor whole from the seed and its global name (``engine.weights.seeded_init``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

RECIPES = Path(__file__).resolve().parents[4] / "recipes"
LLM = RECIPES / "llm" / "tiny" / "llama_tiny.yaml"
MOE = RECIPES / "llm" / "tiny" / "qwen3_moe_tiny.yaml"
DIT = RECIPES / "diffusion" / "dit_tiny.yaml"
STEPS = 2
TOL = 1e-5  # relative, per step: the reduction order differs between layouts
COMMON = [f"train.steps={STEPS}", "train.warmup_steps=1", "accelerator=cpu", "logging.console=false", "logging.tensorboard=false",
          "checkpoint.save_at_end=false", "checkpoint.resume=never"]
# name -> (recipe, overrides); every 2-rank layout, and the one-process runs they are held against
LAYOUTS = {
    "llm_tp2": (LLM, ["parallel.tp=2", "parallel.sp=true"]),
    "llm_pp2": (LLM, ["parallel.pp=2"]),
    "llm_dp2": (LLM, ["parallel.dp=2"]),
    "moe_ep2": (MOE, ["parallel.ep=2"]),
    "dit_tp2": (DIT, ["parallel.tp=2", *(DIT_BATCH := ["train.global_batch_size=4", "train.micro_batch_size=2"])]),
    "dit_dp2": (DIT, ["parallel.dp=2", *DIT_BATCH]),
}
SINGLE = {"llm": (LLM, []), "moe": (MOE, []), "dit": (DIT, DIT_BATCH)}


def _losses(*, rank, world, recipe, over, run_dir):
    """The per-step losses of one run of ``recipe`` with ``over`` in this world."""
    import loongforge

    job, runtime = loongforge.build_job(loongforge.load_recipe(recipe, [*COMMON, *over]), output_dir=run_dir)
    try:
        return [job.step()["loss"] for _ in range(STEPS)]
    finally:
        job.close()
        runtime.logger.close()


@pytest.fixture(scope="module")
def single(tmp_path_factory, ranks):
    """One-process losses of each recipe (each run in its own forked world)."""
    out = tmp_path_factory.mktemp("single")
    return {name: ranks(_losses, world=1, out=out / name / "ranks", recipe=recipe, over=over, run_dir=out / name)[0]
            for name, (recipe, over) in SINGLE.items()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_random_init_gives_the_one_process_losses(layout, single, tmp_path, ranks):
    recipe, over = LAYOUTS[layout]
    ref = single[layout.split("_")[0]]
    got = ranks(_losses, world=2, out=tmp_path / "ranks", recipe=recipe, over=over, run_dir=tmp_path / "run")
    for step, (a, b) in enumerate(zip(got[0], ref, strict=True), 1):
        assert a == pytest.approx(b, rel=TOL), (layout, step, a, b)
    assert ref[0] != ref[-1]  # the run trains
