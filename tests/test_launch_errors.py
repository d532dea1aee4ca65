"""A user error inside the workers of a multi-process run reads like a one-process one: the cause once, one line,
exit 2 — no traceback from the peer whose connection closed, none from torchrun — and a failed run leaves the
run directory's recipe.yaml as it was."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

RECIPES = Path(__file__).resolve().parents[1] / "recipes" / "llm" / "tiny"


def loongforge(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "loongforge", *args], capture_output=True, text=True, timeout=600,
                          env=env)


def test_worker_error_is_one_line_once(tmp_path):
    out = loongforge("train", str(RECIPES / "llama_tiny.yaml"), "--nproc", "2", "--output", str(tmp_path / "run"),
                     "data.format=pretrain", "data.path=/nonexistent/corpus")
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert len(errors) == 2 and "'/nonexistent/corpus' is not prepared" in errors[0], errors
    assert errors[1].startswith("error: training failed on one of 2 processes"), errors


def test_failed_resume_keeps_the_run_recipe(tmp_path):
    run = tmp_path / "run"
    done = loongforge("train", str(RECIPES / "llama_tiny.yaml"), "--output", str(run), "train.steps=2",
                      "checkpoint.save_at_end=true")
    assert done.returncode == 0, done.stderr[-3000:]
    before = (run / "recipe.yaml").read_text()
    bad = loongforge("train", str(RECIPES / "llama_tiny.yaml"), "--output", str(run), "train.steps=3",
                     "model.ffn_hidden_size=96")
    assert bad.returncode == 2 and "does not match this recipe's model" in bad.stderr, bad.stderr[-2000:]
    assert (run / "recipe.yaml").read_text() == before
