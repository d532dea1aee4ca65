"""The embodied backend installed alone (README, "Install only what you need": core + embodied + kernels, into a
fresh venv) trains its tiny recipe, pulls no megatron-core, and names the ``[eval]`` extra that ``eval`` needs."""

from __future__ import annotations

import re

import pytest
from fresh_venv import REPO, fresh_venv, run

RECIPE = REPO / "recipes" / "embodied" / "tiny_vla_synthetic.yaml"


@pytest.mark.slow
def test_embodied_installs_alone_and_trains(tmp_path):
    venv = fresh_venv(tmp_path)
    packages = [REPO / "packages" / name for name in ("loongforge-core", "loongforge-embodied", "loongforge-kernels")]
    inst = venv.install(*packages)
    assert inst.returncode == 0, inst.stderr[-2000:]
    installed = venv.installed()
    assert "transformers" in installed and not installed & {"megatron-core", "diffusers", "openpi-client"}, installed

    out = tmp_path / "run"
    proc = run([venv.cli, "train", RECIPE, "train.steps=2", "train.warmup_steps=0", "--output", out])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 2/2" in proc.stderr and (out / "checkpoints" / "step_00000002").is_dir()

    ev = run([venv.cli, "eval", RECIPE, "--policy", "random", "--episodes", "1", "--output", tmp_path / "eval"])
    assert ev.returncode == 2 and ev.stderr.count("\n") == 1, ev.stderr[-2000:]
    assert "loongforge-embodied[eval]" in ev.stderr and "Traceback" not in ev.stderr
    needs = run([venv.cli, "validate", REPO / "recipes" / "quickstart" / "llama_stdlib.yaml"])
    assert needs.returncode == 2 and "uv pip install ./packages/loongforge-megatron" in needs.stderr, needs.stderr

    # the command the message names installs the extra, and eval then runs an episode
    inst = venv.install_line(ev.stderr.split("from a LoongForge checkout: ")[1].rstrip(")\n"))
    assert inst.returncode == 0, inst.stderr[-2000:]
    ev = run([venv.cli, "eval", RECIPE, "--policy", "random", "--episodes", "1", "--workers", "1", "--videos", "0",
              "--output", tmp_path / "eval"])
    assert ev.returncode == 0 and re.search(r"success [01]/1 ", ev.stdout), ev.stderr[-2000:]
