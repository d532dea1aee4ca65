"""Megatron-style sequence parallelism for models whose activations are batch-first ``[b, tokens, h]``.

Under ``config.sequence_parallel`` each TP rank holds ``1 / tp`` of the residual stream's tokens; a column-parallel
linear all-gathers them (every token, this rank's heads / channels) and a row-parallel linear reduce-scatters its
output back. Megatron exchanges dim 0 (its ``[s, b, h]`` layout): :func:`seq_first` runs a linear on batch-first
tensors. What needs care besides the linears:

- a linear whose input every TP rank holds whole (text tokens, a timestep embedding) must not gather it:
  :func:`whole_input` gives its config;
- whole-held parameters that see only this rank's tokens get partial gradients: :func:`mark_sequence_parallel`
  has megatron sum them over TP (``finalize_model_grads``);
- a whole-held value computed on every rank and consumed by this rank's tokens only (a modulation from the
  timestep) gets a partial gradient: :func:`sum_grad_over_tp` sums it before it flows further back.
"""

from __future__ import annotations

import copy
from typing import Any

import torch


def whole_input(config: Any) -> Any:
    """``config`` for linears whose input every TP rank holds whole: no sequence split."""
    if not config.sequence_parallel:
        return config
    whole = copy.copy(config)
    whole.sequence_parallel = False
    return whole


def mark_sequence_parallel(module: torch.nn.Module) -> None:
    """Parameters of ``module`` (held whole) that see only this rank's tokens: megatron sums their gradients
    over TP."""
    for p in module.parameters():
        p.sequence_parallel = True


def seq_first(fn: Any, x: torch.Tensor, *, sp: bool) -> Any:
    """``fn`` (a megatron linear / MLP, returning ``(out, bias)``) on ``[b, s, h]``: megatron's sequence-parallel
    exchange is on dim 0."""
    if not sp:
        return fn(x)
    out, bias = fn(x.transpose(0, 1))
    return out.transpose(0, 1), bias


def sum_grad_over_tp(x: torch.Tensor, group: Any, *, sp: bool) -> torch.Tensor:
    """``x`` unchanged; its gradient summed over the TP ``group`` (each rank's from its own tokens)."""
    if not sp:
        return x
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    return copy_to_tensor_model_parallel_region(x, group=group)


def gather_tokens(x: torch.Tensor, group: Any, *, sp: bool) -> torch.Tensor:
    """Every TP rank's tokens of ``[b, tokens / tp, ...]``; the backward keeps this rank's part of the gradient
    (every TP rank computes the same loss from the gathered tokens)."""
    if not sp:
        return x
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    out = gather_from_sequence_parallel_region(x.transpose(0, 1).contiguous(), group=group,
                                               tensor_parallel_output_grad=False)
    return out.transpose(0, 1)
