"""Acceptance: every parallel layout of the megatron backend (2 gloo processes, tiny models, fp32, the loongforge
spec: SDPA attention + fused kernels + fused linear cross-entropy) gives the single-process losses over 5 steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

RECIPES = Path(__file__).resolve().parents[1] / "recipes" / "llm" / "tiny"
REL_TOL = 1e-5  # relative, per step; reduction order differs between layouts

LAYOUTS = {
    "tp2_sp": ("llama_tiny.yaml", ["parallel.tp=2", "parallel.sp=true"]),
    "pp2_vpp2": ("llama_tiny.yaml", ["parallel.pp=2", "parallel.vpp=2"]),
    "dp2_distopt": ("llama_tiny.yaml", ["parallel.distributed_optimizer=true", "parallel.dp=2"]),
    "cp2": ("llama_tiny.yaml", ["parallel.cp=2"]),
    "ep2_moe": ("qwen3_moe_tiny.yaml", ["parallel.ep=2"]),
}


def train(recipe: str, overrides: list[str], out: Path, nproc: int) -> list[dict]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "loongforge", "train", str(RECIPES / recipe), "--output", str(out), "--nproc", str(nproc),
           "accelerator=cpu", "kernels.spec=loongforge", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    cache: dict[str, list[dict]] = {}

    def get(recipe: str) -> list[dict]:
        if recipe not in cache:
            cache[recipe] = train(recipe, [], tmp_path_factory.mktemp("ref"), 1)
        return cache[recipe]

    return get


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(layout, references, tmp_path):
    recipe, overrides = LAYOUTS[layout]
    ref = references(recipe)
    got = train(recipe, overrides, tmp_path / layout, 2)
    assert [r["step"] for r in got] == [r["step"] for r in ref] == [1, 2, 3, 4, 5]
    for a, b in zip(got, ref, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=REL_TOL), (layout, a["step"], a["loss"], b["loss"])
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), (layout, a["step"])
    assert all(r["loss"] == r["loss"] and r["grad_norm"] < 1e6 for r in got)  # finite
