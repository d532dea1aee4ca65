"""A failure on one rank in the middle of training ends every rank in bounded time: the failing rank does not wait
for its peers in a barrier (they are in a collective of the step), so its closed connections stop them."""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.slow


def _train(*, rank: int, world: int, recipe_path: str, run_dir: str) -> tuple[str, float]:
    import loongforge
    from loongforge.errors import RecipeError

    job, _ = loongforge.build_job(loongforge.load_recipe(recipe_path), output_dir=run_dir)
    if rank == 1:
        real = job.schedule.microbatches

        def broken(step, **kw):
            if step == 1:
                raise RecipeError("data/train.bin: sample 9 is unreadable")
            return real(step, **kw)

        job.schedule.microbatches = broken
    start = time.monotonic()
    try:
        job.run()
        outcome = "finished"
    except Exception as exc:  # noqa: BLE001 - what each rank saw is the result
        outcome = type(exc).__name__
    finally:
        job.close()
    return outcome, time.monotonic() - start


def test_one_rank_failing_mid_run_ends_every_rank(tmp_path, tiny_hf, recipe, ranks):
    hf = tiny_hf("llama", tmp_path / "hf")
    r = recipe(tmp_path / "r.yaml", hf, steps=4)
    out = ranks(_train, world=2, out=tmp_path / "ranks", timeout_s=240, recipe_path=str(r), run_dir=str(tmp_path / "run"))
    assert out[1][0] == "RecipeError" and out[0][0] != "finished", out
    assert max(t for _, t in out) < 120, out
