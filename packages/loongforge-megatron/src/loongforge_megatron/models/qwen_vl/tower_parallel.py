"""Tensor parallelism inside a Qwen-VL vision tower (``parallel.components.vision.tp``: any divisor of the language
model's tp): megatron's column / row split of every block's attention (by heads) and MLP and of the patch mergers,
over the component's own tp group (``engine/component_groups.py``), on linear layers that keep transformers'
parameter names (``weight``, ``bias``), so the HF name maps only change rule.

A column-parallel layer holds its rows of the output (the tower's input to it is the same on every rank of the group;
its backward sums the input gradient over the group) and a row-parallel one its columns of the input (its forward
sums the partial outputs, then adds the whole bias). Between a column and a row layer each rank works on its own
heads / hidden units: the tower's output is whole, and equal, on every rank of the group. At tp 1 these are plain
``nn.Linear``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class ColumnLinear(nn.Linear):
    """This rank's ``out / tp`` output rows (``stride`` s: of each of s stacked blocks, e.g. q / k / v)."""

    def __init__(self, inp: int, out: int, *, bias: bool = True, tp: int, group: Any, stride: int = 1):
        if out % (tp * stride):
            raise ValueError(f"vision tower: {out} output features do not split into {tp} x {stride} parts")
        super().__init__(inp, out // tp, bias=bias)
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        self.group = group
        for p in (self.weight, self.bias) if bias else (self.weight,):
            set_tensor_model_parallel_attributes(p, is_parallel=True, dim=0, stride=stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        return F.linear(copy_to_tensor_model_parallel_region(x, group=self.group), self.weight, self.bias)


class RowLinear(nn.Linear):
    """This rank's ``inp / tp`` input columns; the bias whole (added once, after the sum over ranks)."""

    def __init__(self, inp: int, out: int, *, bias: bool = True, tp: int, group: Any):
        if inp % tp:
            raise ValueError(f"vision tower: {inp} input features do not split into {tp} parts")
        super().__init__(inp // tp, out, bias=bias)
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        self.group = group
        set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=1, stride=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        y = reduce_from_tensor_model_parallel_region(F.linear(x, self.weight), group=self.group)
        return y if self.bias is None else y + self.bias


def _tp(groups: Any) -> int:
    return 1 if groups is None else groups.tp


def column(inp: int, out: int, *, bias: bool = True, groups: Any = None, stride: int = 1) -> nn.Linear:
    """A column-parallel linear over ``groups`` (a :class:`~loongforge_megatron.engine.component_groups.
    ComponentGroups`; ``nn.Linear`` at tp 1)."""
    if _tp(groups) == 1:
        return nn.Linear(inp, out, bias=bias)
    return ColumnLinear(inp, out, bias=bias, tp=groups.tp, group=groups.tp_group, stride=stride)


def row(inp: int, out: int, *, bias: bool = True, groups: Any = None) -> nn.Linear:
    """A row-parallel linear over ``groups`` (``nn.Linear`` at tp 1)."""
    if _tp(groups) == 1:
        return nn.Linear(inp, out, bias=bias)
    return RowLinear(inp, out, bias=bias, tp=groups.tp, group=groups.tp_group)
