"""What a run prints and does on a rerun: rates and ETA over the logging interval, a finished ``--output`` left as
it is (unless ``--rerun``), and ``train.steps`` below the run's checkpoint refused in one line."""

from __future__ import annotations

import json
import re

from loongforge.checkpoint.atomic import atomic_checkpoint
from loongforge.cli import main
from loongforge.metrics import MetricsLogger


class _Config:
    interval, console, jsonl, tensorboard = 4, True, True, False


def test_rates_are_averaged_over_the_logging_interval_and_step_one_has_an_eta(tmp_path, capsys):
    log = MetricsLogger(tmp_path, config=_Config(), total_steps=8)
    # one slow step in the interval: one step's tokens / dt would print 100 tok/s at step 4
    times = [1.0, 0.5, 0.5, 2.0, 0.5, 0.5, 0.5, 0.5]
    for step, dt in enumerate(times, 1):
        log.log(step, {"loss": 1.0, "step_time": dt, "tokens_per_s": 200.0 / dt, "images_per_s": 2.0 / dt, "mfu": 0.1 / dt})
    log.close()
    records = {r["step"]: r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())}
    assert sorted(records) == [1, 4, 8]
    assert records[1]["tokens_per_s"] == 200.0  # the first interval is step 1 alone
    assert records[4]["tokens_per_s"] == 3 * 200.0 / 3.0  # steps 2-4: 600 tokens in 3 s
    assert records[4]["images_per_s"] == 2.0 and abs(records[4]["mfu"] - 0.1) < 1e-12
    assert records[8]["tokens_per_s"] == 400.0 and records[8]["step_time"] == 0.5  # step_time stays the step's own
    lines = capsys.readouterr().err.splitlines()
    assert re.search(r"step 1/8 .*ETA 7s", lines[0]), lines[0]  # step 1: its own step time x 7 steps left
    assert "ETA 0s" not in lines[0]
    assert "2.0 images/s" in lines[0] and lines[0].index("images/s") < lines[0].index("tok/s")
    assert "ETA" not in lines[-1]  # the last step: nothing left


def _recipe(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("backend: toy\ntrain: {steps: 6, lr: 0.1, global_batch_size: 2}\naccelerator: cpu\n"
                      "logging: {tensorboard: false}\n")
    return recipe


def _checkpoint(out, step):
    with atomic_checkpoint(out / "checkpoints", f"step_{step:08d}") as staging:
        (staging / "state").write_text("x")


def test_a_finished_run_is_reported_and_left_alone_unless_rerun(tmp_path, toy_backend, capsys):
    recipe, out = _recipe(tmp_path), tmp_path / "run"
    assert main(["train", str(recipe), "--output", str(out)]) == 0
    _checkpoint(out, 6)  # NOTE: the toy backend saves none; a real one leaves step_00000006 at the end
    lines = len((out / "metrics.jsonl").read_text().splitlines())
    capsys.readouterr()
    assert main(["train", str(recipe), "--output", str(out)]) == 0
    err = capsys.readouterr().err
    assert "already finished" in err and "--rerun" in err and "step 1/6" not in err
    assert len((out / "metrics.jsonl").read_text().splitlines()) == lines  # nothing trained, saved or exported
    assert main(["train", str(recipe), "--output", str(out), "train.steps=8"]) == 0  # more steps: it trains
    assert main(["train", str(recipe), "--output", str(out), "--rerun"]) == 0
    assert "step 6/6" in capsys.readouterr().err


def test_train_steps_below_the_checkpoint_is_refused_in_one_line(tmp_path, toy_backend, capsys):
    recipe, out = _recipe(tmp_path), tmp_path / "run"
    _checkpoint(out, 6)
    assert main(["train", str(recipe), "--output", str(out), "train.steps=4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "key 'train.steps'" in err and "6 steps are done" in err
    assert main(["train", str(recipe), "--output", str(out), "train.steps=4", "checkpoint.resume=never"]) == 0
