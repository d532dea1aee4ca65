"""Multi-token prediction (DeepSeek-V3's MTP) through megatron-core's own ``MultiTokenPredictionBlock``.

Each MTP depth ``k`` normalises the previous depth's hidden states (``hnorm``) and the embedding of the tokens
shifted by ``k`` (``enorm``), projects their concatenation back to the hidden size (``eh_proj``), runs one
transformer layer of the decoder's kind and a final norm, and predicts token ``t + k + 1`` with the shared
output layer. Megatron adds ``mtp_loss_scaling_factor / depths`` x each depth's loss to the gradient; the value
is reported separately (``mtp_loss``), the ``loss`` stays the next-token loss.

NOTE: megatron's spec helper (``get_gpt_mtp_block_spec``) picks TransformerEngine or its local modules; here the
MTP layer takes the decoder layer's own norm (our TorchNorm / fused RMSNorm) and megatron's column-parallel
linear, so it needs no TransformerEngine. Megatron places all depths on the last pipeline stage.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from loongforge_megatron.layers.megatron_layers import get_submodules


def _callable_norm(norm: Any) -> Any:
    """A norm builder megatron's MTP layer can call as ``norm(config=, hidden_size=, eps=)``."""
    module = getattr(norm, "module", None)
    if module is not None:  # a ModuleSpec (the loongforge spec's fused RMSNorm)
        return functools.partial(module, **(norm.params or {}))
    return norm


def mtp_block_spec(layer: Any, *, depths: int) -> Any:
    """megatron's MTP block spec: ``depths`` MTP layers around ``layer`` (the decoder's MoE / dense layer spec)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlockSubmodules,
        MultiTokenPredictionLayer,
        MultiTokenPredictionLayerSubmodules,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec

    norm = _callable_norm(get_submodules(layer).input_layernorm)
    one = ModuleSpec(module=MultiTokenPredictionLayer, submodules=MultiTokenPredictionLayerSubmodules(
        enorm=norm, hnorm=norm, eh_proj=ColumnParallelLinear, mtp_model_layer=layer, layer_norm=norm))
    return MultiTokenPredictionBlockSubmodules(layer_specs=[one] * depths)


def collect_mtp_loss(*, num_microbatches: int) -> list[float] | None:
    """Each depth's MTP loss of the last step (the mean over micro-batches and data-parallel ranks of each
    micro-batch's masked mean), on every rank; resets megatron's tracker. None without MTP."""
    from megatron.core import parallel_state as mpu
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker = MTPLossLoggingHelper.tracker
    values = tracker.get("loss_values")
    has = torch.tensor([0 if values is None else values.numel()], dtype=torch.int64)
    if mpu.get_pipeline_model_parallel_world_size() > 1:
        # NOTE: only the last stage computes it; the others learn its size first
        has = has.to(_device())
        dist.all_reduce(has, op=dist.ReduceOp.MAX, group=mpu.get_pipeline_model_parallel_group())
        has = has.cpu()
    n = int(has.item())
    if n == 0:
        return None
    out = torch.zeros(n, dtype=torch.float64, device=_device())
    if values is not None:
        out += values.detach().to(out.device, torch.float64) / num_microbatches
        values.zero_()
    dp = mpu.get_data_parallel_group(with_context_parallel=True)
    dist.all_reduce(out, group=dp)
    out /= dist.get_world_size(dp)
    if mpu.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(out, src=mpu.get_pipeline_model_parallel_last_rank(),
                       group=mpu.get_pipeline_model_parallel_group())
    return [float(v) for v in out.cpu()]


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
