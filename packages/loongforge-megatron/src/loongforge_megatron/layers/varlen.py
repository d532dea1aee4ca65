"""Attention over packed variable-length segments (THD: ``[tokens, heads, dim]`` + ``cu_seqlens``).

On CUDA in bf16 / fp16 this is ``torch.nn.attention.varlen.varlen_attn`` (flash varlen: no mask tensor at all);
elsewhere (CPU, fp32, dropout, head sizes flash does not take) an exact fallback runs SDPA once per segment, so
no mask larger than one segment's is ever built.

Query segment ``i`` is ``q[cu_q[i]:cu_q[i+1]]`` and attends key segment ``k[cu_k[i]:cu_k[i+1]]``. ``causal``
aligns the mask to the bottom right when a query segment is shorter than its key segment (its queries are the
*last* positions of the keys: what a context-parallel chunk of a sample needs)::

    q (2 tokens) vs k (4 tokens), causal:   q0 -> k0 k1 k2      q1 -> k0 k1 k2 k3
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


def flash_varlen_applies(q: Tensor, k: Tensor, v: Tensor, *, dropout: float) -> bool:
    """Whether ``varlen_attn`` (flash) takes these tensors: CUDA, fp16 / bf16, equal q / k / v head sizes
    (a multiple of 8, at most 256), heads a multiple of the key heads, no dropout (varlen_attn has none)."""
    d = q.shape[-1]
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and k.dtype == q.dtype and v.dtype == q.dtype
            and k.shape[-1] == d and v.shape[-1] == d and d % 8 == 0 and d <= 256
            and q.shape[1] % k.shape[1] == 0 and dropout == 0.0)


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, *, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                     max_seqlen_q: int, max_seqlen_k: int, causal: bool, scale: float | None = None,
                     dropout: float = 0.0, bounds_q: Sequence[int] | None = None,
                     bounds_k: Sequence[int] | None = None) -> Tensor:
    """``[Tq, h, dv]`` attention of ``q [Tq, h, dk]`` over ``k [Tk, hk, dk]`` / ``v [Tk, hk, dv]`` per segment.

    ``hk`` may divide ``h`` (GQA, never repeated in memory on the flash path). ``bounds_q`` / ``bounds_k``:
    the same boundaries as host ints, when the caller has them (the fallback needs them; else read once here).
    """
    if flash_varlen_applies(q, k, v, dropout=dropout):
        from torch.nn.attention.varlen import varlen_attn

        return varlen_attn(q, k, v, cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32), int(max_seqlen_q),
                           int(max_seqlen_k), scale=scale, window_size=(-1, 0) if causal else (-1, -1))
    bq = list(bounds_q) if bounds_q is not None else [int(x) for x in cu_seqlens_q.tolist()]
    bk = list(bounds_k) if bounds_k is not None else [int(x) for x in cu_seqlens_k.tolist()]
    return segment_attention(q, k, v, bounds_q=bq, bounds_k=bk, causal=causal, scale=scale, dropout=dropout)


def segment_attention(q: Tensor, k: Tensor, v: Tensor, *, bounds_q: Sequence[int], bounds_k: Sequence[int],
                      causal: bool, scale: float | None = None, dropout: float = 0.0) -> Tensor:
    """The exact reference / fallback: one SDPA call per segment (masks at most one segment's size)."""
    if len(bounds_q) != len(bounds_k):
        raise ValueError(f"query and key boundaries describe {len(bounds_q) - 1} and {len(bounds_k) - 1} segments")
    gqa = q.shape[1] != k.shape[1]
    outs = []
    for (qa, qb), (ka, kb) in zip(zip(bounds_q, bounds_q[1:], strict=False), zip(bounds_k, bounds_k[1:], strict=False), strict=False):
        nq, nk = qb - qa, kb - ka
        if nq == 0:
            continue
        if nk == 0:
            raise ValueError(f"a query segment of {nq} tokens has no keys (segment [{ka}, {kb}))")
        # [t, h, d] -> [1, h, t, d]
        qs, ks, vs = (t[a:b].transpose(0, 1)[None] for t, a, b in ((q, qa, qb), (k, ka, kb), (v, ka, kb)))
        mask, is_causal = None, False
        if causal and nq == nk:
            is_causal = nq > 1
        elif causal:
            if nq > nk:
                raise ValueError(f"a causal query segment ({nq} tokens) longer than its keys ({nk})")
            pos_q = torch.arange(nk - nq, nk, device=q.device)
            mask = torch.arange(nk, device=q.device)[None, :] <= pos_q[:, None]  # True: attend
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, dropout_p=dropout, is_causal=is_causal,
                                             scale=scale, enable_gqa=gqa)
        outs.append(out[0].transpose(0, 1))
    if not outs:
        return q.new_zeros(0, q.shape[1], v.shape[-1])
    out = torch.cat(outs)
    if out.shape[0] != q.shape[0]:
        raise ValueError(f"the query boundaries cover {out.shape[0]} of {q.shape[0]} tokens (they must end at the "
                         "number of packed tokens)")
    return out
