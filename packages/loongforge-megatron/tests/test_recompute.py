"""``parallel.recompute`` (activation recompute): megatron's recompute is really on (the TransformerConfig says so
and the checkpointed functions run again in the backward) and the losses are those of the run without it."""

from __future__ import annotations

from pathlib import Path

import pytest

RECIPES = Path(__file__).resolve().parents[3] / "recipes"
STEPS = 3


def _train_child(*, rank, world, recipe, run_dir, over):
    """One rank (``ranks``): megatron's process-wide state stays out of pytest's process. Counts the calls
    of megatron's ``tensor_parallel.checkpoint`` (what full and selective recompute go through) and the runs of
    the functions it was given (once in the forward, once more when the backward recomputes them)."""
    import loongforge
    from megatron.core import tensor_parallel
    from megatron.core.transformer.transformer_block import TransformerBlock

    counts = {"checkpoints": 0, "runs": 0}
    real = tensor_parallel.checkpoint

    def counting(function, distribute_saved_activations, *args):
        def run(*a):
            counts["runs"] += 1
            return function(*a)

        counts["checkpoints"] += 1
        return real(run, distribute_saved_activations, *args)

    tensor_parallel.checkpoint = counting
    recipe = loongforge.load_recipe(RECIPES / recipe, [
        "accelerator=cpu", f"train.steps={STEPS}", "train.warmup_steps=1", "logging.console=false", "logging.tensorboard=false",
        "checkpoint.save_at_end=false", *over])
    job, runtime = loongforge.build_job(recipe, output_dir=run_dir)
    try:
        losses = [job.step()["loss"] for _ in range(STEPS)]
        config = next(m for m in job.chunks[0].modules() if isinstance(m, TransformerBlock)).config
    finally:
        job.close()
        runtime.logger.close()
    return {"losses": losses, **counts, "config": (config.recompute_granularity, config.recompute_method,
                                                  config.recompute_num_layers, config.recompute_modules)}


def _train(ranks, tmp_path: Path, recipe: str, name: str, *over: str, world: int = 1) -> dict:
    return ranks(_train_child, world=world, out=tmp_path / f"{name}-ranks", recipe=recipe, run_dir=tmp_path / name,
                 over=list(over))[0]


# (recipe, micro-batches a step, layers)
LLAMA = ("llm/tiny/llama_tiny.yaml", 8 // 2, 4)
DIT = ("diffusion/dit_tiny.yaml", 16 // 4, 2)


@pytest.mark.parametrize(("model", "over", "config", "per_micro_batch"), [
    (LLAMA, ["parallel.recompute=full"], ("full", "uniform", 1), 4),  # each of the 4 layers
    (LLAMA, ["parallel.recompute=full", "parallel.recompute_layers=2"], ("full", "uniform", 2), 2),
    (LLAMA, ["parallel.recompute=selective"], ("selective", None, None), 4),  # each layer's core attention
    (DIT, ["parallel.recompute=full"], ("full", "uniform", 1), 2),
], ids=["full", "full-2-layers", "selective", "dit-full"])
def test_recompute_trains_the_losses_without_it(tmp_path, ranks, model, over, config, per_micro_batch):
    """One process: megatron's config has the recompute the recipe asked for, each checkpointed function runs twice
    (forward, backward) and the losses equal those of the run without recompute (same seed)."""
    recipe, micro_batches, _ = model
    plain = _train(ranks, tmp_path, recipe, "plain")
    assert plain["checkpoints"] == 0 and plain["config"][0] is None, plain
    got = _train(ranks, tmp_path, recipe, "recompute", *over)
    assert got["config"][:3] == config, got["config"]
    if config[0] == "selective":
        assert got["config"][3] == ["core_attn"], got["config"]
    assert got["checkpoints"] == STEPS * micro_batches * per_micro_batch, got
    assert got["runs"] == 2 * got["checkpoints"], got  # every checkpointed function ran again in the backward
    # NOTE: bitwise: the backward recomputes the forward with the same operations (no dropout in these models)
    assert got["losses"] == plain["losses"], (plain["losses"], got["losses"])


def test_recompute_under_tensor_and_sequence_parallelism(tmp_path, ranks):
    """Full recompute under the 8B recipes' layout (tp 2 + sp; 2 gloo processes): the same losses as
    without it; each rank recomputes each of the 4 layers of every micro-batch."""
    layout = ["parallel.tp=2", "parallel.sp=true"]
    plain = _train(ranks, tmp_path, LLAMA[0], "plain", *layout, world=2)
    got = _train(ranks, tmp_path, LLAMA[0], "recompute", *layout, "parallel.recompute=full", world=2)
    assert got["config"][:3] == ("full", "uniform", 1)
    assert got["checkpoints"] == STEPS * LLAMA[1] * LLAMA[2] and got["runs"] == 2 * got["checkpoints"], got
    assert got["losses"] == plain["losses"], (plain["losses"], got["losses"])
