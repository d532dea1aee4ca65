"""The megatron backend installed alone (README, "Install only what you need": core + megatron + kernels, into a
fresh venv) trains its tiny recipe and pulls no LeRobot; DiT recipes name the ``[diffusion]`` extra until it is
installed, then validate."""

from __future__ import annotations

import pytest
from fresh_venv import REPO, fresh_venv, run


@pytest.mark.slow
def test_megatron_installs_alone_and_trains(tmp_path):
    venv = fresh_venv(tmp_path)
    packages = [REPO / "packages" / name for name in ("loongforge-core", "loongforge-megatron", "loongforge-kernels")]
    inst = venv.install(*packages)
    assert inst.returncode == 0, inst.stderr[-2000:]
    installed = venv.installed()
    assert "megatron-core" in installed and not installed & {"lerobot", "diffusers"}, installed

    out = tmp_path / "run"
    proc = run([venv.cli, "train", "llm/tiny/llama_tiny.yaml", "train.steps=2", "--output", out], cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 2/2" in proc.stderr and "tok/s" in proc.stderr

    dit = run([venv.cli, "validate", "diffusion/dit_tiny.yaml"], cwd=REPO)
    assert dit.returncode == 2 and dit.stderr.count("\n") == 1, dit.stderr[-2000:]
    assert "loongforge-megatron[diffusion]" in dit.stderr and "Traceback" not in dit.stderr
    inst = venv.install(f"{REPO / 'packages' / 'loongforge-megatron'}[diffusion]")
    assert inst.returncode == 0, inst.stderr[-2000:]
    assert run([venv.cli, "validate", "diffusion/dit_tiny.yaml"], cwd=REPO).returncode == 0
