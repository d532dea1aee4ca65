"""Every patch of a library goes through the adaptation door and lasts one run: while a job runs, the door lists
each adaptation its backend moved there; after it, the megatron / transformers / lerobot / torch objects are the
originals again and nothing is listed. The jobs run in a fresh interpreter (never in pytest's process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A job in a fresh interpreter: the targets' objects before, the door's list while the job is built, the same
# objects after run + close.
_DRIVER = r"""
import json, sys
import torch
from loongforge import api
from loongforge.accelerator.adaptation import active, resolve

recipe_path, out, overrides, targets = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])

def raw(target):
    owner, attr = resolve(target)
    return owner.__dict__.get(attr, getattr(owner, attr)) if isinstance(owner, type) else getattr(owner, attr)

before = {t: raw(t) for t in targets}
recipe = api.load_recipe(recipe_path, overrides)
job, runtime = api.build_job(recipe, output_dir=out)
during = active()
changed = sorted(t for t in targets if raw(t) is not before[t])
try:
    job.run()
finally:
    job.close()
    if runtime.logger is not None:
        runtime.logger.close()
print(json.dumps({"during": during, "changed_during": changed, "after": active(),
                  "restored": sorted(t for t in targets if raw(t) is before[t]),
                  "tensor_dict": sorted(k for k in ("type", "cuda") if k in vars(torch.Tensor))}))
"""


def _run(tmp_path: Path, recipe: str, overrides: list[str], targets: list[str]) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-c", _DRIVER, str(ROOT / recipe), str(tmp_path / "run"),
                           json.dumps(overrides), json.dumps(targets)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_megatron_llava_run_lists_and_undoes_its_adaptations(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core")
    targets = ["megatron.core.models.multimodal.llava_model.CLIPViTModel", "torch.Tensor.type", "torch.Tensor.cuda",
               "megatron.core.optimizer.optimizer.clip_grad_by_total_norm_fp32",
               "megatron.core.pipeline_parallel.schedules.torch"]
    got = _run(tmp_path, "recipes/vlm/llava_tiny.yaml", ["train.steps=2", "train.warmup_steps=1", "logging.interval=1"], targets)
    assert {"llava-clip-torch-norms", "tensor-type-cuda-names", "tensor-cuda-identity", "clip-grad-types",
            "cuda-devices:schedules"} <= set(got["during"])
    assert got["changed_during"] == sorted(targets)
    assert got["after"] == [] and got["restored"] == sorted(targets) and got["tensor_dict"] == []


def test_embodied_pi05_run_lists_and_undoes_its_adaptations(tmp_path: Path) -> None:
    pytest.importorskip("lerobot")
    targets = ["lerobot.policies.pi05.modeling_pi05.compute_layer_complete", "lerobot.policies.pi05.modeling_pi05.torch",
               "lerobot.policies.pi_gemma.create_causal_mask",
               "lerobot.policies.pi05.modeling_pi05.PI05Policy._fix_pytorch_state_dict_keys"]
    got = _run(tmp_path, "recipes/embodied/lerobot_pi05_tiny.yaml",
               ["train.steps=2", "checkpoint.save_format=[hf]", "logging.tensorboard=false"], targets)
    from importlib.metadata import version

    expected = {"pi05-joint-layer", "pi05-async-masks"}
    assert expected <= set(got["during"]), got
    assert set(got["changed_during"]) >= {targets[0], targets[1]}
    assert got["after"] == [] and got["restored"] == sorted(targets), (got, version("transformers"))
