"""The guide's example plugin (examples/accelerator_plugin) installs alone into a fresh venv and runs its recipe.

Only loongforge-core and the example are installed (no backend, no kernels, no loongforge-xpu). Versions are pinned
to this environment's, so uv takes the wheels (torch included) from its cache.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parents[3]
EXAMPLE = REPO / "examples" / "accelerator_plugin"


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=540, **kw)


@pytest.mark.slow
def test_example_plugin_installs_alone_and_trains(tmp_path):
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not on PATH")
    frozen = run([uv, "pip", "freeze", "--python", sys.executable]).stdout.splitlines()
    pins = [ln for ln in frozen if "==" in ln and not ln.lower().startswith("loongforge")]
    (tmp_path / "pins.txt").write_text("\n".join(pins) + "\n")
    venv = tmp_path / "venv"
    assert run([uv, "venv", "-q", venv, "--python", sys.executable]).returncode == 0
    py, cli = venv / "bin" / "python", venv / "bin" / "loongforge"
    inst = run([uv, "pip", "install", "-q", "--python", py, "-c", tmp_path / "pins.txt",
                REPO / "packages" / "loongforge-core", EXAMPLE])
    assert inst.returncode == 0, inst.stderr[-2000:]

    listing = run([cli, "plugins"]).stdout
    assert "mydevice     loongforge-mydevice" in listing and "[available]" in listing
    assert "toy" in listing and "kunlun" not in listing and "loongforge_megatron" not in listing

    # a core-only install pulls no backend dependency, and a recipe naming a missing backend says what to install
    installed = {ln.split("==")[0].lower() for ln in run([uv, "pip", "freeze", "--python", py]).stdout.splitlines()}
    assert not installed & {"megatron-core", "lerobot", "diffusers"}, installed
    recipe = tmp_path / "megatron.yaml"
    recipe.write_text("backend: megatron\nmodel: {preset: llama-tiny}\n")
    needs = run([cli, "validate", recipe])
    assert needs.returncode == 2 and needs.stderr.count("\n") == 1, needs.stderr
    assert "pip install ./packages/loongforge-megatron" in needs.stderr and "Traceback" not in needs.stderr
    # the embodied backend resolves without megatron-core
    dry = run([uv, "pip", "install", "--dry-run", "--python", py, "-c", tmp_path / "pins.txt",
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
