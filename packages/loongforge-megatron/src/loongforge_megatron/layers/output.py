"""Fused output layer + cross-entropy for GPTModel (``output_processor`` hook): the loss is computed chunk by
chunk from the final hidden states, never materialising the [tokens, vocab] logits (vocab-parallel under TP)."""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

from loongforge_megatron.layers.modules import kernel


def _takes(fn: Any, name: str) -> bool:
    """Whether a (possibly plugin-provided) fused CE accepts the keyword ``name``."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def mask_padded_vocab(chunks: list[torch.nn.Module], *, vocab_size: int) -> None:
    """Keep the padded vocabulary rows (the vocabulary rounded up so TP divides it) out of every softmax: the
    output layers' logits of those rows become -inf, so they take no probability mass, get no gradient, and
    the loss equals an unpadded model's at any TP.

    NOTE: megatron pads the output layer to ``padded_vocab_size`` and lets the padded logits join the
    cross-entropy; a padded row then adds exp(logit) to the denominator (1 for the zero rows an HF import
    makes) and learns, so the loss and training would depend on TP. The fused path reads
    ``unpadded_vocab_size`` off the output layer and masks inside the kernel."""
    for chunk in chunks:
        for module in chunk.modules():
            layer = getattr(module, "output_layer", None)
            if layer is None or getattr(layer, "unpadded_vocab_size", None) is not None:
                continue
            layer.unpadded_vocab_size = vocab_size
            layer.register_forward_hook(_mask_padded_logits)


def _vocab_start(local: int, layer: Any) -> int:
    """The global index of this rank's first logit column (0 when the logits are whole)."""
    from megatron.core import parallel_state as mpu

    tp = mpu.get_tensor_model_parallel_world_size()
    if tp == 1 or getattr(layer, "gather_output", False):
        return 0
    return mpu.get_tensor_model_parallel_rank() * local


def _mask_padded_logits(layer: Any, _inputs: Any, output: Any) -> Any:
    """Forward hook of an output layer: logits [..., V_local] of padded rows -> -inf."""
    logits, bias = output
    local = logits.shape[-1]
    real = layer.unpadded_vocab_size - _vocab_start(local, layer)
    if real >= local:
        return output
    cols = torch.arange(local, device=logits.device) >= max(real, 0)
    return logits.masked_fill(cols, float("-inf")), bias


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
    vocab = getattr(output_layer, "unpadded_vocab_size", None)
    masked = {}
    if vocab is not None and vocab < weight.shape[0] * tp_size:
        if not _takes(fn, "vocab_size"):  # NOTE: an op that cannot mask the padded rows: the masked logits path
            logits, _ = output_layer(hidden_states, weight=output_weight)
            return compute_language_model_loss(labels, logits)
        masked = {"vocab_size": vocab}
    if context is not None and _takes(fn, "token_weights"):
        total = fn(flat, weight, labels.reshape(-1), reduction="sum", process_group=group, reduce_grad_input=False,
                   token_weights=context.reshape(-1), **masked)
        if total.numel() != 1:
            raise RuntimeError(f"fused_linear_cross_entropy(reduction='sum') returned shape {tuple(total.shape)}, "
                               "not one value")
        return total.reshape(()).float()  # NOTE: loss_func tells the summed loss from per-token ones by dim 0
    loss = fn(flat, weight, labels.reshape(-1), reduction="none", process_group=group, reduce_grad_input=False,
              **masked)
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
