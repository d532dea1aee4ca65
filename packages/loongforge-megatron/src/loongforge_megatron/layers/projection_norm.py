"""RMSNorm over a whole q or k projection (all heads at once) while tensor parallelism splits the heads.

megatron's ``q_layernorm`` / ``k_layernorm`` normalise each head on its own. A model whose q (k) norm spans the
whole ``heads x head_dim`` projection needs the mean of squares over every head: under TP a rank holds only its
heads, so :class:`ProjectionRMSNorm` sums its partial squares over the TP group (forward and backward). Its weight
is the whole projection's (``heads x head_dim``), identical on every TP rank; a rank scales its heads by its slice,
so its weight gradient is non-zero on that slice only, and megatron's ``finalize_model_grads`` sums q/k layernorm
gradients over TP (``config.qk_layernorm``): every rank ends with the whole, equal gradient.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) whose backward is an all-reduce too: every rank's result depends on every rank's input."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        x = x.clone()
        torch.distributed.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


def _tp_group() -> Any:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group(check_initialized=False)


class ProjectionRMSNorm(torch.nn.Module):
    """RMSNorm over ``heads x head_dim`` channels, built where megatron builds a per-head q / k norm
    (``hidden_size`` is the head dim megatron passes); ``heads``: the projection's heads over all TP ranks."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, *, heads: int, tp_group: Any = None,
                 **_: Any):
        super().__init__()
        group = tp_group if tp_group is not None else _tp_group()
        self.tp_group = group if group is not None and group.size() > 1 else None
        tp = self.tp_group.size() if self.tp_group is not None else 1
        if heads % tp:
            # NOTE: fewer heads than TP ranks means ranks holding copies of a head: their squares would count twice
            raise ValueError(f"a whole-projection q/k norm needs its {heads} heads divisible by tensor parallel {tp}")
        self.heads, self.head_dim, self.eps = heads, hidden_size, eps
        self.local_heads = heads // tp
        self.first = (self.tp_group.rank() if self.tp_group is not None else 0) * self.local_heads
        self.weight = torch.nn.Parameter(torch.ones(heads * hidden_size, dtype=config.params_dtype))

    def forward(self, x: Tensor) -> Tensor:
        """``x`` [..., local heads, head_dim] -> the same, normalised over every head of the projection."""
        dtype = x.dtype
        x32 = x.float()
        squares = x32.square().sum(dim=(-2, -1), keepdim=True)
        if self.tp_group is not None:
            squares = _SumOverRanks.apply(squares, self.tp_group)
        y = x32 * torch.rsqrt(squares / (self.heads * self.head_dim) + self.eps)
        weight = self.weight.view(self.heads, self.head_dim)[self.first:self.first + self.local_heads]
        return weight * y.to(dtype)


def with_projection_qk_norm(spec: Any, *, q_heads: int, k_heads: int) -> Any:
    """``spec`` (a layer ModuleSpec, or a per-chunk block builder with its ``mtp_layer``) with its attention's q and
    k norms spanning the whole projections."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    def layer(s: Any) -> Any:
        attn = s.submodules.self_attention
        norms = dict(q_layernorm=ModuleSpec(module=ProjectionRMSNorm, params={"heads": q_heads}),
                     k_layernorm=ModuleSpec(module=ProjectionRMSNorm, params={"heads": k_heads}))
        attn = dataclasses.replace(attn, submodules=dataclasses.replace(attn.submodules, **norms))
        return dataclasses.replace(s, submodules=dataclasses.replace(s.submodules, self_attention=attn))

    if not callable(spec) or hasattr(spec, "submodules"):
        return layer(spec)

    def block(vp_stage: int | None):
        built = spec(vp_stage)
        return dataclasses.replace(built, layer_specs=[layer(s) for s in built.layer_specs])

    if hasattr(spec, "mtp_layer"):
        block.mtp_layer = layer(spec.mtp_layer)
    return block
