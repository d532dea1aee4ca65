"""ALOHA (gym-aloha, MuJoCo): two arms transfer a cube or insert a peg. Success is gym-aloha's own (the task's
top reward: cube lifted and handed over; peg in socket). Renders offline through MuJoCo's EGL (or OSMesa:
``MUJOCO_GL=osmesa``) context, no display."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from loongforge_embodied.eval.envs.base import Step

TASKS = {"transfer_cube": ("gym_aloha/AlohaTransferCube-v0", "Pick up the cube and hand it to the other arm."),
         "insertion": ("gym_aloha/AlohaInsertion-v0", "Insert the peg into the socket.")}


class AlohaAdapter:
    """``gym_aloha`` with ``obs_type=pixels_agent_pos``, LeRobot's aloha_sim feature names: ``observation.images.top``
    (the top camera, uint8 (S, S, 3)) and ``observation.state`` (the 14 joint positions: per arm 6 joints and the
    gripper). Actions are the 14 target joint positions in gym-aloha's normalised [-1, 1]."""

    name = "aloha"
    max_steps = 300  # gym-aloha's own TimeLimit
    fps = 50
    references = ("random",)
    observation_keys = ("observation.images.top", "observation.state")
    action_low, action_high = np.full(14, -1.0, np.float32), np.ones(14, np.float32)
    task = "transfer_cube"

    def __init__(self, *, image_size: int | None = None, render_size: tuple[int, int] = (256, 192)):
        """``image_size``: side of ``observation.images.top``; None: the policy reads no image (gym-aloha has no
        state-only observation: the frame is rendered and dropped)."""
        os.environ.setdefault("MUJOCO_GL", "egl")
        import gym_aloha  # noqa: F401 - registers the envs
        import gymnasium as gym

        env_id, self.prompt = TASKS[self.task]
        self.image_size = image_size
        self.env = gym.make(env_id, obs_type="pixels_agent_pos", render_mode="rgb_array", visualization_width=render_size[0],
                            visualization_height=render_size[1], max_episode_steps=10**9)

    def _obs(self, raw) -> dict[str, Any]:
        obs = {"observation.state": np.asarray(raw["agent_pos"], np.float32), "prompt": self.prompt}
        if self.image_size:
            # NOTE: gym-aloha renders its cameras at 480x640 whatever observation_width / _height say; the policy
            # reads a square image (our policies' vision towers), resized here (the aspect ratio is not kept).
            from PIL import Image

            top = Image.fromarray(np.asarray(raw["pixels"]["top"], np.uint8))
            obs["observation.images.top"] = np.asarray(top.resize((self.image_size,) * 2, Image.BILINEAR))
        return obs

    def reset(self, seed: int) -> dict[str, Any]:
        raw, _ = self.env.reset(seed=seed)
        return self._obs(raw)

    def step(self, action: np.ndarray) -> Step:
        action = np.asarray(action, np.float32).reshape(14)
        raw, reward, terminated, truncated, info = self.env.step(action)
        return Step(self._obs(raw), float(reward), bool(terminated or truncated), bool(info.get("is_success", False)))

    def render(self) -> np.ndarray:
        return self.env.render()

    def close(self) -> None:
        self.env.close()

    @classmethod
    def reference_policy(cls, name: str, **options: Any):
        from loongforge_embodied.eval.protocol import vector
        from loongforge_embodied.eval.reference_policies import RandomPolicy

        if name == "random":
            return RandomPolicy(low=cls.action_low, high=cls.action_high, spec={"observation.state": vector(14)})
        from loongforge.errors import LoongForgeError

        raise LoongForgeError(f"{cls.name} has no reference policy '{name}'; allowed: {', '.join(cls.references)} "
                              "(gym-aloha ships no scripted expert, and there is no recorder for it here)")


class AlohaInsertionAdapter(AlohaAdapter):
    name = "aloha_insertion"
    task = "insertion"
