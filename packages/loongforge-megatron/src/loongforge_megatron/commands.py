"""The megatron backend's commands for ``loongforge`` (entry-point group ``loongforge.commands``): ``convert``
(HF <-> megatron layouts, with the layout flags) and ``place-experts`` (MoE expert placement).

Each ``register(subparsers)`` adds its argparse subparser and ``set_defaults(handler=fn)``; ``fn(args)`` returns
the exit code. Core's CLI loads a command's module only when that command (or the help) is asked for.
"""

from __future__ import annotations

import argparse


def register_convert(subparsers: argparse._SubParsersAction) -> None:
    """``loongforge convert SRC DST --to megatron|hf [--tp ...]``."""
    p = subparsers.add_parser("convert", help="convert checkpoints between HF and megatron layouts")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--to", required=True, choices=["megatron", "hf"])
    p.add_argument("--backend", default="megatron", choices=["megatron"], help=argparse.SUPPRESS)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vpp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--etp", type=int, default=None)
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
    p.add_argument("dst")
    p.add_argument("--loads", required=True, help="a training run's moe_imbalance.json (tokens per expert)")
    p.add_argument("--ep", type=int, required=True, help="expert-parallel size the placement is for")
    p.add_argument("--backend", default="megatron", choices=["megatron"], help=argparse.SUPPRESS)
    p.add_argument("--force", action="store_true", help="overwrite a non-empty destination")
    p.set_defaults(handler=place_experts)


def place_experts(args: argparse.Namespace) -> int:
    from loongforge_megatron.backend import MegatronBackend

    report = MegatronBackend().place_experts(args.src, args.dst, loads=args.loads, ep=args.ep, force=args.force)
    for layer, r in report["layers"].items():
        print(f"layer {layer}: EP-rank imbalance {r['imbalance_before']:.3f} -> {r['imbalance_after']:.3f}")
    print(f"wrote {args.dst} (placement in expert_placement.json)")
    return 0
