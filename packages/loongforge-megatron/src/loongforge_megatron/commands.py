"""The megatron backend's commands for ``loongforge`` (entry-point group ``loongforge.commands``): ``convert``
(HF <-> megatron layouts, with the layout flags), ``place-experts`` (MoE expert placement) and ``fp8 profile``.

Each ``register(subparsers)`` adds its argparse subparser and ``set_defaults(handler=fn)``; ``fn(args)`` returns
the exit code. Core's CLI loads a command's module only when that command (or the help) is asked for.
"""

from __future__ import annotations

import argparse


def register_convert(subparsers: argparse._SubParsersAction) -> None:
    """``loongforge convert SRC DST --to megatron|hf [--tp ...]``."""
    p = subparsers.add_parser("convert", help="convert checkpoints between HF and megatron layouts")
    p.add_argument("src", help="an HF model directory (--to megatron), or a `loongforge convert` output")
    p.add_argument("dst", help="output directory")
    p.add_argument("--to", required=True, choices=["megatron", "hf"], help="layout to write")
    p.add_argument("--backend", default="megatron", choices=["megatron"], help="backend whose layout to convert")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the megatron layout")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of the megatron layout")
    p.add_argument("--vpp", type=int, default=1, help="virtual pipeline stages per pipeline rank")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE)")
    p.add_argument("--etp", type=int, default=None, help="expert tensor-parallel size (default: --tp)")
    p.add_argument("--first-stage-layers", type=int, default=None, help="uneven pipeline split: layers on stage 0")
    p.add_argument("--last-stage-layers", type=int, default=None, help="uneven pipeline split: layers on the last stage")
    p.add_argument("--force", action="store_true", help="overwrite a non-empty destination")
    p.set_defaults(handler=convert)


def convert(args: argparse.Namespace) -> int:
    from pathlib import Path

    from loongforge.errors import CheckpointError

    from loongforge_megatron.backend import MegatronBackend

    src = Path(args.src)
    if not src.exists():
        raise CheckpointError(f"{src} does not exist (SRC: an HF model directory, or a `loongforge convert` output "
                              "for --to hf / resharding)")
    if (src / "latest").is_file() or any(src.glob("rank_*.pt")):
        raise CheckpointError(f"{src} is a training checkpoint (resume state), not a convertible layout: train "
                              "with checkpoint.save_format [dist, hf] for HF weights")
    MegatronBackend().convert(args.src, args.dst, to=args.to, tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep,
                              etp=args.etp, force=args.force, first_stage_layers=args.first_stage_layers,
                              last_stage_layers=args.last_stage_layers)
    print(f"wrote {args.dst}")
    return 0


def register_place_experts(subparsers: argparse._SubParsersAction) -> None:
    """``loongforge place-experts SRC DST --loads RUN/moe_imbalance.json --ep N``."""
    p = subparsers.add_parser("place-experts", help="renumber a MoE checkpoint's experts to balance expert-parallel ranks")
    p.add_argument("src", help="HF MoE checkpoint directory")
    p.add_argument("dst", help="output directory")
    p.add_argument("--loads", required=True, help="a training run's moe_imbalance.json (tokens per expert)")
    p.add_argument("--ep", type=int, required=True, help="expert-parallel size the placement is for")
    p.add_argument("--backend", default="megatron", choices=["megatron"], help="backend whose layout to place")
    p.add_argument("--force", action="store_true", help="overwrite a non-empty destination")
    p.set_defaults(handler=place_experts)


def place_experts(args: argparse.Namespace) -> int:
    from loongforge_megatron.backend import MegatronBackend

    report = MegatronBackend().place_experts(args.src, args.dst, loads=args.loads, ep=args.ep, force=args.force)
    for layer, r in report["layers"].items():
        print(f"layer {layer}: EP-rank imbalance {r['imbalance_before']:.3f} -> {r['imbalance_after']:.3f}")
    print(f"wrote {args.dst} (placement in expert_placement.json)")
    return 0


def register_fp8(subparsers: argparse._SubParsersAction) -> None:
    """``loongforge fp8 profile RECIPE``; the profiler (and torch) is imported only when it runs."""
    p = subparsers.add_parser("fp8", help="FP8 training tools (megatron backend)")
    sub = p.add_subparsers(dest="fp8_command", metavar="SUBCOMMAND")
    pp = sub.add_parser("profile", help="time the model's GEMMs in bf16 and FP8; write a train.fp8.policy file")
    pp.add_argument("recipe", help="recipe file (megatron backend)")
    pp.add_argument("overrides", nargs="*", help="key=value overrides of the recipe")
    pp.add_argument("--output", "-o", default=None, help="policy file (default: fp8_policy_<recipe name>.json)")
    pp.add_argument("--reps", type=int, default=20, help="timed repetitions per GEMM")
    p.set_defaults(handler=fp8)


def fp8(args: argparse.Namespace) -> int:
    from loongforge_megatron.fp8_profile import run_profile

    return run_profile(args)
