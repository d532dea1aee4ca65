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
    if device:
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _run_recipe(path: Path) -> dict[str, Any]:
    f = path / "recipe.yaml"
    if not f.is_file():
        return {}
    import yaml

    return yaml.safe_load(f.read_text()) or {}


def build_policy(source: str, overrides: list[str], *, policy: str | None, env: str | None,
                 device: str | None, n_action_steps: int | None = None):
    """→ (served policy, env name, default output directory, the recorded episodes' first seed or None)."""
    from loongforge_embodied.eval.envs import load_env
    from loongforge_embodied.eval.trained_policy import TrainedPolicy

    path = Path(source)
    if not path.exists():
        raise LoongForgeError(f"'{source}' does not exist (SOURCE: a run directory, an exported policy, or a recipe)")
    if path.is_dir():
        if overrides:
            raise LoongForgeError(f"overrides ({' '.join(overrides)}) apply to a recipe, not to a run directory")
        data = _run_recipe(path).get("data") or {}
        record = data.get("record") or {}
        env = env or record.get("env") or "pusht"
        out = path / "eval"
        if policy:
            return (load_env(env).reference_policy(policy, dataset=data.get("root")), env, out / policy,
                    record.get("seed"))
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
    from loongforge_embodied.eval.evaluate import evaluate
    from loongforge_embodied.eval.server import PolicyServer

    server, record_seed = None, None
    if args.server:
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
                           progress=lambda line: print(line, file=sys.stderr, flush=True))
    finally:
        if server is not None:
            server.stop()
    return summary, out / "summary.json"
