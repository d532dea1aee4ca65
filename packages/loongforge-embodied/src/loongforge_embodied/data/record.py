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

from loongforge_embodied.eval.envs.pusht import TASK, environment_state, environment_state_with_velocity


def check_root(root: str | Path) -> None:
    """Recording replaces ``root``: refuse a non-empty folder that is not a LeRobotDataset (a parent folder, a typo)."""
    root = Path(root)
    if root.is_file() or (root.is_dir() and not (root / "meta" / "info.json").is_file() and any(root.iterdir())):
        from loongforge.errors import RecipeError

        what = "is a file" if root.is_file() else "is a non-empty folder that is not a LeRobotDataset (no meta/info.json)"
        raise RecipeError(f"'{root}' {what}; recording writes a new dataset there and would delete what it holds: "
                          "point data.root at a new or empty folder", key="data.root")


def record_pusht(
    root: str | Path, *, repo_id: str, episodes: int, max_steps: int, image_size: int, seed: int, force: bool = False,
    workers: int = 1, noise: float = 0.0,
) -> Path:
    """Record ``episodes`` expert episodes (≤ ``max_steps`` frames each; episode ``i`` from seed ``seed + i``) into
    ``root``; returns ``root``. ``workers`` > 1: contiguous slices of the seeds in parallel spawned processes, merged
    in seed order (the same dataset as one process records, whatever the worker count). ``noise`` > 0: the expert
    executes each action plus Gaussian noise of that std (px, seeded by the episode's seed) while the clean action
    is recorded (DART, Laskey et al. 2017): states off the expert's path, labelled with its correction. Such data
    no longer replays (``--policy replay``) to the recorded states."""
    root = Path(root)
    if (root / "meta" / "info.json").is_file() and not force:
        return root
    check_root(root)
    tmp = root.with_name(root.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    workers = max(1, min(workers, episodes))
    if workers == 1:
        _record_seeds(tmp, repo_id=repo_id, seeds=range(seed, seed + episodes), max_steps=max_steps,
                      image_size=image_size, noise=noise)
    else:
        import multiprocessing as mp

        from lerobot.datasets.aggregate import aggregate_datasets

        bounds = [seed + episodes * k // workers for k in range(workers + 1)]
        shards = [root.with_name(f"{root.name}.tmp-shard{k}") for k in range(workers)]
        for sh in shards:
            shutil.rmtree(sh, ignore_errors=True)
        # NOTE: spawn: fresh interpreters (the caller may hold threads: torch's, a DataLoader's)
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_record_seeds, args=(sh,), name="loongforge-record",
                             kwargs={"repo_id": repo_id, "seeds": range(lo, hi), "max_steps": max_steps,
                                     "image_size": image_size, "noise": noise})
                 for sh, lo, hi in zip(shards, bounds, bounds[1:], strict=False)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
        failed = [f"seeds {lo}-{hi - 1} (exit {p.exitcode})" for p, lo, hi in zip(procs, bounds, bounds[1:],
                                                                                 strict=False) if p.exitcode]
        if failed:
            from loongforge.errors import LoongForgeError

            raise LoongForgeError(f"recording failed for {', '.join(failed)}; see the worker's traceback above")
        # NOTE: one parquet file per shard: packing them into one file rewrites the growing file per shard (2.4 min
        # for 16 shards of 8 PushT episodes on an H200 host, against ~50 s of recording)
        aggregate_datasets([repo_id] * workers, repo_id, roots=shards, aggr_root=tmp, concatenate_data=False)
        for sh in shards:
            shutil.rmtree(sh)
    # NOTE: publish by rename so an interrupted recording never looks complete; what it replaces (an empty folder,
    # or the dataset a forced re-record overwrites) goes only now.
    if root.exists():
        shutil.rmtree(root)
    os.rename(tmp, root)
    return root


def _record_seeds(out: Path, *, repo_id: str, seeds: range, max_steps: int, image_size: int,
                  noise: float = 0.0) -> None:
    """One episode per seed into a new LeRobotDataset at ``out``."""
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
        # NOTE: the privileged pose (what the expert plans from), for policies trained with
        # data.state_key observation.environment_state; gym-pusht's own ``state`` observation.
        "observation.environment_state": {"dtype": "float32", "shape": (5,),
                                          "names": ["agent_x", "agent_y", "block_x", "block_y", "block_angle"]},
        # NOTE: the pose and the pusher's velocity: a whole-push expert's labels are a function of this state
        # (mid-push and end-of-push frames have the same pose), not of the pose alone
        "observation.environment_state_with_velocity": {
            "dtype": "float32", "shape": (7,),
            "names": ["agent_x", "agent_y", "block_x", "block_y", "block_angle", "agent_vx", "agent_vy"]},
        "action": {"dtype": "float32", "shape": (2,), "names": ["x", "y"]},
    }
    # NOTE: images (PNG in parquet), not video: decoding needs no ffmpeg and small frames stay small.
    datasets.disable_progress_bars()  # NOTE: one "Map" bar per saved episode otherwise
    ds = LeRobotDataset.create(repo_id, fps=10, root=out, features=features, use_videos=False, robot_type="pusht_sim",
                               video_backend=video_backend())
    from loongforge_embodied.eval.envs.pusht_expert import PushTSim, plan_push

    sim = PushTSim()
    u = env.unwrapped
    for ep_seed in seeds:
        obs, _ = env.reset(seed=ep_seed)
        rng = np.random.default_rng([ep_seed, 1])  # NOTE: per episode: the same noise whatever the worker split
        steps, done = 0, False
        while not done:
            # NOTE: the pose as float32, as the served expert reads it (observation.environment_state)
            s = environment_state(u).astype(np.float64)
            for action in plan_push(sim, s[:2], s[2:4], float(s[4])):
                ds.add_frame({"observation.image": obs["pixels"],
                              "observation.state": obs["agent_pos"].astype(np.float32),
                              "observation.environment_state": environment_state(u),
                              "observation.environment_state_with_velocity": environment_state_with_velocity(u),
                              "action": action, "task": TASK})
                executed = action if not noise else np.clip(action + rng.normal(0.0, noise, 2), 0.0, 512.0)
                obs, _, terminated, truncated, _ = env.step(executed.astype(np.float32))
                steps += 1
                if terminated or truncated or steps >= max_steps:
                    done = True
                    break
        ds.save_episode()
    ds.finalize()
    env.close()
