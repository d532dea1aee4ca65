"""One kernel-selection rule for every shipped op, through the recipe's ``kernels.provider`` and through ``auto``,
on the CPU, for the megatron and the embodied backend alike: an explicit request that cannot be met raises, an
automatic one falls back (here: to the torch provider)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from loongforge.errors import PluginError
from loongforge.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]
LLM = ROOT / "recipes" / "llm" / "tiny" / "llama_tiny.yaml"
VLA = ROOT / "recipes" / "embodied" / "tiny_vla_synthetic.yaml"

pytest.importorskip("loongforge_kernels")
from loongforge_kernels import _dispatch  # noqa: E402
from loongforge_kernels.providers import OPS, TRITON_OPS  # noqa: E402

no_interpreter = pytest.mark.skipif(_dispatch.interpreter_active(), reason="Triton's interpreter runs triton on CPU")
EMBODIED_OPS = ("adamw", "fp8_delta_encode", "fp8_delta_apply", "fp8_linear")
MEGATRON_OPS = tuple(op for op in OPS if op not in EMBODIED_OPS or op == "fp8_linear")  # NOTE: FP8 linears: both


def _pinned(impl, name: str) -> bool:
    return impl.keywords.get("impl") == name


def test_every_shipped_op_has_one_record_per_provider():
    from loongforge_kernels.providers import TorchProvider, TritonProvider

    assert set(EMBODIED_OPS) <= set(OPS)  # AdamW, the FP8 codec and the FP8 linears are ops of the registry too
    assert {"fp8_linear", "fp8_grouped_linear"} <= set(MEGATRON_OPS)
    assert set(TorchProvider().ops()) == set(OPS)
    assert set(TritonProvider().ops()) == set(OPS) | set(TRITON_OPS)  # NOTE: adamw_plan is the Triton kernel's


def _megatron(op: str, provider: str):
    from loongforge_megatron.layers.modules import kernel

    return kernel(op, provider=load_recipe(LLM, [f"kernels.provider={provider}"]).kernels.provider, device_type="cpu")


def _embodied(op: str, provider: str):
    from loongforge_embodied.kernels import choose

    recipe = load_recipe(VLA, [f"kernels.provider={provider}"])
    return choose(op, provider=recipe.kernels.provider, device_type="cpu").impl


@no_interpreter
@pytest.mark.parametrize(("backend", "op"), [("megatron", op) for op in MEGATRON_OPS]
                         + [("embodied", op) for op in EMBODIED_OPS])
def test_explicit_requests_raise_and_auto_falls_back(backend, op):
    pytest.importorskip({"megatron": "loongforge_megatron", "embodied": "loongforge_embodied"}[backend])
    select = _megatron if backend == "megatron" else _embodied
    assert _pinned(select(op, "torch"), "torch")
    assert _pinned(select(op, "auto"), "torch")  # triton cannot run CPU tensors here: auto falls back
    with pytest.raises(PluginError, match="kernel provider 'triton' cannot run on cpu"):
        select(op, "triton")
    with pytest.raises(PluginError, match="kernel provider 'tilelang' (cannot run on cpu|has no op)"):
        select(op, "tilelang")


@no_interpreter
def test_embodied_optimizer_follows_the_rule():
    import torch
    from loongforge_embodied.optim import KernelAdamW, make_optimizer

    params = [{"params": [torch.nn.Parameter(torch.ones(3))], "weight_decay": 0.0}]
    t = load_recipe(VLA).train
    for provider in ("auto", "torch"):
        opt = make_optimizer(params, t, device_type="cpu", kernels=provider)
        assert type(opt) is torch.optim.AdamW and not isinstance(opt, KernelAdamW)
    with pytest.raises(PluginError, match="triton"):
        make_optimizer(params, t, device_type="cpu", kernels="triton")


@no_interpreter
def test_embodied_run_with_an_unmet_provider_is_one_clear_error(tmp_path):
    """Through ``loongforge train``: exit 2, one line naming kernels.provider (in a fresh interpreter)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-m", "loongforge", "train", str(VLA), "--output", str(tmp_path / "run"),
                           "kernels.provider=triton", "train.steps=1", "train.warmup_steps=0"],
                          env=env, capture_output=True, text=True, timeout=300)
    err = [line for line in proc.stderr.splitlines() if "kernels.provider" in line]
    assert proc.returncode == 2 and len(err) == 1 and "triton" in err[0], proc.stderr[-3000:]
