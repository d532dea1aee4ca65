"""What ``loongforge serve`` / ``loongforge eval`` serve, from the command line's SOURCE: a run directory, an
exported policy directory, or a recipe (its ``model.load``, or an environment's reference policy)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from loongforge.errors import LoongForgeError

HELD_OUT_SEED = 100_000  # default first seed: away from the seeds `data prepare` records (data.record.seed + i)


def _device(device: str | None) -> str:
    """``--device`` checked: a torch device of a kind this machine has (default: cuda if available)."""
    import torch

    if not device:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise LoongForgeError(f"--device '{device[:80]}' is not a torch device; e.g. cpu, cuda, cuda:1") from None
    if dev.type == "cpu":
        return device
    mod = getattr(torch, dev.type, None)
    count = mod.device_count() if mod is not None and hasattr(mod, "device_count") else 0
    if count == 0:
        raise LoongForgeError(f"--device '{device}': this machine has no {dev.type} device; e.g. --device cpu")
    if dev.index is not None and dev.index >= count:
        raise LoongForgeError(f"--device '{device}': this machine has {count} {dev.type} device(s) "
                              f"({dev.type}:0..{dev.type}:{count - 1})")
    return device


def check_listen(*, host: str, port: int, max_batch: int) -> None:
    """``--host`` / ``--port`` / ``--max-batch`` of ``serve`` checked before a policy is built (one line each)."""
    import socket

    if not 0 <= port <= 65535:
        raise LoongForgeError(f"--port {port}: a port is 0..65535 (0: a free one)")
    if not 1 <= max_batch <= 4096:
        raise LoongForgeError(f"--max-batch {max_batch}: allowed 1..4096")
    if not host or len(host) > 255 or any(c.isspace() or ord(c) < 32 for c in host):
        raise LoongForgeError(f"--host {host[:80]!r} is not a host name or address (e.g. 127.0.0.1, 0.0.0.0)")
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        why = getattr(exc, "strerror", None) or type(exc).__name__
        raise LoongForgeError(f"--host '{host}' does not resolve to an address ({why}); e.g. 127.0.0.1") from None


def build_policy(source: str, overrides: list[str], *, policy: str | None, env: str | None,
                 device: str | None, n_action_steps: int | None = None):
    """→ (served policy, env name, default output directory, the recorded episodes' first seed or None)."""
    from loongforge_embodied.eval.envs import load_env
    from loongforge_embodied.eval.run_folder import run_data
    from loongforge_embodied.eval.trained_policy import TrainedPolicy

    path = Path(source)
    if not path.exists():
        raise LoongForgeError(f"'{source}' does not exist (SOURCE: a run directory, an exported policy, or a recipe)")
    if path.is_dir():
        if overrides:
            raise LoongForgeError(f"overrides ({' '.join(overrides)}) apply to a recipe, not to a run directory")
        data = run_data(path)
        env = env or data.get("record.env") or "pusht"
        out = path / "eval"
        if policy:
            return (load_env(env).reference_policy(policy, dataset=data.get("root")), env, out / policy,
                    data.get("record.seed"))
        return TrainedPolicy.load(path, device=_device(device), n_action_steps=n_action_steps), env, out, None
    from loongforge.recipe import load_recipe

    recipe = load_recipe(source, overrides)
    if recipe.backend != "embodied":
        raise LoongForgeError(f"'{source}' is a {recipe.backend} recipe; closed-loop evaluation is for embodied ones")
    record = recipe.data.record
    env = env or (record.env if record else None) or "pusht"
    out = Path("runs") / f"{path.stem}-eval" / (policy or "policy")
    if policy:
        return (load_env(env).reference_policy(policy, dataset=recipe.data.root), env, out,
                record.seed if record else None)
    if not recipe.model.load:
        raise LoongForgeError(f"'{source}' has no model.load to evaluate: pass a run directory, set model.load, or "
                              "evaluate a reference policy with --policy expert | random | replay")
    return TrainedPolicy.load(recipe.model.load, device=_device(device), n_action_steps=n_action_steps), env, out, None


def run_eval(args: argparse.Namespace) -> tuple[dict[str, Any], Path]:
    """``loongforge eval``: serve the policy on a free local port (or use ``--server``), roll out, summarise."""
    from loongforge_embodied.eval.evaluate import check_counts, evaluate
    from loongforge_embodied.eval.server import PolicyServer

    check_counts(episodes=args.episodes, workers=args.workers, max_steps=args.max_steps, replan=args.replan,
                 videos=args.videos, request_timeout_s=args.request_timeout)
    check_listen(host="127.0.0.1", port=0, max_batch=args.max_batch)
    server, record_seed = None, None
    if args.server:
        if not args.server.startswith(("ws://", "wss://")):
            raise LoongForgeError(f"--server '{args.server[:80]}' is not a ws://HOST:PORT address")
        env = args.env or "pusht"
        out = Path(args.output or Path("runs") / "eval")
        address = args.server
    else:
        policy, env, out, record_seed = build_policy(args.source, args.overrides, policy=args.policy, env=args.env,
                                                     device=args.device)
        out = Path(args.output) if args.output else out
        server = PolicyServer(policy, host="127.0.0.1", port=0, max_batch=args.max_batch).start()
        address = server.address
    try:
        # NOTE: a replay starts from the recorded seeds; anything else from seeds away from them (held out)
        seed = args.seed if args.seed is not None else (record_seed or 0) if args.policy == "replay" else HELD_OUT_SEED
        summary = evaluate(address=address, env=env, episodes=args.episodes, workers=args.workers, seed=seed,
                           max_steps=args.max_steps, replan=args.replan, out_dir=out, videos=args.videos,
                           progress=lambda line: print(line, file=sys.stderr, flush=True),
                           request_timeout_s=args.request_timeout)
    finally:
        if server is not None:
            server.stop()
    return summary, out / "summary.json"
