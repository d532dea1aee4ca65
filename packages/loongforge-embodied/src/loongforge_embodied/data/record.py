"""``loongforge data prepare``: record a scripted expert in gym-pusht into a LeRobotDataset v3, offline.

The expert (``eval/envs/pusht_expert.py``) plans each push in a copy of the simulator and succeeds in gym-pusht's
own sense (coverage > 95%) within 300 steps on almost every seed; ``loongforge eval --policy expert`` serves the
same planner, and ``--policy replay`` replays what was recorded here from the recorded seeds.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import numpy as np

from loongforge_embodied.eval.envs.pusht import TASK


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
    from loongforge_embodied.eval.envs.pusht_expert import PushTSim, plan_push

    sim = PushTSim()
    u = env.unwrapped
    for ep in range(episodes):
        obs, _ = env.reset(seed=seed + ep)
        steps, done = 0, False
        while not done:
            # NOTE: the pose as float32, as the served expert reads it (observation.environment_state)
            s = np.array([*u.agent.position, *u.block.position, u.block.angle], np.float32).astype(np.float64)
            for action in plan_push(sim, s[:2], s[2:4], float(s[4])):
                ds.add_frame({"observation.image": obs["pixels"],
                              "observation.state": obs["agent_pos"].astype(np.float32), "action": action,
                              "task": TASK})
                obs, _, terminated, truncated, _ = env.step(action)
                steps += 1
                if terminated or truncated or steps >= max_steps:
                    done = True
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
