"""``loongforge eval --env pusht`` of an exported policy, and the same episodes rolled out again in this process:
what the summary records per episode (success, return, length) must be what gym-pusht gave for the policy's
actions, not numbers the harness made up."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

CAMERA, STATE = "observation.image", "observation.state"  # the keys gym-pusht's adapter provides


def export_for_pusht(model, *, policy: str, out: Path) -> Path:
    """``model``'s export with PushT's camera and state keys (as a run on a recorded PushT dataset writes it)."""
    from loongforge_embodied.policies import get_policy

    get_policy(policy).export.write_pretrained(out, arch=model.arch, weights=model.state_dict(),
                                               features={"cameras": [CAMERA], "state": STATE})
    return out


def eval_pusht(export: Path, out: Path, *, episodes: int = 2, max_steps: int = 6) -> dict[str, Any]:
    """The command line's evaluation: the policy served on a free port, the episodes in one spawned worker."""
    from loongforge.cli import main

    code = main(["eval", str(export), "--env", "pusht", "--episodes", str(episodes), "--workers", "1",
                 "--max-steps", str(max_steps), "--videos", "0", "--device", "cpu", "--output", str(out)])
    assert code == 0
    return json.loads((out / "summary.json").read_text())


def rollout_again(export: Path, summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Each episode of ``summary`` from its seed, here: the policy asked directly, the env stepped directly."""
    from loongforge_embodied.eval.envs.pusht import PushTAdapter
    from loongforge_embodied.eval.trained_policy import TrainedPolicy

    policy = TrainedPolicy.load(export, device="cpu")
    env = PushTAdapter(image_size=policy.model.arch.image_size)
    episodes = []
    try:
        for seed in summary["seeds"]:
            obs, rewards, success, done = env.reset(seed), [], False, False
            while not done:
                request = {k: obs[k] for k in policy.spec} | {"prompt": obs["prompt"]}
                for action in policy.infer_batch([request])[0]["actions"][:policy.n_action_steps]:
                    step = env.step(action)
                    obs = step.observation
                    rewards.append(step.reward)
                    success = success or step.success
                    done = step.done or step.success or len(rewards) >= summary["max_steps"]
                    if done:
                        break
            episodes.append({"seed": seed, "success": success, "length": len(rewards), "sum_reward": sum(rewards),
                             "max_reward": max(rewards)})
    finally:
        env.close()
    return episodes


def check_recorded(export: Path, summary: dict[str, Any], *, policy: str) -> None:
    """The summary holds every episode, each one what the env gave, and the rates are the episodes' own."""
    per = summary["per_episode"]
    assert summary["env"] == "pusht" and summary["policy"].startswith(f"{policy}:") and summary["errors"] == []
    assert [e["seed"] for e in per] == summary["seeds"] == [100_000 + i for i in range(summary["episodes"])]
    for ours, again in zip(per, rollout_again(export, summary), strict=True):
        assert (ours["success"], ours["length"]) == (again["success"], again["length"]), (ours, again)
        assert ours["sum_reward"] == pytest.approx(again["sum_reward"], rel=1e-4, abs=1e-6), (ours, again)
        assert ours["max_reward"] == pytest.approx(again["max_reward"], rel=1e-4, abs=1e-6), (ours, again)
    assert summary["success_rate"] == sum(e["success"] for e in per) / len(per)
    assert summary["mean_return"] == pytest.approx(sum(e["sum_reward"] for e in per) / len(per))
    assert any(e["sum_reward"] > 0 for e in per)  # NOTE: the held-out seeds start with the block partly on target
