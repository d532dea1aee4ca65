"""``loongforge data prepare``: record a scripted expert in gym-pusht into a LeRobotDataset v3, offline.

The expert pushes the T block towards the goal: it walks to a point behind the block (on the side away from
the goal, offset by the block's angle error), then pushes through the block's centre. Not optimal, but real
simulated trajectories with contact dynamics, rendered to small images.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import numpy as np

TASK = "Push the T-shaped block onto the target."
GOAL = np.array([256.0, 256.0])


def expert_action(env, phase: dict) -> np.ndarray:
    """Scripted pusher: approach a point behind the block, then push it through towards the goal."""
    u = env.unwrapped
    block = np.array(u.block.position, dtype=np.float64)
    agent = np.array(u.agent.position, dtype=np.float64)
    to_goal = GOAL - block
    dist = np.linalg.norm(to_goal)
    if dist < 8.0:
        return np.clip(block + np.array([0.0, 60.0]), 0, 512).astype(np.float32)
    direction = to_goal / dist
    behind = block - 45.0 * direction
    if phase.get("pushing") and np.linalg.norm(agent - behind) > 70.0:
        phase["pushing"] = False
    if not phase.get("pushing") and np.linalg.norm(agent - behind) < 12.0:
        phase["pushing"] = True
    if phase.get("pushing"):
        target = agent + 25.0 * direction
    else:
        # NOTE: go around the block (sideways first) when it lies between agent and approach point.
        side = np.array([-direction[1], direction[0]])
        detour = behind + 40.0 * side * np.sign(np.dot(agent - block, side) or 1.0)
        blocked = np.dot(agent - block, direction) > -10.0
        target = detour if blocked and np.linalg.norm(agent - detour) > 15.0 else behind
    step = target - agent
    n = np.linalg.norm(step)
    if n > 30.0:
        step = step / n * 30.0
    return np.clip(agent + step, 0, 512).astype(np.float32)


def check_root(root: str | Path) -> None:
    """Recording replaces ``root``: refuse a non-empty folder that is not a LeRobotDataset (a parent folder, a typo)."""
    root = Path(root)
    if root.is_file() or (root.is_dir() and not (root / "meta" / "info.json").is_file() and any(root.iterdir())):
        from loongforge.errors import RecipeError

        what = "is a file" if root.is_file() else "is a non-empty folder that is not a LeRobotDataset (no meta/info.json)"
        raise RecipeError(f"'{root}' {what}; recording writes a new dataset there and would delete what it holds: "
                          "point data.root at a new or empty folder", key="data.root")


def record_pusht(
    root: str | Path, *, repo_id: str, episodes: int, max_steps: int, image_size: int, seed: int, force: bool = False
) -> Path:
    """Record ``episodes`` expert episodes (≤ ``max_steps`` frames each) into ``root``; returns ``root``."""
    root = Path(root)
    if (root / "meta" / "info.json").is_file() and not force:
        return root
    check_root(root)
    os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
    # NOTE: pygame (which gym-pusht imports when it first renders) imports the deprecated pkg_resources.
    warnings.filterwarnings("ignore", message="pkg_resources is deprecated", category=UserWarning)
    import datasets
    import gym_pusht  # noqa: F401 - registers the env
    import gymnasium as gym
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    from loongforge_embodied.data.dataset import video_backend

    env = gym.make("gym_pusht/PushT-v0", obs_type="pixels_agent_pos", render_mode="rgb_array",
                   observation_width=image_size, observation_height=image_size)
    features = {
        "observation.image": {"dtype": "image", "shape": (image_size, image_size, 3),
                              "names": ["height", "width", "channel"]},
        "observation.state": {"dtype": "float32", "shape": (2,), "names": ["x", "y"]},
        "action": {"dtype": "float32", "shape": (2,), "names": ["x", "y"]},
    }
    tmp = root.with_name(root.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    # NOTE: images (PNG in parquet), not video: decoding needs no ffmpeg and small frames stay small.
    datasets.disable_progress_bars()  # NOTE: one "Map" bar per saved episode otherwise
    ds = LeRobotDataset.create(repo_id, fps=10, root=tmp, features=features, use_videos=False, robot_type="pusht_sim",
                               video_backend=video_backend())
    for ep in range(episodes):
        obs, _ = env.reset(seed=seed + ep)
        phase: dict = {}
        for _ in range(max_steps):
            action = expert_action(env, phase)
            ds.add_frame({"observation.image": obs["pixels"], "observation.state": obs["agent_pos"].astype(np.float32),
                          "action": action, "task": TASK})
            obs, _, terminated, truncated, _ = env.step(action)
            if terminated or truncated:
                break
        ds.save_episode()
    ds.finalize()
    env.close()
    # NOTE: publish by rename so an interrupted recording never looks complete; what it replaces (an empty folder,
    # or the dataset a forced re-record overwrites) goes only now.
    if root.exists():
        shutil.rmtree(root)
    os.rename(tmp, root)
    return root
