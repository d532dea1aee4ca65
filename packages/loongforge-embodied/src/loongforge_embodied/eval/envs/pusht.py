"""PushT (gym-pusht): push the T block onto the goal pose. Success is gym-pusht's own: coverage > 95%."""

from __future__ import annotations

import os
import warnings
from typing import Any

import numpy as np

from loongforge_embodied.eval.envs.base import Step

TASK = "Push the T-shaped block onto the target."


def environment_state(unwrapped) -> np.ndarray:
    """[agent_x, agent_y, block_x, block_y, block_angle] as gym-pusht's ``state`` observation has it: the angle
    wrapped into [0, 2π) (pymunk's own accumulates whole turns)."""
    u = unwrapped
    return np.array([*u.agent.position, *u.block.position, u.block.angle % (2 * np.pi)], dtype=np.float32)


def environment_state_with_velocity(unwrapped) -> np.ndarray:
    """:func:`environment_state` then the pusher's velocity (px/s): [agent_x, agent_y, block_x, block_y,
    block_angle, agent_vx, agent_vy]. The scripted expert executes whole pushes, so from the pose alone a frame in
    the middle of a push (the pusher moving into the block) and one at its end (the pusher at rest there, about to
    walk elsewhere) look alike while their labels differ; the velocity tells them apart."""
    v = unwrapped.agent.velocity
    return np.array([*environment_state(unwrapped), v[0], v[1]], dtype=np.float32)


class PushTAdapter:
    """``gym_pusht/PushT-v0`` with ``obs_type=pixels_agent_pos``; the block's pose is the privileged
    ``observation.environment_state`` = [agent_x, agent_y, block_x, block_y, block_angle] (gym-pusht's ``state``),
    ``observation.environment_state_with_velocity`` adds the pusher's velocity."""

    name = "pusht"
    max_steps = 300  # gym-pusht's own TimeLimit
    fps = 10
    references = ("expert", "random", "replay")
    observation_keys = ("observation.image", "observation.state", "observation.environment_state",
                        "observation.environment_state_with_velocity")
    action_low, action_high = np.zeros(2, np.float32), np.full(2, 512.0, np.float32)

    def __init__(self, *, image_size: int | None = None, render_size: int = 256):
        """``image_size``: side of ``observation.image``; None: no image (nothing is rendered per step, for
        policies that read only states)."""
        os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
        # NOTE: pygame (imported by gym-pusht) imports the deprecated pkg_resources.
        warnings.filterwarnings("ignore", message="pkg_resources is deprecated", category=UserWarning)
        import gym_pusht  # noqa: F401 - registers the env
        import gymnasium as gym

        self.image_size = image_size
        kw = {"observation_width": image_size, "observation_height": image_size} if image_size else {}
        self.env = gym.make("gym_pusht/PushT-v0", obs_type="pixels_agent_pos" if image_size else "state",
                            render_mode="rgb_array", visualization_width=render_size,
                            visualization_height=render_size, max_episode_steps=10**9, **kw)
        self.unwrapped = self.env.unwrapped

    def _obs(self, raw) -> dict[str, Any]:
        with_velocity = environment_state_with_velocity(self.unwrapped)
        env_state = with_velocity[:5].copy()
        obs = {"observation.state": env_state[:2].copy(), "observation.environment_state": env_state,
               "observation.environment_state_with_velocity": with_velocity, "prompt": TASK}
        if self.image_size:
            obs["observation.image"] = np.ascontiguousarray(raw["pixels"], dtype=np.uint8)
            obs["observation.state"] = np.asarray(raw["agent_pos"], np.float32)
        return obs

    def reset(self, seed: int) -> dict[str, Any]:
        raw, _ = self.env.reset(seed=seed)
        return self._obs(raw)

    def step(self, action: np.ndarray) -> Step:
        action = np.asarray(action, np.float32).reshape(2)
        raw, reward, terminated, truncated, info = self.env.step(action)
        return Step(self._obs(raw), float(reward), bool(terminated or truncated), bool(info.get("is_success", False)),
                    {"coverage": float(info.get("coverage", 0.0))})

    def render(self) -> np.ndarray:
        return self.env.render()

    def close(self) -> None:
        self.env.close()

    @classmethod
    def reference_policy(cls, name: str, **options: Any):
        from loongforge_embodied.eval.protocol import vector
        from loongforge_embodied.eval.reference_policies import RandomPolicy, ReplayPolicy

        if name == "expert":
            from loongforge_embodied.eval.envs.pusht_expert import PushTExpertPolicy

            return PushTExpertPolicy()
        if name == "random":
            return RandomPolicy(low=cls.action_low, high=cls.action_high, spec={"observation.state": vector(2)})
        if name == "replay":
            if not options.get("dataset"):
                from loongforge.errors import LoongForgeError

                raise LoongForgeError("--policy replay needs the recorded dataset: a recipe with data.root")
            return ReplayPolicy(options["dataset"])
        from loongforge.errors import LoongForgeError

        raise LoongForgeError(f"pusht has no reference policy '{name}'; allowed: {', '.join(cls.references)}")
