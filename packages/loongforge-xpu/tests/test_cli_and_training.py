"""Acceptance: ``loongforge plugins`` / a kunlun recipe without the runtime, and tiny 2-process runs on the
simulated runtime (megatron LLM; embodied when that backend is installed)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from loongforge.cli import main

REPO = Path(__file__).parents[3]

LLM = {
    "backend": "megatron",
    "model": {"family": "llama", "num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4,
              "num_query_groups": 2, "vocab_size": 256, "max_position_embeddings": 64},
    "data": {"format": "synthetic", "seq_length": 32},
    "parallel": {"tp": 2},
    "train": {"stage": "pretrain", "steps": 3, "global_batch_size": 4, "micro_batch_size": 2, "precision": "fp32",
              "lr": 1e-3, "seed": 7},
    "checkpoint": {"save_at_end": False},
    "accelerator": {"name": "kunlun", "env": {"BKCL_PCIE_RING": 1}},
    "logging": {"tensorboard": False},
}


def write(tmp_path, recipe: dict, name: str = "recipe.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_plugins_lists_kunlun_with_the_reason(capsys):
    assert main(["plugins"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("kunlun"))
    assert "loongforge-xpu" in line and "unavailable: the Kunlun runtime module 'torch_xmlir' is not installed" in line


def test_plugins_shows_kunlun_available_with_the_runtime(simulated_runtime, capsys):
    assert main(["plugins"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("kunlun"))
    assert line.endswith("[available]")


def test_recipe_without_runtime_fails_with_one_line(tmp_path, capsys):
    recipe = write(tmp_path, {**LLM, "parallel": {"tp": 1}})
    assert main(["train", str(recipe), "--nproc", "1", "--output", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [err[0]] and err[0].startswith("error: accelerator 'kunlun' is not available: ")
    assert "torch_xmlir" in err[0]


def test_bad_kunlun_variable_fails_with_one_line(tmp_path, capsys, simulated_runtime):
    recipe = write(tmp_path, {**LLM, "parallel": {"tp": 1}, "accelerator": {"name": "kunlun", "env": {"BKCL_PCIE_RNG": 1}}})
    assert main(["train", str(recipe), "--nproc", "1", "--output", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "accelerator.env.BKCL_PCIE_RNG" in err[0] and "BKCL_PCIE_RING" in err[0]


def _train(recipe, out, env) -> list[dict]:
    cmd = [sys.executable, "-m", "loongforge", "train", str(recipe), "--nproc", "2", "--output", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows and all(math.isfinite(r["loss"]) for r in rows)
    return rows


@pytest.mark.slow
def test_tiny_llm_trains_on_simulated_kunlun_with_two_processes(tmp_path, sim_env):
    rows = _train(write(tmp_path, LLM), tmp_path / "run", sim_env)
    assert [r["step"] for r in rows] == [1, 2, 3]


@pytest.mark.slow
def test_tiny_embodied_trains_on_simulated_kunlun_with_two_processes(tmp_path, sim_env):
    from loongforge import registry
    from loongforge.errors import PluginError

    try:
        registry.backends.get("embodied")
    except PluginError as exc:
        pytest.skip(f"the embodied backend is not ready in this checkout: {exc}")
    tiny = REPO / "recipes" / "embodied" / "tiny_vla_synthetic.yaml"
    if not tiny.exists():
        pytest.skip(f"{tiny} is not in this checkout")
    recipe = yaml.safe_load(tiny.read_text())
    recipe.update(accelerator={"name": "kunlun"}, checkpoint={"save_at_end": False}, logging={"tensorboard": False})
    recipe["train"].update(steps=4, warmup_steps=1)
    _train(write(tmp_path, recipe), tmp_path / "run", sim_env)
