"""``loongforge fp8 profile RECIPE``: time every distinct linear GEMM of the recipe's model in bf16 and FP8 on this
GPU and write the adaptive-FP8 policy file that ``train.fp8.policy`` reads.

Per linear shape (``y [M, N] = x [M, K] @ W [N, K].T`` on one TP rank: M = micro-batch tokens / cp, N and K the
rank's weight shard) it times the forward, input-grad and weight-grad GEMMs: bf16 ``torch.mm`` against FP8
(quantizing the GEMM's own operands in the layout it needs + ``torch._scaled_mm``; the training path fuses the
forward's quantizations, so this is the pessimistic side). A GEMM is FP8 in training only where FP8 measured
faster, so the policy never picks a slower GEMM than bf16 on this GPU at these shapes.
With ``train.fp8.experts``, grouped MoE experts (fc1 / fc2 of ``GroupedMLP``) are timed the same way as grouped GEMMs: bf16 ``grouped_mm``
against ``loongforge_kernels.fp8_grouped`` (rowwise; quantization and the weight grad's group padding included)
at the local experts' shape and M = tokens x top-k routed rows, spread evenly over the experts.
MLA's projections are not profiled: they stay bf16 under a policy.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch


def register(subparsers: Any) -> None:
    """Add ``fp8`` (with its ``profile`` subcommand) to loongforge's CLI (entry point ``loongforge.commands``)."""
    p = subparsers.add_parser("fp8", help="FP8 training tools (megatron backend)")
    sub = p.add_subparsers(dest="fp8_command", metavar="SUBCOMMAND")
    pp = sub.add_parser("profile", help="time the model's GEMMs in bf16 and FP8; write a train.fp8.policy file")
    pp.add_argument("recipe")
    pp.add_argument("overrides", nargs="*", help="key=value overrides of the recipe")
    pp.add_argument("--output", "-o", default=None, help="policy file (default: fp8_policy_<recipe name>.json)")
    pp.add_argument("--reps", type=int, default=20, help="timed repetitions per GEMM")
    p.set_defaults(handler=_cmd_fp8)


def _cmd_fp8(args: argparse.Namespace) -> int:
    from loongforge.errors import RecipeError
    from loongforge.recipe import load_recipe
    from loongforge.recipe.schema import Fp8Config

    if getattr(args, "fp8_command", None) != "profile":
        raise RecipeError("loongforge fp8: give a subcommand: profile RECIPE")
    recipe = load_recipe(args.recipe, args.overrides)
    if recipe.backend != "megatron":
        raise RecipeError(f"loongforge fp8 profile is for the megatron backend (the recipe's is {recipe.backend})",
                          key="backend")
    fp8 = recipe.train.fp8 or Fp8Config()
    from loongforge_kernels.fp8_linear import fp8_unavailable_reason

    reason = fp8_unavailable_reason(fp8.recipe)
    if reason:
        raise RecipeError(f"train.fp8 recipe {fp8.recipe}: {reason}", key="train.fp8")
    arch = recipe.model.arch()
    plan = recipe.parallel.plan(recipe.parallel.min_world_size())
    tokens = recipe.train.micro_batch_size * recipe.data.seq_length // plan.cp
    shapes = gemm_shapes(arch, tp=plan.tp, tokens=tokens, output_layer=fp8.output_layer)
    experts = (expert_gemm_shapes(arch, ep=plan.ep, etp=plan.etp, tokens=tokens)
               if fp8.experts and fp8.recipe != "blockwise" else {})
    policy = profile(shapes, recipe=fp8.recipe, grad_dtype=fp8.grad_dtype, reps=args.reps, expert_shapes=experts)
    policy["recipe_file"] = str(args.recipe)
    out = Path(args.output or f"fp8_policy_{Path(args.recipe).stem}.json")
    out.write_text(json.dumps(policy, indent=1))
    n8 = sum(g["fp8_faster"] for e in policy["gemms"].values() for g in (e["fwd"], e["dgrad"], e["wgrad"]))
    for key, e in policy["gemms"].items():
        cells = "  ".join(f"{g} {e[g]['bf16_ms']:.3f}/{e[g]['fp8_ms'] or float('nan'):.3f} ms"
                          f"{' FP8' if e[g]['fp8_faster'] else ''}" for g in ("fwd", "dgrad", "wgrad"))
        print(f"{e['name']:>10} {key:>24}  {cells}")
    print(f"{n8} of {3 * len(policy['gemms'])} distinct GEMMs faster in FP8 ({fp8.recipe}, {policy['device']}); "
          f"use it with train.fp8.policy={out}")
    return 0


def gemm_shapes(arch: Any, *, tp: int, tokens: int, output_layer: bool = False) -> dict[str, tuple[int, int, int]]:
    """name -> (M, N, K) of each distinct decoder linear on one TP rank (dense GQA attention and MLPs)."""
    from loongforge_megatron.models.lm import padded_vocab

    h, hd = arch.hidden_size, arch.head_dim or arch.hidden_size // arch.num_attention_heads
    shapes: dict[str, tuple[int, int, int]] = {}
    if not arch.is_mla:
        shapes["qkv"] = (tokens, (arch.num_attention_heads + 2 * arch.kv_heads) * hd // tp, h)
        shapes["proj"] = (tokens, h, arch.num_attention_heads * hd // tp)
    if not arch.is_moe or arch.moe_first_dense_layers:
        shapes["fc1"] = (tokens, 2 * arch.ffn_hidden_size // tp, h)
        shapes["fc2"] = (tokens, h, arch.ffn_hidden_size // tp)
    if output_layer:
        shapes["output"] = (tokens, padded_vocab(arch.vocab_size, tp) // tp, h)
    return shapes


def expert_gemm_shapes(arch: Any, *, ep: int, etp: int, tokens: int) -> dict[str, tuple[int, int, int, int]]:
    """name -> (local experts, routed rows M, N, K) of the grouped expert projections on one EP / ETP rank."""
    if not arch.is_moe:
        return {}
    e, h = arch.num_experts // ep, arch.hidden_size
    ffn = (arch.moe_ffn_hidden_size or arch.ffn_hidden_size) // etp
    m = tokens * arch.moe_topk
    return {"expert_fc1": (e, m, 2 * ffn, h), "expert_fc2": (e, m, h, ffn)}


def _time_grouped(e: int, m: int, n: int, k: int, *, reps: int) -> dict[str, Any]:
    """bf16 and FP8 milliseconds of the three grouped GEMMs of one expert projection (even routing)."""
    import torch.nn.functional as F
    from loongforge_kernels.fp8_grouped import (
        _rowwise,
        _sgmm,
        _transposed_padded,
        grouped_fp8_unavailable_reason,
        grouped_shape_ok,
        padded_groups,
        quantize_expert_weight,
    )

    counts = torch.full((e,), m // e, dtype=torch.int64)
    counts[: m - int(counts.sum())] += 1
    offs = torch.cumsum(counts, 0).to(device="cuda", dtype=torch.int32)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)

    def fwd8():
        q, s, _, _ = quantize_expert_weight(w, plain=True, transposed=False)
        return _sgmm(*_rowwise(x), q.transpose(-2, -1), s, offs, True)

    def dgrad8():
        _, _, qt, st = quantize_expert_weight(w, plain=False, transposed=True)
        return _sgmm(*_rowwise(dy), qt.transpose(-2, -1), st, offs, False)

    def wgrad8():
        dest, poffs, rows = padded_groups(offs, m)
        a, sa = _transposed_padded(dy, dest, rows, e)
        b, sb = _transposed_padded(x, dest, rows, e)
        return _sgmm(a, sa, b.t(), sb, poffs, False)

    bf16 = {"fwd": lambda: F.grouped_mm(x, w.transpose(-2, -1), offs=offs),
            "dgrad": lambda: F.grouped_mm(dy, w, offs=offs), "wgrad": lambda: F.grouped_mm(dy.t(), x, offs=offs)}
    fp8 = {"fwd": fwd8, "dgrad": dgrad8, "wgrad": wgrad8}
    ok = grouped_shape_ok(n, k) and grouped_fp8_unavailable_reason() is None
    entry: dict[str, Any] = {}
    for g in ("fwd", "dgrad", "wgrad"):
        t16 = _time_ms(bf16[g], reps)
        t8 = _time_ms(fp8[g], reps) if ok else None
        entry[g] = {"bf16_ms": round(t16, 4), "fp8_ms": None if t8 is None else round(t8, 4),
                    "fp8_faster": t8 is not None and t8 < t16}
    return entry


def _time_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def _time_shape(r: Any, m: int, n: int, k: int, *, reps: int) -> dict[str, Any]:
    """bf16 and FP8 milliseconds of the three GEMMs of one linear shape (random operands of the right scale)."""
    from loongforge_kernels.fp8_linear import GRAD_DTYPES, _scaled_mm, shape_ok
    from loongforge_kernels.fp8_quant import fp8_quantize

    g_act, g_w, g_grad = r.granularity
    e4m3, gdt = torch.float8_e4m3fn, GRAD_DTYPES[r.grad_dtype]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)

    def q(t, g, dt, lay):
        return fp8_quantize(t, g, dt, layout=lay, check_finite=False)

    fast = r.recipe != "blockwise"
    bf16 = {"fwd": lambda: x @ w.t(), "dgrad": lambda: dy @ w, "wgrad": lambda: dy.t() @ x}
    fp8 = {
        "fwd": lambda: _scaled_mm(*q(x, g_act, e4m3, "n"), *q(w, g_w, e4m3, "n"), torch.bfloat16, fast),
        "dgrad": lambda: _scaled_mm(*q(dy, g_grad, gdt, "n"), *q(w, g_w, e4m3, "t"), torch.bfloat16, False),
        "wgrad": lambda: _scaled_mm(*q(dy, g_grad, gdt, "t"), *q(x, g_act, e4m3, "t"), torch.bfloat16, False),
    }
    entry: dict[str, Any] = {}
    for g in ("fwd", "dgrad", "wgrad"):
        t16 = _time_ms(bf16[g], reps)
        t8 = _time_ms(fp8[g], reps) if shape_ok(r, m, n, k) else None
        entry[g] = {"bf16_ms": round(t16, 4), "fp8_ms": None if t8 is None else round(t8, 4),
                    "fp8_faster": t8 is not None and t8 < t16}
    return entry


def profile(shapes: dict[str, tuple[int, int, int]], *, recipe: str, grad_dtype: str, reps: int = 20,
            expert_shapes: dict[str, tuple[int, int, int, int]] | None = None) -> dict[str, Any]:
    """Time fwd / dgrad / wgrad of every shape (and grouped expert shape) in bf16 and FP8; the policy dict (see
    the module docstring)."""
    from loongforge_kernels.fp8_linear import Fp8Recipe

    from loongforge_megatron.layers.fp8 import gemm_key, grouped_gemm_key

    r = Fp8Recipe(recipe, grad_dtype)
    gemms: dict[str, Any] = {}
    for name, (m, n, k) in shapes.items():
        entry = _time_shape(r, m, n, k, reps=reps)
        entry["name"] = name
        gemms[gemm_key(m, n, k)] = entry
    for name, (e, m, n, k) in (expert_shapes or {}).items():
        entry = _time_grouped(e, m, n, k, reps=reps)
        entry["name"] = name
        gemms[grouped_gemm_key(e, m, n, k)] = entry
    return {"version": 1, "device": torch.cuda.get_device_name(), "recipe": recipe, "grad_dtype": grad_dtype,
            "torch": torch.__version__, "gemms": gemms}
