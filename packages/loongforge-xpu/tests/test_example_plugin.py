"""The guide's example plugin (examples/accelerator_plugin) installs alone into a fresh venv and runs its recipe.

Only loongforge-core and the example are installed (no backend, no kernels, no loongforge-xpu).
"""

from __future__ import annotations

import json

import pytest
from fresh_venv import REPO, fresh_venv, run

EXAMPLE = REPO / "examples" / "accelerator_plugin"


@pytest.mark.slow
def test_example_plugin_installs_alone_and_trains(tmp_path):
    venv = fresh_venv(tmp_path)
    py, cli = venv.python, venv.cli
    inst = venv.install(REPO / "packages" / "loongforge-core", EXAMPLE)
    assert inst.returncode == 0, inst.stderr[-2000:]

    listing = run([cli, "plugins"]).stdout
    assert "mydevice     loongforge-mydevice" in listing and "[available]" in listing
    assert "toy" in listing and "kunlun" not in listing and "loongforge_megatron" not in listing

    # a core-only install pulls no backend dependency, and a recipe naming a missing backend says what to install
    installed = venv.installed()
    assert not installed & {"megatron-core", "lerobot", "diffusers"}, installed
    recipe = tmp_path / "megatron.yaml"
    recipe.write_text("backend: megatron\nmodel: {preset: llama-tiny}\n")
    needs = run([cli, "validate", recipe])
    assert needs.returncode == 2 and needs.stderr.count("\n") == 1, needs.stderr
    assert "pip install ./packages/loongforge-megatron" in needs.stderr and "Traceback" not in needs.stderr
    # the embodied backend resolves without megatron-core
    dry = run([venv.uv, "pip", "install", "--dry-run", "--python", py, "-c", venv.pins,
               REPO / "packages" / "loongforge-embodied"])
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert "lerobot" in dry.stderr + dry.stdout and "megatron-core" not in dry.stderr + dry.stdout

    out = tmp_path / "run"
    proc = run([cli, "train", EXAMPLE / "recipe.yaml", "--nproc", "2", "--output", out])
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 20 and losses[-1] < 0.2 * losses[0]

    missing = run([cli, "train", EXAMPLE / "recipe.yaml", "--output", tmp_path / "r2"],
                  env={"PATH": "/usr/bin:/bin", "MYDEVICE_FORCE_MISSING": "1"})
    assert missing.returncode == 2
    assert missing.stderr.strip() == ("error: accelerator 'mydevice' is not available: "
                                      "the mydevice runtime is not installed (pip install mydevice-runtime)")
