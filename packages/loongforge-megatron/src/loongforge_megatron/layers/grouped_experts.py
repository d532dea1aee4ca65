"""Grouped-GEMM MoE experts without TransformerEngine: all local experts' fc1, then fc2, in one
``torch.nn.functional.grouped_mm`` each (bf16 on Hopper / Ampere, any float dtype on the CPU).

A drop-in for megatron-core's ``SequentialMLP`` in a layer spec (same constructor, same forward contract:
expert-sorted tokens, tokens per local expert, permuted probabilities). The weights are two stacked parameters,
``weight1`` ``[experts, 2F / etp, H]`` and ``weight2`` ``[experts, H, F / etp]`` (expert ``e`` of ``weight1`` is
``SequentialMLP``'s ``local_experts.e.linear_fc1.weight``), but the module's state dict uses ``SequentialMLP``'s
per-expert names and shapes: HF conversion, the unsharded loader, checkpoints and exports see the same tensors
either way, so a checkpoint saved with one loads into the other.

NOTE: the stacked layout is what makes one GEMM per projection possible without copying the experts' weights
into a 3D tensor on every forward (``torch.stack`` of ``num_experts`` weights, forward and backward).
"""

from __future__ import annotations

import re
from copy import deepcopy
from typing import Any

import torch
import torch.nn.functional as F

_NAME = re.compile(r"^local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.(weight|_extra_state)$")


def grouped_mm_supported(*, device_type: str, dtype: torch.dtype, hidden_size: int, ffn_size: int) -> bool:
    """Whether ``grouped_mm`` runs these expert shapes: CUDA (sm80+) in bf16, the CPU in any float dtype; both
    need rows that are a multiple of 16 bytes (its strided-operand rule)."""
    if not hasattr(F, "grouped_mm"):
        return False
    elem = torch.empty((), dtype=dtype).element_size()
    if (hidden_size * elem) % 16 or (ffn_size * elem) % 16:
        return False
    if device_type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)
    return device_type == "cpu"


class GroupedLinearFunction(torch.autograd.Function):
    """``y[rows of e] = x[rows of e] @ w[e].T`` for every expert ``e``; ``offs`` = cumulative row counts (int32).

    NOTE: our own backward (rather than grouped_mm's autograd) makes the incoming gradient dense first:
    grouped_mm needs 16-byte strides, which an expanded gradient (a ``sum()``'s) does not have.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight, offs)
        return F.grouped_mm(x, weight.transpose(-2, -1), offs=offs)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight, offs = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = F.grouped_mm(dy, weight, offs=offs)
        if ctx.needs_input_grad[1]:
            # [E, N, K]: expert e's rows of dy^T @ its rows of x; experts with no rows get zeros
            dw = F.grouped_mm(dy.t(), x, offs=offs)
        return dx, dw, None


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Grouped ``x @ weight[e].T`` over the expert-sorted rows of ``x``: grouped_mm's own autograd on CUDA (the
    gradients reaching it there are dense), :class:`GroupedLinearFunction` elsewhere."""
    if x.is_cuda:
        return F.grouped_mm(x, weight.transpose(-2, -1), offs=offs)
    return GroupedLinearFunction.apply(x, weight, offs)


def _megatron_module():
    from megatron.core.transformer.module import MegatronModule

    return MegatronModule


class GroupedMLP(_megatron_module()):
    """The local experts of one MoE layer as two grouped GEMMs (see the module docstring)."""

    def __init__(self, num_local_experts: int, config: Any, submodules: Any = None, pg_collection: Any = None,
                 name: str | None = None):
        from megatron.core.tensor_parallel.layers import (
            _initialize_affine_weight_cpu,
            _initialize_affine_weight_gpu,
        )

        if config.moe_ffn_hidden_size != config.ffn_hidden_size:
            config = deepcopy(config)  # NOTE: as SequentialMLP: its experts' MLPs read ffn_hidden_size
            config.ffn_hidden_size = config.moe_ffn_hidden_size
        super().__init__(config=config)
        for key in ("add_bias_linear", "moe_apply_probs_on_input", "fp8", "fp4", "activation_func_clamp_value",
                    "moe_latent_size", "moe_mlp_glu_interleave_size"):
            if getattr(config, key, None):
                raise ValueError(f"grouped MoE experts do not support megatron's {key}; use SequentialMLP "
                                 "(kernels.moe_grouped_gemm false)")
        self.num_local_experts = num_local_experts
        self.ep_group, self.tp_group = pg_collection.ep, pg_collection.expt_tp
        self.dp_group = pg_collection.expt_dp
        etp, etp_rank = self.tp_group.size(), self.tp_group.rank()
        ffn = config.moe_ffn_hidden_size
        if ffn % etp:
            raise ValueError(f"moe_ffn_hidden_size {ffn} does not split over expert tensor parallelism {etp}")
        glu = config.gated_linear_unit
        fc1_out, hidden = (2 * ffn if glu else ffn), config.hidden_size
        self.ffn_per_rank = ffn // etp
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        dtype = config.params_dtype
        self.weight1 = torch.nn.Parameter(torch.empty(num_local_experts, fc1_out // etp, hidden, device=device,
                                                      dtype=dtype))
        self.weight2 = torch.nn.Parameter(torch.empty(num_local_experts, hidden, ffn // etp, device=device,
                                                      dtype=dtype))
        self._fc1_stride = 2 if glu else 1
        use_expert_pgs = config.expert_model_parallel_size > 1 or (
            config.expert_tensor_parallel_size != config.tensor_model_parallel_size)
        # NOTE: the attributes megatron's ColumnParallelLinear / RowParallelLinear put on an expert weight:
        # the grad-norm / DDP / distributed-optimizer code reads them off the parameter.
        for p, dim, stride in ((self.weight1, 1, self._fc1_stride), (self.weight2, 2, 1)):
            p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, stride
            p.allreduce = not use_expert_pgs
        if config.perform_initialization:
            # NOTE: expert by expert, fc1 then fc2, with megatron's own init functions: the same draws, in the
            # same order, as SequentialMLP's experts, so a random init is identical to it.
            with torch.no_grad():
                for e in range(num_local_experts):
                    for w, out, inp, part, dim, stride, init in (
                        (self.weight1[e], fc1_out, hidden, fc1_out // etp, 0, self._fc1_stride, config.init_method),
                        (self.weight2[e], hidden, ffn, ffn // etp, 1, 1, config.output_layer_init_method),
                    ):
                        if config.use_cpu_initialization:
                            _initialize_affine_weight_cpu(w, out, inp, part, dim, init, stride=stride,
                                                          params_dtype=dtype, rank=etp_rank, world_size=etp)
                        else:
                            _initialize_affine_weight_gpu(w, init, partition_dim=dim, stride=stride, is_expert=True)
        act = getattr(submodules, "activation_func", None) if submodules is not None else None
        if config.use_te_activation_func and act is not None:
            from megatron.core.transformer.spec_utils import build_module

            self.activation_func = build_module(act, config=config)
        else:
            self.activation_func = None
        self._register_load_state_dict_pre_hook(self._from_per_expert, with_module=False)

    # ------------------------------------------------------------------ forward
    def _activation(self, h: torch.Tensor) -> torch.Tensor:
        if self.activation_func is not None:
            return self.activation_func(h)
        if self.config.gated_linear_unit:
            gate, up = torch.chunk(h, 2, dim=-1)
            return self.config.activation_func(gate) * up
        return self.config.activation_func(h)

    # NOTE: set by ``train.fp8`` (layers/fp8.py ``apply_fp8``): the (fwd, dgrad, wgrad) FP8 flags of fc1 and fc2, and
    # the kernel registry's ``fp8_grouped_linear`` op that runs them
    fp8_gemms: tuple[tuple[bool, bool, bool], tuple[bool, bool, bool]] | None = None
    fp8_grouped: Any = None

    def _grouped(self, x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, which: int) -> torch.Tensor:
        """One grouped projection: FP8 (the registry's ``fp8_grouped_linear``) where ``train.fp8`` chose it, on the
        op's device."""
        if (self.fp8_gemms is not None and x.device.type == self.fp8_grouped.device_type
                and any(self.fp8_gemms[which])):
            return self.fp8_grouped.linear(x, weight, offs, self.fp8_gemms[which])
        return grouped_linear(x, weight, offs)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor | None):
        """Experts' outputs for expert-sorted tokens (``tokens_per_expert`` rows per local expert, in order),
        each scaled by its routing probability after the activation (as megatron's expert MLP)."""
        return self.compute(permuted_local_hidden_states, tokens_per_expert, permuted_probs,
                            weight1=self.weight1, weight2=self.weight2), None

    def compute(self, x: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor | None, *,
                weight1: torch.Tensor, weight2: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` with the stacked weights given: expert replicas run the same GEMMs on copies of other
        ranks' experts (``layers/ep_moe_layer.py``)."""
        offs = torch.cumsum(tokens_per_expert.to(device=x.device), 0, dtype=torch.int32)
        h = self._grouped(x, weight1, offs, 0)
        h = self._activation(h)
        if probs is not None:  # NOTE: None when the dispatcher folds the probabilities into its combine
            h = (h * probs.unsqueeze(-1)).to(x.dtype)
        return self._grouped(h, weight2, offs, 1)

    def backward_dw(self):
        """Nothing is deferred: weight gradients are computed in the backward pass."""

    # ------------------------------------------------------------------ SequentialMLP-compatible state dict
    def _per_expert(self, e: int, which: str, keep_vars: bool) -> torch.Tensor:
        w = (self.weight1 if which == "linear_fc1" else self.weight2)[e]
        if not keep_vars:
            return w.detach()
        # NOTE: a view of the parameter that carries the per-expert linear's TP attributes (the unsharded
        # loader slices and copies into what the state dict hands it)
        view = w.data
        view.tensor_model_parallel = True
        view.partition_dim = 0 if which == "linear_fc1" else 1
        view.partition_stride = self._fc1_stride if which == "linear_fc1" else 1
        view.allreduce = self.weight1.allreduce
        return view

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for e in range(self.num_local_experts):
            for which in ("linear_fc1", "linear_fc2"):
                destination[f"{prefix}local_experts.{e}.{which}.weight"] = self._per_expert(e, which, keep_vars)

    def _from_per_expert(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                         error_msgs):
        """Stack the per-expert tensors of a SequentialMLP-style state dict into ``weight1`` / ``weight2``."""
        found: dict[str, dict[int, torch.Tensor]] = {"linear_fc1": {}, "linear_fc2": {}}
        for key in [k for k in state_dict if k.startswith(prefix)]:
            m = _NAME.match(key[len(prefix):])
            if m is None:
                continue
            value = state_dict.pop(key)
            if m.group(3) == "weight":
                found[m.group(2)][int(m.group(1))] = value
        for which, param in (("linear_fc1", "weight1"), ("linear_fc2", "weight2")):
            got = found[which]
            if not got:
                continue  # a stacked state dict (weight1 / weight2) loads the ordinary way
            experts = sorted(got)
            if experts != list(range(self.num_local_experts)):
                absent = sorted(set(range(self.num_local_experts)) - set(experts))
                missing_keys.extend(f"{prefix}local_experts.{e}.{which}.weight" for e in absent)
                unexpected_keys.extend(f"{prefix}local_experts.{e}.{which}.weight" for e in experts
                                       if e >= self.num_local_experts)
                continue
            state_dict[prefix + param] = torch.stack([got[e] for e in experts])


def with_grouped_experts(layer_spec: Any) -> Any:
    """``layer_spec`` (a megatron GPT layer spec) with its MoE ``SequentialMLP`` experts replaced by
    :class:`GroupedMLP`, keeping the experts' submodules (their activation module); a dense spec is unchanged."""
    import dataclasses
    import functools

    from megatron.core.transformer.moe.experts import SequentialMLP

    from loongforge_megatron.layers.megatron_layers import get_submodules, set_submodules

    mlp = layer_spec.submodules.mlp
    moe = get_submodules(mlp)
    experts = getattr(moe, "experts", None)
    if experts is None:
        return layer_spec
    func = experts.func if isinstance(experts, functools.partial) else getattr(experts, "module", experts)
    if func is not SequentialMLP:
        raise ValueError(f"grouped experts replace megatron's SequentialMLP, not {getattr(func, '__name__', func)}")
    grouped = functools.partial(GroupedMLP, submodules=get_submodules(experts))
    mlp = set_submodules(mlp, dataclasses.replace(moe, experts=grouped))
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(layer_spec.submodules, mlp=mlp))
