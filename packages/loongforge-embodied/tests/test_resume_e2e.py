"""End to end through the CLI: record PushT with ``loongforge data prepare``, train on it, resume exactly after
SIGKILL, and load the exported policy with LeRobot's ``from_pretrained``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "recipes" / "embodied" / "tiny_vla_pusht.yaml"


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "loongforge", *args]


def _losses(run: Path) -> dict[int, float]:
    from loongforge.metrics import read_metrics

    return {r["step"]: r["loss"] for r in read_metrics(run)}


@pytest.mark.slow
def test_prepare_train_kill_resume_export(tmp_path, env):
    data = tmp_path / "pusht"
    common = [f"data.root={data}", "train.steps=8", "checkpoint.save_interval=2", "logging.interval=1",
              "logging.tensorboard=false", "data.num_workers=0"]
    prep = subprocess.run(_cli("data", "prepare", str(RECIPE), f"data.root={data}", "data.record.episodes=3",
                               "data.record.max_steps=30"), env=env, capture_output=True, text=True, timeout=300)
    assert prep.returncode == 0, prep.stderr[-3000:]
    info = json.loads((data / "meta" / "info.json").read_text())
    assert info["total_episodes"] == 3 and info["codebase_version"].startswith("v3")

    ref = tmp_path / "ref"
    proc = subprocess.run(_cli("train", str(RECIPE), "--output", str(ref), *common), env=env,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = _losses(ref)
    assert sorted(expected) == list(range(1, 9))

    # Kill the second run hard once step 5 is logged (a checkpoint at step 4 exists), then resume it.
    run = tmp_path / "killed"
    victim = subprocess.Popen(_cli("train", str(RECIPE), "--output", str(run), *common), env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 400
    while time.time() < deadline and victim.poll() is None:
        if (run / "metrics.jsonl").is_file() and 5 in _losses(run):
            os.killpg(victim.pid, signal.SIGKILL)
            break
        time.sleep(0.2)
    victim.wait(timeout=30)
    assert victim.returncode == -signal.SIGKILL, "training finished before it could be killed"
    resumed = subprocess.run(_cli("train", str(RECIPE), "--output", str(run), *common), env=env,
                             capture_output=True, text=True, timeout=400)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed at step" in resumed.stderr
    # Exact: same data position, RNG, optimizer and weights -> bit-identical losses.
    assert _losses(run) == expected

    # a fresh interpreter that imports nothing of ours: LeRobot's own plugin discovery registers the policy type,
    # its factory builds the policy from the export for the PushT env, with every tensor of the file in place
    check = subprocess.run([sys.executable, "-c", (
        "import sys, torch\n"
        "from lerobot.utils.import_utils import register_third_party_plugins\n"
        "register_third_party_plugins()\n"
        "from lerobot.configs.policies import PreTrainedConfig\n"
        "from lerobot.envs.configs import PushtEnv\n"
        "from lerobot.policies.factory import get_policy_class, make_policy\n"
        "from safetensors.torch import load_file\n"
        "cfg = PreTrainedConfig.from_pretrained(sys.argv[1])\n"
        "cfg.pretrained_path = sys.argv[1]\n"
        "p = make_policy(cfg, env_cfg=PushtEnv())\n"
        "strict = get_policy_class(cfg.type).from_pretrained(sys.argv[1], strict=True)  # no missing / unexpected\n"
        "from loongforge_embodied.policies import siglip_names  # the loader's renaming of SigLIP's keys\n"
        "got = p.state_dict()\n"
        "want = siglip_names.match(load_file(sys.argv[1] + '/model.safetensors'), got.keys())\n"
        "assert sorted(want) == sorted(got) == sorted(strict.state_dict()), sorted(set(want) ^ set(got))\n"
        "assert all(torch.equal(got[k], want[k]) for k in want)\n"
        "b = {'observation.image': torch.rand(2, 3, 64, 64), 'observation.state': torch.rand(2, 2) * 500,\n"
        "     'task': ['Push the T-shaped block onto the target.'] * 2}\n"
        "a = p.select_action(b)\n"
        "assert a.shape == (2, 2) and torch.isfinite(a).all(), a\n"
        "print('OK', type(p).__name__)\n"), str(run / "hf")], env=env, capture_output=True, text=True, timeout=300)
    assert check.returncode == 0 and "OK TinyVLAPolicy" in check.stdout, check.stderr[-3000:]
