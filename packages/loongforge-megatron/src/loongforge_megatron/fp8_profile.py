"""``loongforge fp8 profile RECIPE``: time every distinct linear GEMM of the recipe's model in bf16 and FP8 on this
GPU and write the adaptive-FP8 policy file that ``train.fp8.policy`` reads.

Per linear shape (``y [M, N] = x [M, K] @ W [N, K].T`` on one TP rank: M = micro-batch tokens / cp, N and K the
rank's weight shard) it times the forward, input-grad and weight-grad GEMMs: bf16 ``torch.mm`` against FP8
(quantizing the GEMM's own operands in the layout it needs + ``torch._scaled_mm``; the training path fuses the
forward's quantizations, so this is the pessimistic side). A GEMM is FP8 in training only where FP8 measured
faster, so the policy never picks a slower GEMM than bf16 on this GPU at these shapes.
The FP8 GEMMs are the kernel registry's (``fp8_linear`` / ``fp8_grouped_linear`` under ``kernels.provider``), so
a plugin that replaces them is profiled too.
With ``train.fp8.experts``, grouped MoE experts (fc1 / fc2 of ``GroupedMLP``) are timed the same way as grouped GEMMs: bf16 ``grouped_mm``
against the ``fp8_grouped_linear`` op (rowwise; quantization and the weight grad's group padding included)
at the local experts' shape and M = tokens x top-k routed rows, spread evenly over the experts.
MLA's projections are not profiled: they stay bf16 under a policy.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch


def run_profile(args: argparse.Namespace) -> int:
    """``loongforge fp8 profile``'s handler (registered by :mod:`loongforge_megatron.commands`)."""
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
    from loongforge_megatron.layers.fp8 import Fp8Kernels

    kernels = Fp8Kernels.select(fp8, provider=recipe.kernels.provider, device_type="cuda")
    reason = kernels.linear.unavailable_reason()
    if reason:
        raise RecipeError(f"train.fp8 recipe {fp8.recipe}: {reason}", key="train.fp8")
    arch = recipe.model.arch()
    plan = recipe.parallel.plan(recipe.parallel.min_world_size())
    tokens = recipe.train.micro_batch_size * recipe.data.seq_length // plan.cp
    shapes = gemm_shapes(arch, tp=plan.tp, tokens=tokens, output_layer=fp8.output_layer)
    experts = (expert_gemm_shapes(arch, ep=plan.ep, etp=plan.etp, tokens=tokens)
               if fp8.experts and fp8.recipe != "blockwise" else {})
    policy = profile(shapes, kernels=kernels, reps=args.reps, expert_shapes=experts)
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


def _time_grouped(grouped: Any, e: int, m: int, n: int, k: int, *, reps: int) -> dict[str, Any]:
    """bf16 and FP8 (the ``fp8_grouped_linear`` op ``grouped``) milliseconds of the three grouped GEMMs of one
    expert projection (even routing)."""
    import torch.nn.functional as F

    counts = torch.full((e,), m // e, dtype=torch.int64)
    counts[: m - int(counts.sum())] += 1
    offs = torch.cumsum(counts, 0).to(device="cuda", dtype=torch.int32)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    bf16 = {"fwd": lambda: F.grouped_mm(x, w.transpose(-2, -1), offs=offs),
            "dgrad": lambda: F.grouped_mm(dy, w, offs=offs), "wgrad": lambda: F.grouped_mm(dy.t(), x, offs=offs)}
    fp8 = grouped.gemms(x, w, dy, offs)
    ok = grouped.shape_ok(n, k) and grouped.unavailable_reason() is None
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


def _time_shape(linear: Any, m: int, n: int, k: int, *, reps: int) -> dict[str, Any]:
    """bf16 and FP8 (the ``fp8_linear`` op ``linear``) milliseconds of the three GEMMs of one linear shape (random
    operands of the right scale)."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    bf16 = {"fwd": lambda: x @ w.t(), "dgrad": lambda: dy @ w, "wgrad": lambda: dy.t() @ x}
    fp8 = linear.gemms(x, w, dy)
    entry: dict[str, Any] = {}
    for g in ("fwd", "dgrad", "wgrad"):
        t16 = _time_ms(bf16[g], reps)
        t8 = _time_ms(fp8[g], reps) if linear.shape_ok(m, n, k) else None
        entry[g] = {"bf16_ms": round(t16, 4), "fp8_ms": None if t8 is None else round(t8, 4),
                    "fp8_faster": t8 is not None and t8 < t16}
    return entry


def profile(shapes: dict[str, tuple[int, int, int]], *, kernels: Any, reps: int = 20,
            expert_shapes: dict[str, tuple[int, int, int, int]] | None = None) -> dict[str, Any]:
    """Time fwd / dgrad / wgrad of every shape (and grouped expert shape) in bf16 and FP8 (``kernels``: the
    ``layers.fp8.Fp8Kernels`` of the recipe); the policy dict (see the module docstring)."""
    from loongforge_megatron.layers.fp8 import gemm_key, grouped_gemm_key

    gemms: dict[str, Any] = {}
    for name, (m, n, k) in shapes.items():
        entry = _time_shape(kernels.linear, m, n, k, reps=reps)
        entry["name"] = name
        gemms[gemm_key(m, n, k)] = entry
    for name, (e, m, n, k) in (expert_shapes or {}).items():
        entry = _time_grouped(kernels.grouped, e, m, n, k, reps=reps)
        entry["name"] = name
        gemms[grouped_gemm_key(e, m, n, k)] = entry
    return {"version": 1, "device": torch.cuda.get_device_name(), "recipe": kernels.linear.recipe,
            "grad_dtype": kernels.linear.grad_dtype,
            "torch": torch.__version__, "gemms": gemms}
