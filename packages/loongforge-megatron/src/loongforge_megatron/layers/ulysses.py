"""Ulysses context parallelism: trade a sequence split for a head split around an attention and back, by two
equal-split all-to-alls over the CP group (DeepSpeed-Ulysses; megatron-core's ``cp_comm_type`` a2a)::

    [b, tokens / cp, heads, d]  --tokens_to_heads-->  [b, tokens, heads / cp, d]  --attention-->  ...
    ...  --heads_to_tokens-->  [b, tokens / cp, heads, d]

Each rank then attends every token with its share of the heads, so heads must divide by cp (by tp x cp with
tensor parallelism); the ring (``ring_attention.py``) is the alternative where they do not. Tokens every rank holds
whole (a joint attention's text) join with this rank's heads (:func:`own_heads`) and their outputs are gathered
back (:func:`gather_heads`).
"""

from __future__ import annotations

from typing import Any

import torch


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all of dim 0 over ``group`` (chunk i goes to rank i); its own inverse, so the backward
    is the same exchange of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        # NOTE: both buffers contiguous: empty_like keeps a permuted input's strides, which the exchange ignores
        x = x.contiguous()
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        torch.distributed.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        out = torch.empty_like(grad, memory_format=torch.contiguous_format)
        torch.distributed.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def tokens_to_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Ulysses: ``[b, tokens / cp, heads, d]`` (this rank's tokens, all heads) -> ``[b, tokens, heads / cp, d]``
    (every token, this rank's heads)."""
    cp = group.size()
    b, s, heads, d = x.shape
    x = _AllToAll.apply(x.reshape(b, s, cp, heads // cp, d).permute(2, 0, 1, 3, 4), group)
    return x.permute(1, 0, 2, 3, 4).reshape(b, cp * s, heads // cp, d)


def heads_to_tokens(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The inverse of :func:`tokens_to_heads`."""
    cp = group.size()
    b, s, heads, d = x.shape
    x = _AllToAll.apply(x.reshape(b, cp, s // cp, heads, d).permute(1, 0, 2, 3, 4), group)
    return x.permute(1, 2, 0, 3, 4).reshape(b, s // cp, cp * heads, d)


def own_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    """This rank's heads ``[b, s, heads / cp, d]`` of a sequence every rank holds whole (the heads
    :func:`tokens_to_heads` gives this rank), to attend together with its Ulysses tokens."""
    n = x.shape[2] // group.size()
    return x[:, :, group.rank() * n:(group.rank() + 1) * n]


def gather_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The inverse of :func:`own_heads`: every rank's heads ``[b, s, heads, d]`` of ``[b, s, heads / cp, d]``; the
    backward sums every rank's gradient (each rank's loss reads the whole) and keeps this rank's heads."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    out = gather_from_sequence_parallel_region(x.permute(2, 0, 1, 3).contiguous(), group=group,
                                               tensor_parallel_output_grad=True)
    return out.permute(1, 2, 0, 3)
