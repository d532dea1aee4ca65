"""``data.num_workers``: a DataLoader worker killed mid-run costs one step made in-process; the run goes on with
new workers and its losses are an uninterrupted run's.

NOTE: the jobs run in a rank (``ranks``), never in pytest's own process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from pathlib import Path

import loongforge
import pytest

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "llm" / "tiny" / "llama_tiny.yaml"
OVER = ["train.steps=5", "train.global_batch_size=4", "train.micro_batch_size=2", "logging.tensorboard=false",
        "logging.console=false", "data.seq_length=32"]


def _run(*, workers, kill_before, run_dir):
    """(every step's loss, the data workers started before the kill, those started after it). Before step
    ``kill_before`` one data worker is SIGKILLed: it dies while that step runs."""
    job, runtime = loongforge.build_job(loongforge.load_recipe(RECIPE, [*OVER, f"data.num_workers={workers}"]),
                                        output_dir=run_dir)
    losses, before, after = [], set(), set()
    try:
        for step in range(job.recipe.train.steps):
            if step == kill_before:
                before = {p.pid for p in mp.active_children()}
                assert len(before) == workers, before
                os.kill(min(before), signal.SIGKILL)
            losses.append(job.step()["loss"])
            after |= {p.pid for p in mp.active_children()} - before
        return losses, before, after
    finally:
        job.close()
        runtime.logger.close()


def _both(*, rank, world, run_dir):
    return _run(workers=0, kill_before=None, run_dir=run_dir / "here"), _run(workers=2, kill_before=1,
                                                                             run_dir=run_dir / "ahead")


@pytest.mark.slow  # NOTE: a rank, two short jobs and their spawned workers: about a minute on two cores
def test_sigkilled_data_worker_costs_one_step_made_in_process(tmp_path, ranks):
    (here, _, _), (ahead, before, after) = ranks(_both, world=1, out=tmp_path / "ranks", run_dir=tmp_path / "run")[0]
    assert ahead == here, (ahead, here)
    assert len(before) == 2 and len(after) >= 2, (before, after)  # NOTE: the workers were started again
