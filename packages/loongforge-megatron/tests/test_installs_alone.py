"""The megatron backend installed alone (README, "Install only what you need": core + megatron + kernels, into a
fresh venv) trains its tiny recipe and pulls no LeRobot; DiT recipes name the ``[diffusion]`` extra until it is
installed, then validate.

Versions are pinned to this environment's, so uv takes every wheel (torch included) from its cache.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parents[3]


def run(cmd: list, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=540, **kw)


@pytest.mark.slow
def test_megatron_installs_alone_and_trains(tmp_path):
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not on PATH")
    frozen = run([uv, "pip", "freeze", "--python", sys.executable]).stdout.splitlines()
    pins = tmp_path / "pins.txt"
    pins.write_text("\n".join(ln for ln in frozen if "==" in ln and not ln.lower().startswith("loongforge")) + "\n")
    venv = tmp_path / "venv"
    assert run([uv, "venv", "-q", venv, "--python", sys.executable]).returncode == 0
    py, cli = venv / "bin" / "python", venv / "bin" / "loongforge"
    packages = [REPO / "packages" / name for name in ("loongforge-core", "loongforge-megatron", "loongforge-kernels")]
    inst = run([uv, "pip", "install", "-q", "--python", py, "-c", pins, *packages])
    assert inst.returncode == 0, inst.stderr[-2000:]
    installed = {ln.split("==")[0].lower() for ln in run([uv, "pip", "freeze", "--python", py]).stdout.splitlines()}
    assert "megatron-core" in installed and not installed & {"lerobot", "diffusers"}, installed

    out = tmp_path / "run"
    proc = run([cli, "train", "llm/tiny/llama_tiny.yaml", "train.steps=2", "--output", out], cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 2/2" in proc.stderr and "tok/s" in proc.stderr

    dit = run([cli, "validate", "diffusion/dit_tiny.yaml"], cwd=REPO)
    assert dit.returncode == 2 and dit.stderr.count("\n") == 1, dit.stderr[-2000:]
    assert "loongforge-megatron[diffusion]" in dit.stderr and "Traceback" not in dit.stderr
    inst = run([uv, "pip", "install", "-q", "--python", py, "-c", pins,
                f"{REPO / 'packages' / 'loongforge-megatron'}[diffusion]"])
    assert inst.returncode == 0, inst.stderr[-2000:]
    assert run([cli, "validate", "diffusion/dit_tiny.yaml"], cwd=REPO).returncode == 0
