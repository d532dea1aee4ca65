"""The kernels package installed alone with core (README, "Install only what you need"), into a fresh venv: its
providers register, and the registry runs an op on the CPU (the plain-torch reference) with no backend installed."""

from __future__ import annotations

import json

import pytest
from fresh_venv import REPO, fresh_venv, run

# run in the venv: rms_norm through the core's registry, against the formula, and the providers it found
CHECK = """
import json
import torch
from loongforge import registry
from loongforge.kernels import select
who, rms_norm = select("rms_norm", device_type="cpu")
x, w = torch.randn(3, 8, generator=torch.Generator().manual_seed(0)), torch.rand(8) + 0.5
want = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * w
torch.testing.assert_close(rms_norm(x, w, 1e-6), want)
print(json.dumps([who, registry.kernels.keys(), registry.backends.keys()]))
"""


@pytest.mark.slow
def test_kernels_install_alone_and_serve_an_op_on_cpu(tmp_path):
    venv = fresh_venv(tmp_path)
    inst = venv.install(REPO / "packages" / "loongforge-core", REPO / "packages" / "loongforge-kernels")
    assert inst.returncode == 0, inst.stderr[-2000:]
    installed = venv.installed()
    assert "triton" in installed and not installed & {"megatron-core", "lerobot", "diffusers"}, installed

    out = run([venv.python, "-c", CHECK])
    assert out.returncode == 0, out.stderr[-3000:]
    # NOTE: Triton kernels need a GPU or TRITON_INTERPRET=1, so `auto` picks the torch reference on the CPU
    assert json.loads(out.stdout.splitlines()[-1]) == ["torch", ["tilelang", "torch", "triton"], []], out.stdout
