"""One worker process of an evaluation: an environment, a policy-server connection, episodes on request.

The parent (``evaluate.py``) spawns each worker as a fresh interpreter and talks to it over a pipe: the worker
says ``ready``, receives ``(episode, seed)``, answers ``start`` and then ``done`` with the episode's result.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loongforge_embodied.eval.client import DEFAULT_TIMEOUT_S, PolicyClient
from loongforge_embodied.eval.protocol import ProtocolError


@dataclass
class EpisodeResult:
    episode: int
    seed: int
    success: bool = False
    sum_reward: float = 0.0
    max_reward: float = 0.0
    length: int = 0
    error: str | None = None
    video: str | None = None
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def request_from(obs: dict[str, Any], metadata: dict[str, Any]) -> dict[str, Any]:
    """The keys the served policy reads (its metadata's ``features``), plus ``prompt`` unless it ignores it."""
    missing = [k for k in metadata["features"] if k not in obs]
    if missing:
        raise KeyError(f"the policy reads {', '.join(missing)}, which this environment does not provide "
                       f"(it has: {', '.join(k for k in obs if k != 'prompt')})")
    req = {k: obs[k] for k in metadata["features"]}
    if metadata.get("prompt", "ignored") != "ignored" and "prompt" in obs:
        req["prompt"] = obs["prompt"]
    return req


def run_episode(adapter, client, metadata: dict[str, Any], *, episode: int, seed: int, max_steps: int,
                replan: int | None, video_path: Path | None, fps: int) -> EpisodeResult:
    """Roll one episode out: query a chunk, execute its first ``n_action_steps`` (0: all; ``replan`` caps it)."""
    start = time.perf_counter()
    res = EpisodeResult(episode, seed)
    obs = adapter.reset(seed)
    frames = [adapter.render()] if video_path is not None else None
    n_exec = int(metadata.get("n_action_steps") or 0)
    done = False
    while not done and res.length < max_steps:
        # NOTE: the client checked the reply: (T, action_dim) float32, finite
        actions = client.infer(request_from(obs, metadata))["actions"]
        n = len(actions) if n_exec <= 0 else min(n_exec, len(actions))
        if replan:
            n = min(n, replan)
        for a in actions[:n]:
            step = adapter.step(a)
            obs = step.observation
            res.length += 1
            res.sum_reward += step.reward
            res.max_reward = max(res.max_reward, step.reward)
            res.success = res.success or step.success
            if frames is not None:
                frames.append(adapter.render())
            if step.done or step.success or res.length >= max_steps:
                done = True
                break
    if frames is not None:
        from loongforge_embodied.eval.video import write_mp4

        res.video = str(write_mp4(video_path, frames, fps=fps))
    res.wall_s = time.perf_counter() - start
    return res


def worker_main(conn, *, address: str, env_target: str, max_steps: int, replan: int | None, videos_dir: str | None,
                video_limit: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Entry point of a spawned worker: serve episodes over ``conn`` until told ``None``."""
    from loongforge_embodied.eval.envs import load_env

    client = None
    adapter = None
    conn.send(("ready", os.getpid()))
    while True:
        task = conn.recv()
        if task is None:
            break
        episode, seed = task
        conn.send(("start", episode, os.getpid()))
        try:
            if client is None:
                client = PolicyClient(address, timeout_s=timeout_s)
            metadata = client.metadata
            if adapter is None:
                cls = load_env(env_target)
                img = next((f["shape"][0] for f in metadata["features"].values() if len(f["shape"]) == 3), None)
                adapter = cls(image_size=img)
            video = Path(videos_dir) / f"episode_{episode:04d}.mp4" if videos_dir and episode < video_limit else None
            result = run_episode(adapter, client, metadata, episode=episode, seed=seed, max_steps=max_steps,
                                 replan=replan, video_path=video, fps=adapter.fps)
        except Exception as exc:
            text = str(exc) if isinstance(exc, ProtocolError) else f"{type(exc).__name__}: {exc}"
            result = EpisodeResult(episode, seed, error=(text.strip().splitlines() or [""])[0][:2000])
            if client is not None and (isinstance(exc, ProtocolError | OSError)):
                client.close()
                client = None  # NOTE: reconnect for the next episode
        conn.send(("done", result.to_dict()))
    if client is not None:
        client.close()
    if adapter is not None:
        adapter.close()
