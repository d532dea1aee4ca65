"""LoRA for megatron-core's tensor-parallel linears (``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``).

Sharding (so the low-rank path matches its base layer's layout)::

    ColumnParallelLinear  W[out/tp, in]      A [r, in]       (replicated)   B [out/tp, r] (split like W)
                          y_local = W x + s · B (A x)        x gathered over the sequence under SP
    RowParallelLinear     W[out, in/tp]      A [r, in/tp]    (split like W) B [out, r]    (replicated)
                          y = allreduce(W x_local + s · B (A x_local))   (reduce-scatter under SP)

with s = alpha / r. B starts at zero, so step 0 equals the base model; the base weights are frozen. The merged
weight of each rank's shard is W_local + s · B_local A_local — exactly the shard of W + s · B A.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

TARGETS = {"qkv": "linear_qkv", "proj": "linear_proj", "fc1": "linear_fc1", "fc2": "linear_fc2"}


class LoRAParallelLinear(nn.Module):
    """Wraps a megatron Column/RowParallelLinear; returns ``(output, bias)`` like the base layer."""

    def __init__(self, base: nn.Module, *, rank: int, alpha: float, dropout: float, generator: torch.Generator):
        super().__init__()
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

        self.base = base
        self.column = isinstance(base, ColumnParallelLinear)
        if not self.column and not isinstance(base, RowParallelLinear):
            raise TypeError(f"LoRA supports megatron Column/RowParallelLinear, got {type(base).__name__}")
        out_f, in_f = base.weight.shape
        dtype, device = base.weight.dtype, base.weight.device
        self.scale = alpha / rank
        self.sequence_parallel = bool(getattr(base, "sequence_parallel", False))
        a = torch.empty(rank, in_f, dtype=torch.float32)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        self.lora_A = nn.Parameter(a.to(device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.zeros(out_f, rank, device=device, dtype=dtype))
        # NOTE: megatron's DDP / optimizer read these flags: the replicated half must not be treated as TP-split.
        split, replicated = (self.lora_B, self.lora_A) if self.column else (self.lora_A, self.lora_B)
        split.tensor_model_parallel = True
        split.partition_dim = 0 if self.column else 1
        split.partition_stride = 1
        replicated.tensor_model_parallel = False
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        for p in base.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor, *args, **kwargs):
        from megatron.core import tensor_parallel as tp

        out, bias = self.base(x, *args, **kwargs)
        # NOTE: every TP rank's loss depends on the replicated factor through its own shard of the other one, so
        # its true gradient is the sum of the ranks' local gradients; megatron only sums replicated grads over TP
        # for sequence-parallel norms. copy_to_... is the identity forward and an all-reduce (sum) backward.
        # Without it the replicated factor drifts apart per rank and no single rank-r adapter (PEFT) exists.
        a, b = self.lora_A, self.lora_B
        if self.column:
            a = tp.copy_to_tensor_model_parallel_region(a)
            inp = tp.gather_from_sequence_parallel_region(x) if self.sequence_parallel else tp.copy_to_tensor_model_parallel_region(x)
            delta = nn.functional.linear(nn.functional.linear(self.dropout(inp), a), b) * self.scale
        else:
            b = tp.copy_to_tensor_model_parallel_region(b)
            partial = nn.functional.linear(nn.functional.linear(self.dropout(x), a), b) * self.scale
            delta = (tp.reduce_scatter_to_sequence_parallel_region(partial) if self.sequence_parallel
                     else tp.reduce_from_tensor_model_parallel_region(partial))
        return out + delta.to(out.dtype), bias

    def merged_weight(self) -> torch.Tensor:
        """This rank's shard of W + (alpha/r)·B A."""
        delta = (self.lora_B.float() @ self.lora_A.float()) * self.scale
        return (self.base.weight.float() + delta).to(self.base.weight.dtype)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        return self.base.sharded_state_dict(prefix=f"{prefix}base.", sharded_offsets=sharded_offsets, metadata=metadata)


def apply_lora(modules: list[nn.Module], config, *, seed: int,
               targets: Mapping[str, tuple[str, ...]] | None = None) -> list[str]:
    """Freeze every parameter of ``modules`` and wrap the target linears with LoRA adapters.

    Call on the unwrapped GPTModel chunks *before* megatron DDP wraps them (DDP sizes its grad buffers for
    trainable parameters at construction). ``targets``: ``train.lora.targets`` value -> the linears' module names
    (a model kind's own, its spec's ``Model.lora_targets``; default megatron's names, :data:`TARGETS`). Returns the
    names of the wrapped layers.
    """
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    names = targets or {k: (v,) for k, v in TARGETS.items()}
    wanted = {n for t in config.targets for n in names.get(t, ())}
    parallel = (ColumnParallelLinear, RowParallelLinear)
    g = torch.Generator().manual_seed(seed + 7919)
    wrapped: list[str] = []
    for chunk_idx, model in enumerate(modules):
        for p in model.parameters():
            p.requires_grad_(False)
        for name, module in list(model.named_modules()):
            for child_name, child in list(module.named_children()):
                # NOTE: megatron's parallel linears only: a VLM's vision tower (plain torch linears, some named
                # linear_fc1 too) stays frozen as it is; the adapters go on the language model
                if child_name in wanted and isinstance(child, parallel) and not isinstance(child, LoRAParallelLinear):
                    setattr(module, child_name, LoRAParallelLinear(child, rank=config.rank, alpha=config.alpha,
                                                                   dropout=config.dropout, generator=g))
                    wrapped.append(f"{chunk_idx}:{name}.{child_name}")
    if not wrapped:
        raise ValueError(f"no LoRA target layers ({sorted(wanted)}) found in the model")
    return wrapped


def merged_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's state dict with every LoRA layer merged into its base weight, under the base names."""
    sd = module.state_dict()
    out = {k: v for k, v in sd.items() if ".lora_A" not in k and ".lora_B" not in k}
    for name, sub in module.named_modules():
        if isinstance(sub, LoRAParallelLinear):
            out[f"{name}.base.weight"] = sub.merged_weight().detach()
    return {k.replace(".base.", "."): v for k, v in out.items()}


def adapter_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """Only the adapter weights (what changes during LoRA training)."""
    return {k: v for k, v in module.state_dict().items() if ".lora_A" in k or ".lora_B" in k}
