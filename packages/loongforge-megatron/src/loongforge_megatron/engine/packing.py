"""Packed sequences (megatron's THD format): several samples back to back in one token stream, described by
``cu_seqlens``, attended without any cross-sample attention and without an ``[s, s]`` mask.

The carrier is megatron-core's :class:`~megatron.core.packed_seq_params.PackedSeqParams` (``qkv_format="thd"``),
so GPTModel, its RoPE (positions restart at every sample) and our attention (``layers/attention.py`` →
``layers/varlen.py``: ``varlen_attn`` on CUDA, an exact per-sample fallback elsewhere) all read the same value.

How a model uses it:

1. A dataset sample may carry ``cu_seqlens``: the row's sample boundaries ``[0, e_1, ..., s]`` (int tensor,
   covering the whole row; padding after a sample belongs to it and carries no loss). :func:`collate` turns
   ``b`` such rows into one THD micro-batch: ``[1, b*s]`` tensors plus ``packed_seq_params`` (global boundaries).
2. The forward step (``engine/step.py``) moves it to the device, slices it for context parallelism
   (:func:`cp_indices`: every sample is cut into ``2·cp`` chunks, rank ``r`` keeps chunks ``r`` and
   ``2·cp−1−r``, megatron's THD layout) and passes ``packed_seq_params=`` to the model.
3. Anything else that attends packed tokens (a ViT's per-image / per-window attention) builds the value with
   :func:`packed_seq_params` and calls ``spec.varlen.varlen_attention`` (or gives it to ``SDPAttention``).

Under context parallelism every sample length must be a multiple of ``2·cp`` (pad each sample: the SFT dataset
does). ``cu_seqlens`` always describes the *global* (un-split) stream, as megatron's THD kernels expect.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def check_cu_seqlens(cu_seqlens: Any, *, total: int | None = None, multiple_of: int = 1,
                     what: str = "cu_seqlens") -> list[int]:
    """The boundaries as a list, or a one-line ``ValueError`` saying what is wrong.

    Valid: a 1-D integer sequence starting at 0, non-decreasing, ending at ``total`` (the number of packed
    tokens, when given), every sample length a multiple of ``multiple_of`` (``2·cp`` under context parallelism).
    """
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point() or cu_seqlens.is_complex():
            raise ValueError(f"{what} must be a 1-D integer tensor, got {cu_seqlens.dtype} of shape "
                             f"{tuple(cu_seqlens.shape)}")
        bounds = [int(x) for x in cu_seqlens.tolist()]
    else:
        bounds = [int(x) for x in cu_seqlens]
    if len(bounds) < 2 or bounds[0] != 0:
        raise ValueError(f"{what} must start at 0 and hold at least one sample, got {_short(bounds)}")
    lengths = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
    if any(n < 0 for n in lengths):
        i = next(i for i, n in enumerate(lengths) if n < 0)
        raise ValueError(f"{what} must be non-decreasing, but entry {i + 1} ({bounds[i + 1]}) < entry {i} "
                         f"({bounds[i]}): {_short(bounds)}")
    if total is not None and bounds[-1] != total:
        raise ValueError(f"{what} ends at {bounds[-1]} but the packed sequence holds {total} tokens: "
                         f"{_short(bounds)}")
    if multiple_of > 1 and any(n % multiple_of for n in lengths):
        bad = next(n for n in lengths if n % multiple_of)
        raise ValueError(f"{what}: sample length {bad} is not a multiple of {multiple_of} (2 * cp: under context "
                         f"parallelism every packed sample is cut into 2 * cp chunks; pad each sample to a "
                         f"multiple of {multiple_of})")
    return bounds


def _short(bounds: Sequence[int]) -> str:
    return str(list(bounds)) if len(bounds) <= 12 else f"[{', '.join(map(str, bounds[:10]))}, ... ({len(bounds)} entries)]"


def packed_seq_params(cu_seqlens: Any, *, total: int | None = None, multiple_of: int = 1,
                      device: torch.device | str | None = None):
    """megatron ``PackedSeqParams`` (THD) for samples packed back to back with boundaries ``cu_seqlens``.

    Checked by :func:`check_cu_seqlens` (one host read: call it once per micro-batch, not per layer).
    ``max_seqlen_q`` / ``_kv`` are the longest sample (megatron's RoPE builds its table that long).
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    bounds = check_cu_seqlens(cu_seqlens, total=total, multiple_of=multiple_of)
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    longest = max(b - a for a, b in zip(bounds, bounds[1:], strict=False))
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                             max_seqlen_kv=longest)
    params._loongforge_bounds = bounds  # NOTE: read by bounds_of without a device -> host copy
    return params


def bounds_of(params: Any) -> list[int]:
    """The (padded, when given) boundaries of ``params`` as host ints, read once per ``params`` object.

    NOTE: cached on the object: every layer of a forward sees the same value, and a device → host read per layer
    would stall the GPU stream as many times.
    """
    cached = getattr(params, "_loongforge_bounds", None)
    if cached is None:
        cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        cached = check_cu_seqlens(cu, what="packed_seq_params.cu_seqlens_q")
        params._loongforge_bounds = cached
    return cached


def cp_indices(bounds: Sequence[int], *, cp_size: int, cp_rank: int, device: Any = None) -> torch.Tensor:
    """Global token positions context-parallel rank ``cp_rank`` holds, in its local order: for every sample,
    its chunks ``cp_rank`` and ``2·cp−1−cp_rank`` of ``2·cp`` (megatron / TransformerEngine's THD split)::

        sample [ c0 | c1 | c2 | c3 ]  (cp 2)   rank 0: c0 c3   rank 1: c1 c2   (then the next sample's)
    """
    parts = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        chunk = (b - a) // (2 * cp_size)
        for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
            parts.append(torch.arange(a + c * chunk, a + (c + 1) * chunk))
    out = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
    return out.to(device) if device is not None else out


def collate(samples: list[dict[str, Any]], *, concat_keys: Sequence[str] = ()) -> dict[str, Any]:
    """``b`` packed rows (each ``[..., s]`` tensors + its ``cu_seqlens``; rows may differ in length) → one THD
    micro-batch: ``[1, ..., b*s]`` tensors joined on their last (token) dimension (a VLM's ``[3, s]`` multimodal
    positions become ``[1, 3, t]``), ``packed_seq_params`` over the concatenation, the ``concat_keys`` (per-sample
    sizes: a VLM's image patches) joined on their first dimension, and ``real_tokens`` (the samples' tokens, for the
    packing efficiency in the log) when the rows carry ``num_tokens``."""
    out: dict[str, Any] = {}
    bounds = [0]
    for s in samples:
        row = check_cu_seqlens(s["cu_seqlens"], total=int(s["tokens"].shape[-1]), what="a sample's cu_seqlens")
        bounds += [bounds[-1] + x for x in row[1:]]
    for key in samples[0]:
        if key in ("cu_seqlens", "num_tokens"):
            continue
        if key in concat_keys:
            out[key] = torch.cat([torch.as_tensor(s[key]) for s in samples])
            continue
        out[key] = torch.cat([torch.as_tensor(s[key]) for s in samples], dim=-1)[None]
    out["packed_seq_params"] = packed_seq_params(bounds, total=bounds[-1])
    if "num_tokens" in samples[0]:
        out["real_tokens"] = int(sum(int(s["num_tokens"]) for s in samples))
    return out
