"""Fused output layer + cross-entropy for GPTModel (``output_processor`` hook): the loss is computed chunk by
chunk from the final hidden states, never materialising the [tokens, vocab] logits (vocab-parallel under TP)."""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

from loongforge_megatron.layers.modules import kernel


def _takes_token_weights(fn: Any) -> bool:
    """Whether a (possibly plugin-provided) fused CE accepts ``token_weights``."""
    try:
        return "token_weights" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def fused_output_processor(*, hidden_states: torch.Tensor, output_layer: Any, output_weight: torch.Tensor | None,
                           labels: torch.Tensor | None, compute_language_model_loss: Any, provider: str = "auto",
                           accelerator: Any = None, context: torch.Tensor | None = None, **_: Any) -> torch.Tensor:
    """The loss from the final hidden states (logits when no labels).

    With ``context`` = the loss mask ``[b, s]``: the masked token-sum, a scalar, in one pass (the fused kernel
    computes the grads in the forward, weighted by the mask). Without it, or when the op cannot take token
    weights: the per-token loss ``[b, s]`` like ``GPTModel.compute_language_model_loss``, whose backward
    recomputes the logits (one more [tokens, H] x [H, V] GEMM)."""
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel as tp

    if labels is None:  # inference / eval without labels: the normal path
        logits, _ = output_layer(hidden_states, weight=output_weight)
        return logits.transpose(0, 1).contiguous()
    weight = output_weight if output_weight is not None else output_layer.weight
    tp_size = mpu.get_tensor_model_parallel_world_size()
    tp_group = mpu.get_tensor_model_parallel_group()  # NOTE: passed, so megatron does not warn on every call
    if getattr(output_layer, "sequence_parallel", False):
        hidden = tp.gather_from_sequence_parallel_region(hidden_states, group=tp_group)
    elif tp_size > 1:
        hidden = tp.copy_to_tensor_model_parallel_region(hidden_states, group=tp_group)
    else:
        hidden = hidden_states
    s, b, h = hidden.shape
    flat = hidden.transpose(0, 1).reshape(b * s, h)
    try:
        fn = kernel("fused_linear_cross_entropy", provider=provider, device_type=flat.device.type, accelerator=accelerator)
    except KeyError:  # no kernel package installed: megatron's own output layer + vocab-parallel cross-entropy
        logits, _ = output_layer(hidden_states, weight=output_weight)
        return compute_language_model_loss(labels, logits)
    group = tp_group if tp_size > 1 else None
    # NOTE: megatron's copy/gather region all-reduces the hidden gradient across TP itself.
    if context is not None and _takes_token_weights(fn):
        total = fn(flat, weight, labels.reshape(-1), reduction="sum", process_group=group, reduce_grad_input=False,
                   token_weights=context.reshape(-1))
        if total.numel() != 1:
            raise RuntimeError(f"fused_linear_cross_entropy(reduction='sum') returned shape {tuple(total.shape)}, "
                               "not one value")
        return total.reshape(()).float()  # NOTE: loss_func tells the summed loss from per-token ones by dim 0
    loss = fn(flat, weight, labels.reshape(-1), reduction="none", process_group=group, reduce_grad_input=False)
    return loss.view(b, s).float()


def forward_step_with_fused_loss(*, provider: str = "auto", accelerator: Any = None):
    """A megatron ``forward_step_func`` that passes the fused output processor to GPTModel."""
    from loongforge_megatron.engine.step import loss_func, model_inputs

    processor = functools.partial(fused_output_processor, provider=provider, accelerator=accelerator)

    def forward_step(data_iterator, model):
        batch = model_inputs(next(data_iterator), model)
        output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"],
                       packed_seq_params=batch.get("packed_seq_params"), output_processor=processor,
                       output_processor_context=batch["loss_mask"],
                       loss_mask=batch["loss_mask"])  # NOTE: the loss_mask is read by multi-token prediction
        return output, functools.partial(loss_func, batch["loss_mask"])

    return forward_step
