"""FP8 column- / row-parallel linears (``train.fp8``): megatron's TP linears with their GEMMs in FP8.

The model is built as usual; :func:`apply_fp8` then gives each decoder ``ColumnParallelLinear`` /
``RowParallelLinear`` an FP8 subclass (same parameters, state dict and checkpoints; torchao's module-swap idea).
The subclass replaces only ``_forward_impl``, megatron's linear-with-communication: under sequence parallelism
the column-parallel input is all-gathered in the forward and its grad reduce-scattered in the backward; without
it the input grad is all-reduced over TP (``allreduce_dgrad``); row-parallel output reductions stay in megatron's
``forward``. The weight gradient goes into ``main_grad`` under gradient-accumulation fusion
(``kernels.grad_accum_fusion``), as megatron's: the first micro-batch of a step writes the FP8 GEMM's fp32 result
straight into the zeroed buffer, later ones add a bf16 grad (``torch._scaled_mm`` has no accumulating output).
The output layer stays bf16 unless ``train.fp8.output_layer``; embeddings are lookups, not GEMMs.

The FP8 GEMMs come from the core's kernel registry (ops ``fp8_linear`` and ``fp8_grouped_linear``, chosen by
``kernels.provider``; an accelerator plugin may replace them): :class:`Fp8Kernels` holds the job's two, and with
them the FP8 weight cache the job turns on under gradient accumulation.

With ``train.fp8.experts``, grouped MoE experts (``GroupedMLP``, ``kernels.moe_grouped_gemm``) run their fc1 / fc2
as FP8 grouped GEMMs (the ``fp8_grouped_linear`` op: rowwise E4M3 whatever the recipe, torch's only FP8
grouped kernel on Hopper; blockwise recipes and GPUs other than Hopper keep the experts bf16). Off by default:
at Qwen3-30B-A3B's shape on an H200 they measured slower than bf16 grouped_mm (the 128 experts' weights are
quantized every step); a policy file then still decides per GEMM.

A policy file (``loongforge fp8 profile``) says per GEMM shape which of the three GEMMs are faster in FP8;
layers it does not list, or lists as slower, stay bf16.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class Fp8Kernels:
    """The job's FP8 ops from the kernel registry: ``linear`` (``fp8_linear`` for ``train.fp8``'s recipe; it owns
    the FP8 weight cache) and ``grouped`` (``fp8_grouped_linear``)."""

    linear: Any
    grouped: Any

    @classmethod
    def select(cls, fp8: Any, *, provider: str, device_type: str, accelerator: Any = None) -> Fp8Kernels:
        """Both ops under the registry's rule for ``kernels.provider`` (an explicit provider that cannot serve them
        is a one-line error at ``kernels.provider``)."""
        from loongforge.errors import PluginError, RecipeError
        from loongforge.kernels import select_op

        try:
            linear = select_op("fp8_linear", provider=provider, device_type=device_type, accelerator=accelerator)
            grouped = select_op("fp8_grouped_linear", provider=provider, device_type=device_type,
                                accelerator=accelerator)
        except PluginError as exc:
            raise RecipeError(f"train.fp8: {str(exc).splitlines()[0]}", key="kernels.provider") from None
        return cls(linear(fp8.recipe, fp8.grad_dtype), grouped())


class _Fp8TPLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, main_grad_fusion, allreduce_dgrad, sequence_parallel, tp_group, ops, gemms):
        from megatron.core.tensor_parallel.mappings import _gather_along_first_dim

        total = _gather_along_first_dim(input, group=tp_group) if sequence_parallel else input
        x2d = total.reshape(-1, total.shape[-1])
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        y, saved = ops.forward(x2d, weight, gemms, need_dx=need_dx, need_dw=need_dw)
        ctx.save_for_backward(*saved, weight)
        ctx.cfg = (ops, gemms, main_grad_fusion and hasattr(weight, "main_grad"), allreduce_dgrad,
                   sequence_parallel, tp_group, total.shape, bias is not None)
        out = y.view(*total.shape[:-1], weight.shape[0])
        return out if bias is None else out + bias

    @staticmethod
    def backward(ctx, grad_output):
        from megatron.core.tensor_parallel.mappings import _reduce_scatter_along_first_dim

        *saved, weight = ctx.saved_tensors
        ops, gemms, fused, allreduce_dgrad, sp, tp_group, total_shape, has_bias = ctx.cfg
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dy = grad_output.reshape(-1, grad_output.shape[-1])
        # NOTE: megatron's DDP clears grad_added_to_main_grad when it zeroes the grad buffer, and every fused
        # weight-grad path sets it: while it is False, main_grad holds zeros and the FP8 GEMM may overwrite it
        main_grad = weight.main_grad if fused and need_dw else None
        dx, dw = ops.backward(dy, saved, gemms, need_dx=need_dx, need_dw=need_dw, w_dtype=weight.dtype,
                              main_grad=main_grad, accumulate=getattr(weight, "grad_added_to_main_grad", True))
        if dx is not None:
            dx = dx.view(total_shape)
            if sp:
                dx = _reduce_scatter_along_first_dim(dx, group=tp_group)
            elif allreduce_dgrad:
                torch.distributed.all_reduce(dx, group=tp_group)
        if main_grad is not None:
            if hasattr(weight, "grad_added_to_main_grad"):
                # NOTE: as megatron's linear: a dummy grad keeps DDP's backward hooks on the main thread
                dw = torch.zeros(weight.main_grad.shape, dtype=dy.dtype, device=dy.device) \
                    if getattr(weight, "zero_out_wgrad", False) else torch.empty(weight.main_grad.shape, dtype=dy.dtype, device=dy.device)
                weight.grad_added_to_main_grad = True
            else:
                dw = None
        db = dy.sum(0) if has_bias else None
        return dx, dw, db, None, None, None, None, None, None


class Fp8ParallelLinear:
    """Mixin over megatron's Column/RowParallelLinear: ``_forward_impl`` in FP8 for trainable weights on the FP8
    op's device (``fp8_ops.device_type``; CPU tensors of an export or host eval keep megatron's linear)."""

    fp8_ops: Any
    fp8_gemms: tuple[bool, bool, bool] = (True, True, True)

    def _forward_impl(self, input, weight, bias=None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
                      sequence_parallel=False, grad_output_buffer=None, wgrad_deferral_limit=None, tp_group=None,
                      gtp_remat_size=1, **kwargs):
        if (not weight.requires_grad or input.device.type != self.fp8_ops.device_type or grad_output_buffer is not None
                or gtp_remat_size > 1):
            return super()._forward_impl(
                input=input, weight=weight, bias=bias, gradient_accumulation_fusion=gradient_accumulation_fusion,
                allreduce_dgrad=allreduce_dgrad, sequence_parallel=sequence_parallel,
                grad_output_buffer=grad_output_buffer, wgrad_deferral_limit=wgrad_deferral_limit, tp_group=tp_group,
                gtp_remat_size=gtp_remat_size, **kwargs)
        tp_group = tp_group if tp_group is not None else self.tp_group
        m = input.numel() // input.shape[-1] * (tp_group.size() if sequence_parallel else 1)
        if not self.fp8_ops.shape_ok(m, *weight.shape):  # e.g. an expert's token count: bf16 this call
            return super()._forward_impl(
                input=input, weight=weight, bias=bias, gradient_accumulation_fusion=gradient_accumulation_fusion,
                allreduce_dgrad=allreduce_dgrad, sequence_parallel=sequence_parallel, grad_output_buffer=None,
                wgrad_deferral_limit=wgrad_deferral_limit, tp_group=tp_group, gtp_remat_size=gtp_remat_size, **kwargs)
        return _Fp8TPLinear.apply(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                                  tp_group, self.fp8_ops, self.fp8_gemms)


@functools.cache
def fp8_class(base: type) -> type:
    """The FP8 subclass of a megatron parallel linear class (one per base, so isinstance checks still hold)."""
    return type(f"Fp8{base.__name__}", (Fp8ParallelLinear, base), {})


def gemm_key(m: int, n: int, k: int) -> str:
    """A policy file's key for ``y [m, n] = x [m, k] @ W [n, k].T``."""
    return f"{m}x{n}x{k}"


def grouped_gemm_key(experts: int, m: int, n: int, k: int) -> str:
    """A policy file's key for the grouped ``y [m, n] = x [m, k] @ W[e] [n, k].T`` over ``experts`` local experts
    (``m`` the routed rows of a micro-batch: tokens x top-k)."""
    return f"experts{experts}:{m}x{n}x{k}"


def _policy_gemms(policy: dict[str, Any] | None, key: str) -> tuple[bool, bool, bool]:
    if policy is None:
        return (True, True, True)
    entry = policy.get(key)
    return tuple(bool(entry and entry.get(g, {}).get("fp8_faster")) for g in ("fwd", "dgrad", "wgrad"))


def _grouped_expert_flags(mod: Any, recipe: str, grouped: Any, policy: dict[str, Any] | None, *, tokens: int,
                          notes: list[str]):
    """The (fwd, dgrad, wgrad) FP8 flags of a ``GroupedMLP``'s fc1 and fc2, or None when its experts stay bf16
    (``notes`` gets the reason once)."""
    why = None
    if recipe == "blockwise":
        why = "blockwise: torch has no blockwise FP8 grouped GEMM on Hopper"
    elif torch.cuda.is_available():  # NOTE: on the CPU the module runs bf16 grouped_mm anyway
        why = grouped.unavailable_reason()
    if why:
        if why not in notes:
            notes.append(f"MoE experts stay bf16 ({why})")
        return None
    rows = tokens * getattr(mod.config, "moe_router_topk", 1)
    flags = []
    for w in (mod.weight1, mod.weight2):
        e, n, k = w.shape
        flags.append(_policy_gemms(policy, grouped_gemm_key(e, rows, n, k)) if grouped.shape_ok(n, k)
                     else (False, False, False))
    return tuple(flags) if any(any(f) for f in flags) else None


def apply_fp8(chunks: list[torch.nn.Module], fp8: Any, *, kernels: Fp8Kernels, tokens: int,
              notes: list[str] | None = None) -> tuple[int, int]:
    """Swap the decoder's TP linears of ``chunks`` to FP8 per ``fp8`` (a ``train.fp8`` section) and switch grouped
    MoE experts (``GroupedMLP``) to FP8 grouped GEMMs, both running ``kernels``' ops; ``tokens`` is the GEMMs' M
    (micro-batch tokens of this rank, gathered under SP; the experts' is that times top-k). Returns (FP8 GEMMs,
    all GEMMs), three per linear and per expert projection; ``notes`` collects why a kind of GEMM stays bf16."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    linear = kernels.linear
    from loongforge_megatron.fp8_policy import load_policy

    policy = load_policy(fp8.policy)["gemms"] if fp8.policy else None
    from loongforge_megatron.layers.grouped_experts import GroupedMLP

    notes = notes if notes is not None else []
    n_fp8 = n_all = 0
    for chunk in chunks:
        for name, mod in chunk.named_modules():
            if isinstance(mod, GroupedMLP):
                n_all += 6
                if fp8.experts and mod.weight1.requires_grad:
                    mod.fp8_gemms = _grouped_expert_flags(mod, fp8.recipe, kernels.grouped, policy, tokens=tokens,
                                                          notes=notes)
                    mod.fp8_grouped = kernels.grouped
                    n_fp8 += sum(sum(f) for f in mod.fp8_gemms or ())
                continue
            if not isinstance(mod, (ColumnParallelLinear, RowParallelLinear)) or isinstance(mod, Fp8ParallelLinear):
                continue
            if name.rsplit(".", 1)[-1] == "output_layer" and not fp8.output_layer:
                continue
            if getattr(mod, "weight", None) is None or not mod.weight.requires_grad:
                continue
            n_all += 3
            nw, kw = mod.weight.shape
            if not linear.shape_ok(tokens, nw, kw):
                continue
            gemms = _policy_gemms(policy, gemm_key(tokens, nw, kw))
            if not any(gemms):
                continue
            mod.__class__ = fp8_class(type(mod))
            mod.fp8_ops, mod.fp8_gemms = linear, gemms
            n_fp8 += sum(gemms)
    return n_fp8, n_all
