"""Batch helpers: context-parallel slicing of a micro-batch (dense ``[b, s]`` or packed THD)."""

from __future__ import annotations

from typing import Any

import torch

# Keys whose sequence dimension is 1 ([b, s]); attention_mask [b, 1, s, s] is sliced on its query dim (2).
_SEQ_DIM = {"tokens": 1, "labels": 1, "loss_mask": 1, "position_ids": 1, "attention_mask": 2}


def cp_slice(
    batch: dict[str, Any], *, cp_size: int | None = None, cp_rank: int | None = None, seq_keys: tuple[str, ...] = ()
) -> dict[str, Any]:
    """This context-parallel rank's part of ``batch``: chunks ``r`` and ``2*cp-1-r`` of ``2*cp`` sequence chunks.

    NOTE: causal attention makes late tokens costlier than early ones; pairing chunk ``r`` with its mirror
    balances the work (megatron's load-balanced layout, which its CP attention expects). Sizes default to
    megatron's parallel state. Keys not in the known [b, s] set (nor in ``seq_keys``, a model's own per-token
    ``[b, s]`` keys) are returned unchanged.
    """
    if cp_size is None or cp_rank is None:
        from megatron.core import parallel_state as mpu

        cp_size = mpu.get_context_parallel_world_size() if cp_size is None else cp_size
        cp_rank = mpu.get_context_parallel_rank() if cp_rank is None else cp_rank
    if cp_size == 1:
        return dict(batch)
    packed = batch.get("packed_seq_params")
    if packed is not None:
        return _cp_slice_packed(batch, packed, cp_size=cp_size, cp_rank=cp_rank, seq_keys=seq_keys)
    out = dict(batch)
    for key, dim in {**_SEQ_DIM, **dict.fromkeys(seq_keys, 1)}.items():
        val = batch.get(key)
        if val is None:
            continue
        seq = val.shape[dim]
        if seq % (2 * cp_size):
            raise ValueError(f"{key}: sequence length {seq} is not divisible by 2 * cp = {2 * cp_size}")
        chunks = val.view(*val.shape[:dim], 2 * cp_size, seq // (2 * cp_size), *val.shape[dim + 1 :])
        index = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=val.device)
        picked = chunks.index_select(dim, index)
        out[key] = picked.reshape(*val.shape[:dim], -1, *val.shape[dim + 1 :])
    return out


def _cp_slice_packed(batch: dict[str, Any], packed: Any, *, cp_size: int, cp_rank: int,
                     seq_keys: tuple[str, ...] = ()) -> dict[str, Any]:
    """A THD micro-batch's part on this CP rank: every sample's chunks ``r`` and ``2*cp-1-r`` (see
    :func:`~loongforge_megatron.engine.packing.cp_indices`); ``packed_seq_params`` stays global, as megatron's
    THD RoPE and our attention expect."""
    from loongforge_megatron.engine.packing import check_cu_seqlens, cp_indices

    tokens = batch["tokens"]
    if tokens.shape[0] != 1:
        raise ValueError(f"packed (THD) micro-batches hold one row of concatenated samples, got {tokens.shape[0]}")
    cu = packed.cu_seqlens_q_padded if packed.cu_seqlens_q_padded is not None else packed.cu_seqlens_q
    bounds = check_cu_seqlens(cu, total=tokens.shape[1], multiple_of=2 * cp_size, what="packed_seq_params.cu_seqlens_q")
    packed._loongforge_bounds = bounds
    index = cp_indices(bounds, cp_size=cp_size, cp_rank=cp_rank)  # NOTE: on the host; a key's device gets a copy
    moved: dict[torch.device, torch.Tensor] = {}
    out = dict(batch)
    for key in ("tokens", "labels", "loss_mask", "position_ids", *seq_keys):
        val = batch.get(key)
        if val is not None:
            here = moved.setdefault(val.device, index.to(val.device, non_blocking=True))
            out[key] = val.index_select(-1, here)  # NOTE: -1: 3-D (mrope) position ids too
    if batch.get("attention_mask") is not None:
        raise ValueError("a packed micro-batch carries packed_seq_params, not an attention_mask")
    return out


def packed_attention_mask(cu_seqlens: torch.Tensor, *, batch_size: int, seq_length: int) -> torch.Tensor:
    """Causal, block-diagonal boolean mask ``[b, 1, s, s]`` (True = masked) for sequences packed back to back.

    ``cu_seqlens`` are the cumulative document lengths over the flattened ``b * s`` tokens (megatron's THD
    ``PackedSeqParams.cu_seqlens_q``). NOTE: megatron's local attention refuses ``packed_seq_params``; with this
    mask each document attends only to itself, which equals separate sequences because RoPE scores depend only
    on relative positions (a document's constant offset cancels).
    """
    total = batch_size * seq_length
    bounds = cu_seqlens.to("cpu", torch.long)
    lengths = (bounds[1:] - bounds[:-1]).clamp(min=0)
    doc = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    if doc.numel() < total:  # trailing padding: its own "document"
        doc = torch.cat([doc, torch.full((total - doc.numel(),), len(lengths))])
    doc = doc[:total].view(batch_size, seq_length)
    causal = torch.ones(seq_length, seq_length, dtype=torch.bool).triu(diagonal=1)
    other_doc = doc[:, :, None] != doc[:, None, :]
    return (other_doc | causal).unsqueeze(1).to(cu_seqlens.device)
