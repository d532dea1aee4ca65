"""MetaWorld (MuJoCo): one Sawyer-arm task, goal observable, with MetaWorld's own scripted expert as the reference
that must succeed. Success is MetaWorld's ``info["success"]``. Renders offline through MuJoCo's EGL (or OSMesa:
``MUJOCO_GL=osmesa``) context."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from loongforge_embodied.eval.envs.base import Step


def _policy_class_name(task: str) -> str:
    """``reach-v3`` → ``SawyerReachV3Policy`` (MetaWorld's naming of its scripted policies)."""
    return "Sawyer" + "".join(p.capitalize() for p in task.split("-")) + "Policy"


class MetaWorldAdapter:
    """``metaworld`` v3 ``<task>-goal-observable``; LeRobot's metaworld feature names: ``observation.image`` (the
    scene camera, uint8 (S, S, 3)), ``observation.state`` (hand xyz + gripper opening: the first 4 of MetaWorld's
    39-d observation) and the privileged ``observation.environment_state`` (all 39: hand, objects' poses, goal).
    Actions: hand xyz delta + gripper effort in [-1, 1]. Episode ``seed`` seeds the task's random start (object and
    goal positions), whichever process runs it."""

    name = "metaworld"
    max_steps = 500  # MetaWorld's max_path_length
    fps = 80  # frame_skip 5 x 2.5 ms
    references = ("expert", "random")
    observation_keys = ("observation.image", "observation.state", "observation.environment_state")
    action_low, action_high = np.full(4, -1.0, np.float32), np.ones(4, np.float32)
    task = "reach-v3"
    prompt = "Reach the goal position."

    def __init__(self, *, image_size: int | None = None, render_size: int = 128):
        """``image_size``: side of ``observation.image`` (and of the video frames); None: no image per step."""
        os.environ.setdefault("MUJOCO_GL", "egl")
        from metaworld.env_dict import ALL_V3_ENVIRONMENTS_GOAL_OBSERVABLE

        self.image_size = image_size
        self.env = ALL_V3_ENVIRONMENTS_GOAL_OBSERVABLE[f"{self.task}-goal-observable"](render_mode="rgb_array")
        # NOTE: the goal-observable class builds at 480x480; the offscreen context is made on the first render
        self.env.mujoco_renderer.width = self.env.mujoco_renderer.height = image_size or render_size

    def _obs(self, raw: np.ndarray) -> dict[str, Any]:
        full = np.asarray(raw, np.float32)
        obs = {"observation.state": full[:4].copy(), "observation.environment_state": full, "prompt": self.prompt}
        if self.image_size:
            obs["observation.image"] = np.ascontiguousarray(self.env.render(), dtype=np.uint8)
        return obs

    def reset(self, seed: int) -> dict[str, Any]:
        # NOTE: the class freezes its random start after construction; unfreeze and draw it from ``seed``
        self.env._freeze_rand_vec, self.env.seeded_rand_vec = False, True
        self.env.seed(seed)
        raw, _ = self.env.reset()
        return self._obs(raw)

    def step(self, action: np.ndarray) -> Step:
        action = np.clip(np.asarray(action, np.float32).reshape(4), -1.0, 1.0)
        raw, reward, terminated, truncated, info = self.env.step(action)
        # NOTE: MetaWorld truncates itself at max_path_length; the rollout's max_steps cap comes first
        return Step(self._obs(raw), float(reward), bool(terminated), bool(info.get("success", 0.0)))

    def render(self) -> np.ndarray:
        return self.env.render()

    def close(self) -> None:
        self.env.close()

    @classmethod
    def reference_policy(cls, name: str, **options: Any):
        from loongforge_embodied.eval.protocol import vector
        from loongforge_embodied.eval.reference_policies import RandomPolicy

        if name == "expert":
            return MetaWorldExpertPolicy(cls.task)
        if name == "random":
            return RandomPolicy(low=cls.action_low, high=cls.action_high, spec={"observation.state": vector(4)})
        from loongforge.errors import LoongForgeError

        raise LoongForgeError(f"{cls.name} has no reference policy '{name}'; allowed: {', '.join(cls.references)}")


class MetaWorldExpertPolicy:
    """MetaWorld's scripted policy of the task (``metaworld.policies``), served like a trained policy: reads the
    privileged ``observation.environment_state``, answers one action per request."""

    prompt = "ignored"

    def __init__(self, task: str):
        import metaworld.policies

        from loongforge_embodied.eval.protocol import vector

        self.name = "expert"
        self._policy = getattr(metaworld.policies, _policy_class_name(task))()
        self.spec = {"observation.environment_state": vector(39)}

    def metadata(self) -> dict:
        return {"policy": self.name, "features": {k: f.to_dict() for k, f in self.spec.items()}, "action_dim": 4,
                "chunk_size": 1, "n_action_steps": 1}

    def infer_batch(self, requests: list[dict]) -> list[dict]:
        return [{"actions": np.asarray(self._policy.get_action(r["observation.environment_state"].astype(np.float64)),
                                       np.float32)[None]} for r in requests]
