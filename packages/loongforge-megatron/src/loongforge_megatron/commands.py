"""The megatron backend's commands for ``loongforge`` (entry-point group ``loongforge.commands``): ``convert``
(HF <-> megatron layouts, with the layout flags), ``place-experts`` (MoE expert placement), ``moe simulate``
(replica planners replayed on routing traces) and ``fp8 profile``.

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
    p.add_argument("--fp8", action="store_true", help="--to hf: write the decoder layers' linear weights as "
                   "block-scaled FP8 (weight_scale_inv per 128x128 block, the published DeepSeek-V3 format)")
    p.add_argument("--dequantize-dtype", choices=["bfloat16", "float32"], default=None,
                   help="--to megatron from a block-scaled FP8 checkpoint: the dtype its FP8 weights dequantize to "
                   "(default: the checkpoint's own; float32 keeps an FP8 -> megatron -> FP8 round trip byte-exact)")
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
                              last_stage_layers=args.last_stage_layers, fp8=args.fp8,
                              dequantize_dtype=args.dequantize_dtype)
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


def register_moe(subparsers: argparse._SubParsersAction) -> None:
    """``loongforge moe simulate TRACE | --synthetic [--experts E --ranks R ...]``."""
    p = subparsers.add_parser("moe", help="MoE tools: replay routing traces through expert-replica planners")
    sub = p.add_subparsers(dest="moe_command", metavar="SUBCOMMAND", required=True)
    s = sub.add_parser("simulate", help="compare no replicas, EPLB-style and ours on a moe_trace.jsonl or Zipf loads")
    s.add_argument("trace", nargs="?", help="a run's moe_trace.jsonl (logging.moe_trace: true)")
    s.add_argument("--synthetic", action="store_true", help="Zipf loads with hot experts and drift instead of a trace")
    s.add_argument("--experts", type=int, default=256, help="synthetic: routed experts per layer")
    s.add_argument("--layers", type=int, default=4, help="synthetic: MoE layers")
    s.add_argument("--steps", type=int, default=60, help="synthetic: steps")
    s.add_argument("--tokens-per-rank", type=int, default=4096, help="synthetic: tokens per EP rank and step")
    s.add_argument("--top-k", type=int, default=8, help="synthetic: experts per token")
    s.add_argument("--zipf", type=float, default=1.0, help="synthetic: Zipf exponent of expert popularity")
    s.add_argument("--hot", type=int, default=2, help="synthetic: injected hot experts per layer")
    s.add_argument("--hot-factor", type=float, default=4.0, help="synthetic: how much hotter a hot expert is")
    s.add_argument("--drift", type=float, default=0.05, help="synthetic: log-popularity random walk per step")
    s.add_argument("--seed", type=int, default=0, help="synthetic: random seed")
    s.add_argument("--ranks", type=int, default=None, help="EP ranks (default: the trace's ep_size; synthetic: 64)")
    s.add_argument("--ranks-per-node", type=int, default=8, help="EP ranks per node (sets which traffic crosses nodes)")
    s.add_argument("--slots-per-rank", type=int, default=None,
                   help="expert slots per rank, home experts included (default: experts / ranks + 1)")
    s.add_argument("--window", type=int, default=10, help="steps of history a plan is made from")
    s.add_argument("--interval", type=int, default=1, help="steps between plans")
    s.add_argument("--hidden", type=int, default=7168, help="hidden size (bytes per token)")
    s.add_argument("--ffn", type=int, default=2048, help="expert FFN size (bytes per expert copy)")
    s.add_argument("--inter-node-cost", type=float, default=1.0, help="cost of one token byte between nodes")
    s.add_argument("--intra-node-cost", type=float, default=0.1, help="cost of one token byte inside a node")
    s.add_argument("--plot", default=None, help="write a PNG of the comparison here (needs matplotlib)")
    s.add_argument("--json", default=None, help="write the scores as JSON here")
    s.set_defaults(handler=moe_simulate)


def moe_simulate(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from loongforge_megatron.moe.placement import PlacementError, Topology
    from loongforge_megatron.moe.simulate import Shape, plot, replay, synthetic_loads, table
    from loongforge_megatron.moe.trace import read_trace

    if bool(args.trace) == bool(args.synthetic):
        raise PlacementError("moe simulate: give a TRACE (a run's moe_trace.jsonl) or --synthetic, exactly one")
    for key in ("experts", "layers", "steps", "tokens_per_rank", "top_k", "window", "interval", "hidden", "ffn"):
        if getattr(args, key) < 1:
            raise PlacementError(f"moe simulate: --{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.synthetic:
        ranks = args.ranks or 64
        loads = synthetic_loads(steps=args.steps, layers=args.layers, experts=args.experts,
                                tokens=ranks * args.tokens_per_rank * args.top_k, zipf=args.zipf, hot=args.hot,
                                hot_factor=args.hot_factor, drift=args.drift, seed=args.seed)
        name = f"synthetic: {args.experts} experts, Zipf {args.zipf}, {args.hot} hot x{args.hot_factor}"
    else:
        loads, ep = read_trace(args.trace)
        ranks = args.ranks or ep
        name = f"trace {args.trace}: {loads.shape[2]} experts"
    topology = Topology(ranks=ranks, ranks_per_node=min(args.ranks_per_node, ranks),
                        intra_node_cost=args.intra_node_cost, inter_node_cost=args.inter_node_cost)
    slots = args.slots_per_rank or loads.shape[2] // ranks + 1
    results = replay(loads, topology, slots_per_rank=slots, shape=Shape(args.hidden, args.ffn), window=args.window,
                     interval=args.interval)
    print(table(results, title=f"{name}, EP {ranks} ({topology.ranks_per_node} per node), {slots} slots per rank"))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.plot:
        print(f"wrote {args.plot}" if plot({name: results}, args.plot) else "no plot: matplotlib is not installed")
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
