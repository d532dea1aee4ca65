"""train.fp8 on the embodied backend without a GPU: the policy-file and compile refusals at validate, and the
one-line CPU refusal when the job is built; ``loongforge_kernels``' GPU tests run the FP8 linears themselves."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

RECIPE = str(Path(__file__).resolve().parents[3] / "recipes" / "embodied" / "tiny_vla_synthetic.yaml")


def _cli(*args: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-m", "loongforge", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.parametrize("override,key", [("train.fp8.policy=p.json", "train.fp8.policy"),
                                          ("train.compile=true", "train.fp8")])
def test_refused_at_validate(tmp_path, override, key):
    r = _cli("validate", RECIPE, "train.fp8.recipe=tensorwise", override, cwd=tmp_path)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and f"key '{key}'" in last, r.stderr[-2000:]


def test_fp8_on_cpu_fails_with_one_line(tmp_path):
    r = _cli("train", RECIPE, "--output", "out", "train.fp8.recipe=rowwise", "train.steps=3", "accelerator=cpu",
             cwd=tmp_path)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and "train.fp8" in last and "cpu" in last, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
