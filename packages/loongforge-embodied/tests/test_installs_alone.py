"""The embodied backend installed alone (README, "Install only what you need": core + embodied + kernels, into a
fresh venv) trains its tiny recipe, pulls no megatron-core, and names the ``[eval]`` extra that ``eval`` needs.

Versions are pinned to this environment's, so uv takes every wheel (torch included) from its cache.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parents[3]
RECIPE = REPO / "recipes" / "embodied" / "tiny_vla_synthetic.yaml"


def run(cmd: list, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=540, **kw)


@pytest.mark.slow
def test_embodied_installs_alone_and_trains(tmp_path):
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not on PATH")
    frozen = run([uv, "pip", "freeze", "--python", sys.executable]).stdout.splitlines()
    pins = [ln for ln in frozen if "==" in ln and not ln.lower().startswith("loongforge")]
    (tmp_path / "pins.txt").write_text("\n".join(pins) + "\n")
    venv = tmp_path / "venv"
    assert run([uv, "venv", "-q", venv, "--python", sys.executable]).returncode == 0
    py, cli = venv / "bin" / "python", venv / "bin" / "loongforge"
    packages = [REPO / "packages" / name for name in ("loongforge-core", "loongforge-embodied", "loongforge-kernels")]
    inst = run([uv, "pip", "install", "-q", "--python", py, "-c", tmp_path / "pins.txt", *packages])
    assert inst.returncode == 0, inst.stderr[-2000:]
    installed = {ln.split("==")[0].lower() for ln in run([uv, "pip", "freeze", "--python", py]).stdout.splitlines()}
    assert "transformers" in installed and not installed & {"megatron-core", "diffusers", "openpi-client"}, installed

    out = tmp_path / "run"
    proc = run([cli, "train", RECIPE, "train.steps=2", "train.warmup_steps=0", "--output", out])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 2/2" in proc.stderr and (out / "checkpoints" / "step_00000002").is_dir()

    ev = run([cli, "eval", RECIPE, "--policy", "random", "--episodes", "1", "--output", tmp_path / "eval"])
    assert ev.returncode == 2 and ev.stderr.count("\n") == 1, ev.stderr[-2000:]
    assert "loongforge-embodied[eval]" in ev.stderr and "Traceback" not in ev.stderr
    needs = run([cli, "validate", REPO / "recipes" / "quickstart" / "llama_stdlib.yaml"])
    assert needs.returncode == 2 and "uv pip install ./packages/loongforge-megatron" in needs.stderr, needs.stderr

    # the command the message names installs the extra, and eval then runs an episode
    install = ev.stderr.split("from a LoongForge checkout: ")[1].rstrip(")\n").replace(
        "uv pip install", f"{uv} pip install --python {py} -c {tmp_path / 'pins.txt'}", 1)
    inst = subprocess.run(["bash", "-c", install], cwd=REPO, capture_output=True, text=True, timeout=540)
    assert inst.returncode == 0, inst.stderr[-2000:]
    ev = run([cli, "eval", RECIPE, "--policy", "random", "--episodes", "1", "--workers", "1", "--videos", "0",
              "--output", tmp_path / "eval"])
    assert ev.returncode == 0 and re.search(r"success [01]/1 ", ev.stdout), ev.stderr[-2000:]
