"""Ring attention: full (non-causal) attention over a sequence split into contiguous chunks over a context-parallel
group, without gathering the keys and values and without splitting heads (what Ulysses needs: heads >= cp).

Rank r holds tokens ``[r*s, (r+1)*s)`` of every tensor. The keys / values travel around the ring (rank r sends to
r+1, receives from r-1); at step i rank r attends its queries to chunk ``r - i`` and merges the partial results
with the online softmax (each block's output and log-sum-exp)::

    step 0: q_r x kv_r     step 1: q_r x kv_(r-1)    ...    out = sum_i exp(lse_i - lse) * out_i

The backward runs the ring again: each rank adds its queries' share of the gradient of the chunk it holds to that
chunk's ``dk / dv`` accumulator, which travels with the chunk and is home after ``cp`` exchanges.

Packed samples (``segments``: each global token's sample index) attend only within their sample: a block whose
queries and keys share no sample is skipped. The queries need not be the keys' tokens (``q_segments``: a joint
text-image attention sends only the image keys around, ``return_lse`` merging the text keys' block). The blocks are computed in fp32 with a ``[s, s]`` score matrix per
block (the ring's point: memory per block, not per sequence).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


def _exchange(tensors: list[Tensor], group: Any) -> list[Tensor]:
    """Send ``tensors`` to the next rank of the ring, return the previous rank's (same shapes)."""
    rank, size = group.rank(), group.size()
    nxt = dist.get_global_rank(group, (rank + 1) % size)
    prv = dist.get_global_rank(group, (rank - 1) % size)
    received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, prv, group) for r in received]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return received


def _mask(segments: tuple[Tensor, Tensor] | None, *, k_chunk: int, s: int) -> Tensor | None:
    """``[sq, s]`` True where a query and key chunk ``k_chunk``'s token (``segments``: the queries' samples, every
    key's) share a sample."""
    if segments is None:
        return None
    q_seg, k_seg = segments
    return q_seg[:, None] == k_seg[k_chunk * s:(k_chunk + 1) * s][None, :]


def _scores(q: Tensor, k: Tensor, *, scale: float, mask: Tensor | None) -> Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def _block(q: Tensor, k: Tensor, v: Tensor, *, scale: float, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """One block's normalised output and log-sum-exp (``-inf`` for a query with no key in the block)."""
    s = _scores(q, k, scale=scale, mask=mask)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return torch.matmul(p, v), lse


class _RingAttention(torch.autograd.Function):
    """``[b, h, s, d]`` fp32 q / k / v of this rank -> its attention output; the backward is a second ring."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, group: Any, q_seg: Tensor | None, k_seg: Tensor | None,
                scale: float) -> Tensor:
        rank, size, s = group.rank(), group.size(), k.shape[2]
        segments = None if q_seg is None else (q_seg, k_seg)
        out, lse = _block(q, k, v, scale=scale, mask=_mask(segments, k_chunk=rank, s=s))
        kv = (k, v)
        for step in range(1, size):
            kv = _exchange(list(kv), group)
            mask = _mask(segments, k_chunk=(rank - step) % size, s=s)
            if mask is not None and not bool(mask.any()):
                continue
            o, l_ = _block(q, *kv, scale=scale, mask=mask)
            # NOTE: a query with no key yet has lse -inf: its weight is taken as 0, not exp(-inf + inf)
            new = torch.logaddexp(lse, l_)
            safe = torch.where(torch.isinf(new), 0.0, new)
            out = out * torch.exp(lse - safe)[..., None] + o * torch.exp(l_ - safe)[..., None]
            lse = new
        ctx.save_for_backward(q, k, v, out, lse, q_seg, k_seg)
        ctx.group, ctx.scale, ctx.has_segments = group, scale, q_seg is not None
        return out, lse

    @staticmethod
    def backward(ctx, dout: Tensor, dlse: Tensor | None) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse, q_seg, k_seg = ctx.saved_tensors
        segments = (q_seg, k_seg) if ctx.has_segments else None
        group, scale = ctx.group, ctx.scale
        rank, size, s = group.rank(), group.size(), k.shape[2]
        # NOTE: d lse / d scores = p, so the log-sum-exp's gradient only shifts every row's delta
        delta = (dout * out).sum(-1, keepdim=True)
        if dlse is not None:
            delta = delta - dlse[..., None]
        dq = torch.zeros_like(q)
        k_cur, v_cur, dk, dv = k, v, torch.zeros_like(k), torch.zeros_like(v)
        for step in range(size):
            mask = _mask(segments, k_chunk=(rank - step) % size, s=s)
            if mask is None or bool(mask.any()):
                finite = torch.where(torch.isinf(lse), 0.0, lse)  # NOTE: a query without keys: p = 0
                p = torch.exp(_scores(q, k_cur, scale=scale, mask=mask) - finite[..., None])
                dv = dv + torch.matmul(p.transpose(-1, -2), dout)
                ds = p * (torch.matmul(dout, v_cur.transpose(-1, -2)) - delta)
                dq = dq + torch.matmul(ds, k_cur) * scale
                dk = dk + torch.matmul(ds.transpose(-1, -2), q) * scale
            if size == 1:
                break
            if step < size - 1:
                k_cur, v_cur, dk, dv = _exchange([k_cur, v_cur, dk, dv], group)
            else:  # NOTE: the accumulators go one step further than the chunks: home, with every rank's share
                dk, dv = _exchange([dk, dv], group)
        return dq, dk, dv, None, None, None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, group: Any, segments: Tensor | None = None,
                   q_segments: Tensor | None = None, scale: float | None = None,
                   return_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Attention of this rank's ``[b, s, heads, d]`` queries over the keys / values of every rank of ``group``
    (rank r holds tokens ``[r*s, (r+1)*s)``) -> ``[b, s, heads, d]`` in ``q``'s dtype.

    ``segments`` ``[cp * s]``: the sample each global token belongs to (packed samples attend only their own);
    None: each batch row is one sequence. ``q_segments`` ``[sq]``: the samples of queries that are not this
    rank's key tokens (with ``segments`` then the keys' only). ``return_lse``: also the fp32 log-sum-exp
    ``[b, sq, heads]`` of every query's scores (to merge another block of keys with the online softmax; -inf for a
    query with no key here), with its gradient."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    q32, k32, v32 = (t.transpose(1, 2).float() for t in (q, k, v))
    if segments is not None and q_segments is None:
        s = k.shape[1]
        q_segments = segments[group.rank() * s:(group.rank() + 1) * s]
    out, lse = _RingAttention.apply(q32, k32, v32, group, q_segments, segments, scale)
    out = out.transpose(1, 2).to(q.dtype)
    return (out, lse.transpose(1, 2)) if return_lse else out


def attention_lse(q: Tensor, k: Tensor, v: Tensor, *, key_mask: Tensor | None = None, mask: Tensor | None = None,
                  scale: float | None = None) -> tuple[Tensor, Tensor]:
    """Plain attention of ``[b, s, heads, d]`` tensors with the fp32 log-sum-exp ``[b, s, heads]`` (a block of keys
    every rank holds, to merge with :func:`ring_attention`'s); ``key_mask [b, sk]`` True for keys to attend, or
    ``mask [sq, sk]`` True where a query attends a key."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    q32, k32, v32 = (t.transpose(1, 2).float() for t in (q, k, v))
    if key_mask is not None:
        mask = key_mask[:, None, None, :].to(torch.bool)
    out, lse = _block(q32, k32, v32, scale=scale, mask=mask)
    return out.transpose(1, 2).to(q.dtype), lse.transpose(1, 2)


def merge_attention(a: tuple[Tensor, Tensor], b: tuple[Tensor, Tensor]) -> Tensor:
    """The attention over two blocks of keys from each block's ``(out [b, s, heads, d], lse [b, s, heads])``."""
    (out_a, lse_a), (out_b, lse_b) = a, b
    lse = torch.logaddexp(lse_a, lse_b)
    lse = torch.where(torch.isinf(lse), 0.0, lse)  # NOTE: a query no key of either block takes: zeros
    merged = out_a.float() * torch.exp(lse_a - lse)[..., None] + out_b.float() * torch.exp(lse_b - lse)[..., None]
    return merged.to(out_a.dtype)
