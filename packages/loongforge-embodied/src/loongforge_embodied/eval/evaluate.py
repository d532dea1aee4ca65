"""``loongforge eval``: N seeded episodes in K spawned worker processes against a policy server; the summary.

Episode ``i`` runs with seed ``seed + i`` whichever worker takes it, so the same seeds give the same episodes.
A worker that dies (killed, segfault in a simulator) fails the episode it was running with a message naming the
worker and its exit, a fresh worker takes its place, and the evaluation goes on.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from loongforge_embodied.eval.client import DEFAULT_TIMEOUT_S, PolicyClient
from loongforge_embodied.eval.rollout import EpisodeResult, worker_main
from loongforge_embodied.eval.wilson import wilson_interval


def _exit_text(code: int | None) -> str:
    if code is None:
        return "exited"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def evaluate(*, address: str, env: str, episodes: int, workers: int = 1, seed: int = 0, max_steps: int | None = None,
             replan: int | None = None, out_dir: str | Path | None = None, videos: int = 0,
             on_episode_start: Callable[[int, int], None] | None = None, label: str | None = None,
             progress: Callable[[str], None] | None = None,
             request_timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """Run the episodes against the server at ``address``; write ``out_dir/summary.json`` (+ videos, plot).
    ``request_timeout_s`` bounds each wait for the server (a reply, the connect)."""
    from loongforge_embodied.eval.envs import load_env, resolve_env

    check_counts(episodes=episodes, workers=workers, max_steps=max_steps, replan=replan, videos=videos,
                 request_timeout_s=request_timeout_s)
    target = resolve_env(env)
    cls = load_env(target)
    max_steps = max_steps or cls.max_steps
    metadata = server_metadata(address, timeout_s=request_timeout_s)
    provided = set(getattr(cls, "observation_keys", ()) or ())
    missing = [k for k in metadata["features"] if provided and k not in provided]
    if missing:
        from loongforge.errors import LoongForgeError

        raise LoongForgeError(f"the served policy reads {', '.join(missing)}, which --env {env} does not provide "
                              f"(it has: {', '.join(sorted(provided))})")
    out = Path(out_dir) if out_dir else None
    videos_dir = str(out / "videos") if out is not None and videos > 0 else None
    start = time.perf_counter()
    # NOTE: spawn: workers are fresh interpreters, never forks of a process with threads (the server's, torch's).
    ctx = mp.get_context("spawn")
    pending = [(i, seed + i) for i in range(episodes)]
    pending.reverse()
    results: dict[int, EpisodeResult] = {}
    live: dict[Any, dict[str, Any]] = {}  # conn → {"proc", "episode"}

    def spawn() -> None:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=worker_main, args=(child,), daemon=True, name="loongforge-eval-worker",
                           kwargs={"address": address, "env_target": target, "max_steps": max_steps,
                                   "replan": replan, "videos_dir": videos_dir, "video_limit": videos,
                                   "timeout_s": request_timeout_s})
        proc.start()
        child.close()
        live[parent] = {"proc": proc, "episode": None}

    for _ in range(min(workers, episodes)):
        spawn()
    respawns = 0
    try:
        while len(results) < episodes:
            ready = wait(list(live) + [w["proc"].sentinel for w in live.values()], timeout=5.0)
            for conn in list(live):
                w = live[conn]
                if conn in ready:
                    try:
                        msg = conn.recv()
                    except (EOFError, OSError):
                        msg = None
                    if msg is not None:
                        if msg[0] in ("ready", "done"):
                            if msg[0] == "done":
                                r = EpisodeResult(**msg[1])
                                results[r.episode] = r
                                w["episode"] = None
                                if progress is not None:
                                    done = sum(x.success for x in results.values())
                                    progress(f"episode {r.episode} (seed {r.seed}): "
                                             f"{'success' if r.success else 'error' if r.error else 'failure'} in "
                                             f"{r.length} steps | {len(results)}/{episodes} done, {done} successes")
                            conn.send(pending.pop() if pending else None)
                        elif msg[0] == "start":
                            w["episode"] = (msg[1], seed + msg[1])
                            if on_episode_start is not None:
                                on_episode_start(msg[1], msg[2])
                        continue
                if not w["proc"].is_alive() or (conn in ready and msg is None):
                    w["proc"].join(timeout=5)
                    if w["episode"] is not None:
                        ep, ep_seed = w["episode"]
                        results[ep] = EpisodeResult(ep, ep_seed, error=(
                            f"worker process {w['proc'].pid} {_exit_text(w['proc'].exitcode)} during episode {ep} "
                            f"(seed {ep_seed})"))
                    del live[conn]
                    conn.close()
                    if pending and respawns < episodes:
                        respawns += 1
                        spawn()
                    elif pending and not live:
                        for ep, ep_seed in reversed(pending):
                            results[ep] = EpisodeResult(ep, ep_seed, error="no worker left to run it")
                        pending.clear()
    finally:
        for conn in live:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for w in live.values():
            w["proc"].join(timeout=10)
            if w["proc"].is_alive():
                w["proc"].kill()
    summary = summarize([results[i] for i in range(episodes)], env=env, policy=label or metadata.get("policy"),
                        seed=seed, max_steps=max_steps, workers=workers, wall_s=time.perf_counter() - start)
    if out is not None:
        write_summary(summary, out)
    refuse_unrun(summary, out)
    return summary


def check_counts(*, episodes: int, workers: int, max_steps: int | None, replan: int | None, videos: int,
                 request_timeout_s: float) -> None:
    """The evaluation's counts as the command line names them; anything out of range is one line."""
    from loongforge.errors import LoongForgeError

    for flag, value, least in (("--episodes", episodes, 1), ("--workers", workers, 1), ("--max-steps", max_steps, 1),
                               ("--replan", replan, 1), ("--videos", videos, 0)):
        if value is not None and (type(value) is not int or value < least):
            raise LoongForgeError(f"{flag} must be an integer of at least {least} (got {value})")
    if workers > 256:
        raise LoongForgeError(f"--workers {workers}: at most 256 environment worker processes")
    if type(request_timeout_s) not in (int, float) or not 0 < request_timeout_s <= 86_400:
        raise LoongForgeError(f"--request-timeout must be a number of seconds in (0, 86400] (got {request_timeout_s})")


def server_metadata(address: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """The metadata a policy server sends on connect (what its requests must hold), checked."""
    with PolicyClient(address, timeout_s=timeout_s) as client:
        return client.metadata


def summarize(results: list[EpisodeResult], *, env: str, policy: str | None, seed: int, max_steps: int, workers: int,
              wall_s: float) -> dict[str, Any]:
    """Success rate with its 95% Wilson interval, mean return, lengths, and each episode (failed ones with why)."""
    n = len(results)
    k = sum(r.success for r in results)
    lo, hi = wilson_interval(k, n)
    return {
        "env": env, "policy": policy, "episodes": n, "seeds": [r.seed for r in results], "start_seed": seed,
        "max_steps": max_steps, "workers": workers,
        "success_rate": k / n, "successes": k, "success_ci95": [lo, hi],
        "mean_return": sum(r.sum_reward for r in results) / n,
        "mean_max_reward": sum(r.max_reward for r in results) / n,
        "episode_lengths": [r.length for r in results],
        "mean_length": sum(r.length for r in results) / n,
        "errors": [{"episode": r.episode, "seed": r.seed, "error": r.error} for r in results if r.error],
        "eval_s": wall_s,
        "per_episode": [r.to_dict() for r in results],
    }


def refuse_unrun(summary: dict[str, Any], out: Path | None = None) -> None:
    """A clear error when every episode failed with an error: an evaluation in which nothing ran is not a 0% score."""
    n, errors = summary["episodes"], summary["errors"]
    if n and len(errors) == n:
        from loongforge.errors import LoongForgeError

        first = errors[0]
        where = f"; the summary is {out / 'summary.json'}" if out is not None else ""
        raise LoongForgeError(f"every one of the {n} episodes failed with an error, so there is no success rate "
                              f"(episode {first['episode']}, seed {first['seed']}: {first['error']}){where}")


def write_summary(summary: dict[str, Any], out: Path) -> Path:
    """``out/summary.json`` (atomically) and ``out/plot.png``."""
    from loongforge_embodied.eval.plot import plot_summary

    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=1))
    os.replace(tmp, out / "summary.json")
    plot_summary(summary, out / "plot.png")
    return out / "summary.json"
