"""The embodied backend's commands (entry-point group ``loongforge.commands``): ``serve`` and ``eval``.

Imports here stay light (argparse only): every ``loongforge`` invocation builds the parser.
"""

from __future__ import annotations

import argparse
import sys

DEFAULT_TIMEOUT_S = 120.0  # NOTE: eval/client.py's default, repeated here so the parser imports nothing


def _one_line_errors(p: argparse.ArgumentParser) -> None:
    """argparse's errors (``--port abc``) as one ``error:`` line and exit code 2, like every other user error."""

    def error(message: str):
        print(f"error: {p.prog}: {message} (see {p.prog} --help)", file=sys.stderr)
        raise SystemExit(2)

    p.error = error


def _policy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", default=None,
                   help="a reference policy of the env instead of a trained one: expert | random | replay")
    p.add_argument("--env", default=None, help="environment (default: the recipe's data.record.env, else pusht)")
    p.add_argument("--device", default=None, help="torch device of a trained policy (default: cuda if available)")
    p.add_argument("--max-batch", type=int, default=16, help="requests batched into one forward at most")
    _one_line_errors(p)


def register_serve(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve a trained policy over the OpenPI websocket protocol")
    p.add_argument("source", help="a run directory, an exported policy directory, or a recipe (with --policy)")
    p.add_argument("overrides", nargs="*", default=[], help="a.b.c=value overrides of a recipe")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: a free one)")
    _policy_args(p)
    p.set_defaults(handler=_serve)


def register_eval(subparsers) -> None:
    p = subparsers.add_parser("eval", help="closed-loop evaluation of a policy in a simulator")
    p.add_argument("source", help="a run directory / exported policy, or a recipe (its model.load, or --policy)")
    p.add_argument("overrides", nargs="*", default=[], help="a.b.c=value overrides of a recipe")
    p.add_argument("--episodes", type=int, default=50)
    p.add_argument("--workers", type=int, default=2, help="environment worker processes")
    p.add_argument("--seed", type=int, default=None, help="episode i runs with seed SEED + i (default 100000, held "
                   "out from the recorded episodes; --policy replay: the recorded data.record.seed)")
    p.add_argument("--max-steps", type=int, default=None, help="episode length cap (default: the env's)")
    p.add_argument("--replan", type=int, default=None, help="execute at most this many actions of each chunk")
    p.add_argument("--videos", type=int, default=4, help="mp4s of the first N episodes")
    p.add_argument("--output", "-o", default=None, help="directory for summary.json (default: RUN/eval)")
    p.add_argument("--server", default=None, help="ws://HOST:PORT of a running `loongforge serve` instead")
    p.add_argument("--request-timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"seconds to wait for each reply of the policy server (default {DEFAULT_TIMEOUT_S:g})")
    _policy_args(p)
    p.set_defaults(handler=_eval)


def _serve(args: argparse.Namespace) -> int:
    from loongforge_embodied.eval.launch import build_policy, check_listen
    from loongforge_embodied.eval.server import PolicyServer

    check_listen(host=args.host, port=args.port, max_batch=args.max_batch)
    policy, _env, _, _ = build_policy(args.source, args.overrides, policy=args.policy, env=args.env, device=args.device)
    server = PolicyServer(policy, host=args.host, port=args.port, max_batch=args.max_batch)

    def ready() -> None:
        print(f"serving {policy.name} on ws://{args.host}:{server.port} (reads: {', '.join(policy.spec)})", flush=True)

    try:
        server.serve_forever(on_ready=ready)
    except KeyboardInterrupt:
        pass
    return 0


def _eval(args: argparse.Namespace) -> int:
    import json

    from loongforge_embodied.eval.launch import run_eval

    summary, path = run_eval(args)
    lo, hi = summary["success_ci95"]
    print(json.dumps({k: summary[k] for k in ("env", "policy", "episodes", "success_rate", "success_ci95",
                                               "mean_return", "mean_length")}))
    print(f"success {summary['successes']}/{summary['episodes']} = {summary['success_rate']:.3f} "
          f"(95% Wilson [{lo:.3f}, {hi:.3f}]), mean return {summary['mean_return']:.2f}; wrote {path}")
    for e in summary["errors"][:5]:
        print(f"episode {e['episode']} (seed {e['seed']}) failed: {e['error'].splitlines()[0]}")
    return 0
