"""Forward-only loss over a number of micro-batches (validation)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from loongforge_megatron.engine.step import reduce_loss, run_schedule


@torch.no_grad()
def evaluate(
    *,
    model_chunks: list[torch.nn.Module],
    data_iterator: Iterator[dict[str, Any]],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    forward_step_fn: Callable[..., Any] | None = None,
) -> float:
    """Token-weighted mean loss over ``num_microbatches`` micro-batches and all data-parallel ranks."""
    for m in model_chunks:
        m.eval()
    try:
        losses = run_schedule(
            model_chunks=model_chunks,
            data_iterator=data_iterator,
            num_microbatches=num_microbatches,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=True,
            forward_step_fn=forward_step_fn,
        )
    finally:
        for m in model_chunks:
            m.train()
    return reduce_loss(losses)
