"""One optimizer step with megatron-core's forward-backward schedules (no pipeline / 1F1B / interleaved).

A batch is a dict of ``[b, s]`` tensors: ``tokens``, ``labels``, ``loss_mask``, ``position_ids``, optionally
``attention_mask`` (None → causal); or a packed (THD) micro-batch of ``[1, t]`` tensors with ``packed_seq_params``
(megatron ``PackedSeqParams``, see ``engine/packing.py``). The data iterator yields *this data-parallel rank's*
micro-batches; every pipeline stage may hold the same iterator.

Loss convention (megatron's, with ``calculate_per_token_loss=True``): the loss function returns
``(loss_sum, num_tokens, {"lm loss": [sum, count]})``; gradients are divided by the global token count, and the
reported loss is sum / count over all micro-batches and data-parallel ranks, so it does not depend on the layout.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from loongforge_megatron.engine.batch import packed_attention_mask

LossReport = dict[str, torch.Tensor]


def _to_device(batch: dict[str, Any], device: torch.device, *, keep: tuple[str, ...] = ()) -> dict[str, Any]:
    out = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) and k not in keep else v
           for k, v in batch.items()}
    packed = out.get("packed_seq_params")
    if packed is not None and packed.cu_seqlens_q is not None and packed.cu_seqlens_q.device != device:
        import dataclasses

        moved = {f.name: getattr(packed, f.name).to(device) for f in dataclasses.fields(packed)
                 if f.name.startswith("cu_seqlens") and getattr(packed, f.name) is not None}
        bounds = getattr(packed, "_loongforge_bounds", None)
        packed = dataclasses.replace(packed, **moved)
        if bounds is not None:
            packed._loongforge_bounds = bounds  # the host copy, read when the batch was made
        out["packed_seq_params"] = packed
    return out


def model_inputs(batch: dict[str, Any], model: torch.nn.Module, *, seq_keys: tuple[str, ...] = (),
                 host_keys: tuple[str, ...] = ()) -> dict[str, Any]:
    """A micro-batch as the model takes it: on the model's device (but ``host_keys``, metadata the model reads on
    the host, which stay where they are), this context-parallel rank's part (of the standard keys and of
    ``seq_keys``, a model's own per-token keys), and for megatron's local attention (which refuses
    ``packed_seq_params``) packed samples as the equivalent block-diagonal mask (:func:`packed_attention_mask`,
    ``[t, t]``: that reference path alone builds one)."""
    batch = _to_device(batch, next(model.parameters()).device, keep=host_keys)
    if _cp_size() > 1:
        from loongforge_megatron.engine.batch import cp_slice

        batch = cp_slice(batch, seq_keys=seq_keys)
    packed = batch.get("packed_seq_params")
    if packed is not None and _uses_local_attention(model):
        b, s = batch["tokens"].shape
        batch["attention_mask"] = packed_attention_mask(packed.cu_seqlens_q, batch_size=b, seq_length=s)
        batch["packed_seq_params"] = None
    return batch


def loss_func(
    loss_mask: torch.Tensor, output_tensor: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, LossReport]:
    """Masked token-sum of the per-token losses ``[b, s]`` GPTModel returns when given labels; a scalar output is
    that sum already (the fused output layer reduced it with the mask)."""
    mask = loss_mask.float().reshape(-1)
    if output_tensor.dim() == 0:
        loss_sum = output_tensor.float()
    else:
        loss_sum = torch.sum(output_tensor.float().reshape(-1) * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach(), num_tokens.detach().float()])
    return loss_sum, num_tokens, {"lm loss": report}


def _uses_local_attention(model: torch.nn.Module) -> bool:
    """True when the chunk's attention is megatron's non-TE DotProductAttention (which refuses packed params)."""
    cached = getattr(model, "_loongforge_local_attention", None)
    if cached is None:
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        cached = any(isinstance(m, DotProductAttention) for m in model.modules())
        model._loongforge_local_attention = cached
    return cached


def forward_step(data_iterator: Iterator[dict[str, Any]], model: torch.nn.Module):
    """megatron's ``forward_step_func`` for GPTModel: run one micro-batch, return (output, loss_func).

    Packed sequences (``packed_seq_params``) go to attention as is (see :func:`model_inputs`).
    """
    batch = model_inputs(next(data_iterator), model)
    output = model(
        batch["tokens"],
        batch["position_ids"],
        batch.get("attention_mask"),
        labels=batch["labels"],
        packed_seq_params=batch.get("packed_seq_params"),
        loss_mask=batch["loss_mask"],  # NOTE: read by multi-token prediction only (the shifted losses' mask)
    )
    return output, functools.partial(loss_func, batch["loss_mask"])


def _cp_size() -> int:
    from megatron.core import parallel_state as mpu

    return mpu.get_context_parallel_world_size()


def _configure(config: Any, model_chunks: list[torch.nn.Module], optimizer: Any, *,
               before_grad_reduce: Callable[[], None] | None = None) -> None:
    """Hooks megatron's schedules read from the model config (what megatron-LM's ``train`` sets up);
    ``before_grad_reduce`` runs after the backward, before the gradients' data-parallel reduction."""
    from megatron.core.distributed import finalize_model_grads

    from loongforge_megatron.engine.encoder_split import ENCODER_ATTR

    finalize_fn: Callable[..., Any] = finalize_model_grads
    if any(getattr(m, ENCODER_ATTR, None) is not None for c in model_chunks for m in c.modules()):
        finalize_fn = functools.partial(_finalize_with_encoders, model_chunks=model_chunks)
    if before_grad_reduce is None:
        config.finalize_model_grads_func = finalize_fn
    else:
        def finalize(*args: Any, **kwargs: Any) -> Any:
            before_grad_reduce()
            return finalize_fn(*args, **kwargs)

        config.finalize_model_grads_func = finalize
    config.grad_scale_func = optimizer.scale_loss
    ddp_config = getattr(model_chunks[0], "ddp_config", None)
    if ddp_config is not None and ddp_config.overlap_grad_reduce:
        no_sync = [m.no_sync for m in model_chunks]
        config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        sync = [m.start_grad_sync for m in model_chunks]
        config.grad_sync_func = sync[0] if len(sync) == 1 else sync


def _finalize_with_encoders(*args: Any, model_chunks: list[torch.nn.Module], **kwargs: Any) -> Any:
    """megatron's ``finalize_model_grads`` after the hetero-DP towers' gradients are summed over their copies."""
    from megatron.core.distributed import finalize_model_grads

    from loongforge_megatron.engine.encoder_split import sync_encoder_grads

    sync_encoder_grads(model_chunks)
    return finalize_model_grads(*args, **kwargs)


def _after_encoders(encoders: Any, then: Callable[[], None] | None) -> Callable[[], None]:
    """The decoupled towers' backward (``engine/decoupled_encoder.py``), then ``then``: both before the gradients'
    reduction."""
    def before_grad_reduce() -> None:
        encoders.backward()
        if then is not None:
            then()

    return before_grad_reduce


def _configure_p2p(config: Any) -> None:
    """Pipeline send/recv settings the default process group's backend can honour.

    NOTE: with batched p2p (megatron's default) both directions between two stages share one group; gloo
    matches messages in posting order, so with pp=2 (next == prev) an activation and a gradient of the same
    shape can be swapped silently (seen with interleaved pp=2: losses drift from micro-batch 3). Megatron's
    unbatched path sends the two directions over two different groups.
    """
    if dist.get_backend() == "gloo" and config.batch_p2p_comm:
        config.batch_p2p_comm = False


def _chunk_iterators(data_iterator: Iterator[Any], num_microbatches: int, num_chunks: int):
    """Materialise this step's micro-batches and give each model chunk its own iterator over them.

    NOTE: the interleaved schedule pulls from one iterator per virtual chunk; sharing one iterator would
    consume micro-batches ``vpp`` times too fast.
    """
    batches = [next(data_iterator) for _ in range(num_microbatches)]
    its = [iter(batches) for _ in range(num_chunks)]
    return its if num_chunks > 1 else its[0]



def reduce_loss(losses: list[LossReport], *, key: str = "lm loss") -> float:
    """Token-weighted mean over micro-batches and data-parallel (+context-parallel) ranks, on every rank.

    The last pipeline stage holds the losses; it broadcasts the result to the other stages.
    """
    total = loss_total(losses, key=key)
    return float(total[0] / total[1].clamp(min=1))


def loss_total(losses: list[LossReport], *, key: str = "lm loss") -> torch.Tensor:
    """:func:`reduce_loss`'s ``[loss sum, tokens]`` (float64, on the host), on every rank."""
    from megatron.core import parallel_state as mpu

    # NOTE: summed where the reports are and read back once, at the end (one host-device sync a step)
    total = None
    if mpu.is_pipeline_last_stage(ignore_virtual=True):
        for report in losses:
            part = report[key].detach().to(torch.float64)
            total = part if total is None else total + part
    device = _comm_device()
    total = torch.zeros(2, dtype=torch.float64, device=device) if total is None else total.to(device)
    dist.all_reduce(total, group=mpu.get_data_parallel_group(with_context_parallel=True))
    if mpu.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(
            total,
            src=mpu.get_pipeline_model_parallel_last_rank(),
            group=mpu.get_pipeline_model_parallel_group(),
        )
    return total.cpu()


def _comm_device() -> torch.device:
    """Tensors given to collectives live where the default process group's backend expects them."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def run_schedule(
    *,
    model_chunks: list[torch.nn.Module],
    data_iterator: Iterator[dict[str, Any]],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool,
    forward_step_fn: Callable[..., Any] | None = None,
) -> list[LossReport]:
    """Run megatron's forward-backward schedule for this parallel layout over ``num_microbatches``."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    _configure_p2p(get_model_config(model_chunks[0]))
    forward_backward = get_forward_backward_func()
    batches = [next(data_iterator) for _ in range(num_microbatches)]
    first = batches[0] if batches else {}
    if isinstance(first, dict) and first.get("packed_seq_params") is not None:
        # NOTE: a packed micro-batch is one row of b * s tokens; the pipeline sends activations of that shape
        micro_batch_size, seq_length = first["tokens"].shape
    return forward_backward(
        forward_step_func=forward_step_fn or forward_step,
        data_iterator=_chunk_iterators(iter(batches), num_microbatches, len(model_chunks)),
        model=model_chunks,
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )


def uses_loss_scaling(optimizer: Any) -> bool:
    """True when megatron's optimizer scales the loss (fp16): it detects overflowing gradients itself."""
    inner = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return any(getattr(o, "grad_scaler", None) is not None for o in inner)


def _grad_tensors(model_chunks: list[torch.nn.Module]) -> Iterator[torch.Tensor]:
    for m in model_chunks:
        buffers = getattr(m, "buffers", None)
        if isinstance(buffers, list):  # megatron DDP: contiguous grad buffers (after the data-parallel reduction)
            for buf in buffers + list(getattr(m, "expert_parallel_buffers", [])):
                yield buf.grad_data
            continue
        for p in m.parameters():
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            if g is not None:
                yield g


def step_is_finite(model_chunks: list[torch.nn.Module], loss: float, optimizer: Any) -> bool:
    """Whether this step's loss and (unless the optimizer scales the loss: fp16 overflows are its business) this
    rank's gradients are finite on every rank (one all-reduce of one number)."""
    from loongforge.failures import all_ranks_finite, tensors_finite

    ok = math.isfinite(loss)
    if ok and not uses_loss_scaling(optimizer):
        ok = tensors_finite(_grad_tensors(model_chunks))
    return all_ranks_finite(ok)


def train_step(
    *,
    model_chunks: list[torch.nn.Module],
    optimizer: Any,
    scheduler: Any,
    data_iterator: Iterator[dict[str, Any]],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    forward_step_fn: Callable[..., Any] | None = None,
    loss_key: str = "lm loss",
    before_grad_reduce: Callable[[], None] | None = None,
    remote_encoder: Any = None,
) -> dict[str, float | bool | None]:
    """Forward + backward over ``num_microbatches``, then one optimizer and scheduler step (``before_grad_reduce``:
    see :func:`_configure`, e.g. expert replicas' gradients added to their home experts'; ``remote_encoder``: the
    language ranks' side of an encoder on ranks of its own, ``engine/encoder_ranks.py``).

    Returns ``loss`` (token-weighted mean of the loss function's ``loss_key`` report, same on every rank),
    ``grad_norm`` (None when not computed), ``lr`` and ``skipped`` (True when the optimizer skipped the update,
    e.g. fp16 overflow, or a non-finite step) and ``nonfinite`` (the loss or a gradient was NaN / inf on some rank).
    """
    from megatron.core import parallel_state as mpu
    from megatron.core.utils import get_model_config

    from loongforge_megatron.engine.optimizer import folds_clip, step_with_folded_clip

    config = get_model_config(model_chunks[0])
    encoders = remote_encoder
    if encoders is None and mpu.get_pipeline_model_parallel_world_size() > 1:
        from loongforge_megatron.engine.decoupled_encoder import DecoupledEncoders

        encoders = DecoupledEncoders(model_chunks) or None
    _configure(config, model_chunks, optimizer,
               before_grad_reduce=_after_encoders(encoders, before_grad_reduce) if encoders else before_grad_reduce)
    for m in model_chunks:
        m.zero_grad_buffer()
    optimizer.zero_grad()
    lr = float(optimizer.param_groups[0]["lr"])
    if encoders is not None:  # NOTE: every micro-batch's images encoded before the pipeline schedule starts
        batches = [next(data_iterator) for _ in range(num_microbatches)]
        encoders.encode(batches)
        data_iterator = iter(batches)
    try:
        losses = run_schedule(
            model_chunks=model_chunks,
            data_iterator=data_iterator,
            num_microbatches=num_microbatches,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=False,
            forward_step_fn=forward_step_fn,
        )
    finally:
        if encoders is not None:
            encoders.close()
    total = loss_total(losses, key=loss_key)
    if remote_encoder is not None:  # NOTE: the encoder ranks divide their gradients by the same token count
        remote_encoder.share(total, lr=lr)
    loss = float(total[0] / total[1].clamp(min=1))
    # NOTE: a non-finite loss or gradient never reaches the weights (loongforge.failures decides what the run does
    # then: stop or skip); fp16's scaler skips by itself
    if folds_clip(optimizer):  # the clipping inside the fused Adam kernel, the check read off the gradient norm
        update_successful, grad_norm, finite = step_with_folded_clip(optimizer, loss_finite=math.isfinite(loss))
    else:
        finite = step_is_finite(model_chunks, loss, optimizer)
        if finite or uses_loss_scaling(optimizer):
            update_successful, grad_norm, _ = optimizer.step()
        else:
            update_successful, grad_norm = False, float("nan")
    if update_successful:
        global_batch = num_microbatches * micro_batch_size * mpu.get_data_parallel_world_size()
        scheduler.step(increment=global_batch)
    return {
        "loss": loss,
        "grad_norm": None if grad_norm is None else float(grad_norm),
        "lr": lr,
        "skipped": not update_successful,
        "nonfinite": not finite,
    }
