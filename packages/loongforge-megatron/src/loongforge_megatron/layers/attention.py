"""Core attention on ``torch.nn.functional.scaled_dot_product_attention`` (flash / memory-efficient kernels on
GPU, the math kernel on CPU), a drop-in for megatron-core's ``DotProductAttention`` without TransformerEngine.

Adds what the local DotProductAttention lacks: GQA without materialising repeated K/V (``enable_gqa``),
different Q/K and V head sizes (MLA), and context parallelism by all-gathering K/V over the CP group.

Context parallelism (megatron's load-balanced layout): the sequence is cut into 2·cp chunks and CP rank r holds
chunks r and 2·cp−1−r. Each rank attends its local queries to the gathered keys/values of the whole sequence with
a causal mask built from the global positions::

    keys (all CP ranks, gathered, in sequence order)   q chunk r:          attends to chunks 0..r
    [ c0 | c1 | ... | c_{2cp-1} ]                       q chunk 2cp-1-r:    attends to chunks 0..2cp-1-r

Packed sequences (``packed_seq_params``, THD; ``engine/packing.py``) go to :func:`spec.varlen.varlen_attention`
(``varlen_attn`` on CUDA, per-sample SDPA elsewhere): no ``[s, s]`` mask. Under CP every sample is split the same
way as the whole sequence above, and each local chunk attends the gathered keys of its own sample up to its end.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

_AUTO_SCALE = object()


def cp_positions(seq_local: int, cp_size: int, cp_rank: int, device) -> Tensor:
    """Global positions of this CP rank's local tokens (two mirrored chunks)."""
    chunk = seq_local // 2
    first = torch.arange(chunk, device=device) + cp_rank * chunk
    second = torch.arange(chunk, device=device) + (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([first, second])


def _gather_ranks(x: Tensor, group) -> Tensor:
    """Every rank's ``x`` of ``group`` concatenated on dim 0 in rank order, with autograd: the backward sums each
    rank's gradient and gives every rank its own part (a reduce-scatter: megatron's sequence-parallel gather).

    NOTE: not ``torch.distributed.nn``'s all_gather, whose backward on gloo scatters from group ranks as if they
    were global ones and fails for any group smaller than the world (context parallelism next to dp or tp)."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(x.contiguous(), tensor_parallel_output_grad=True, group=group)


def all_gather_seq(x: Tensor, group) -> Tensor:
    """All-gather ``[s, b, h, d]`` along the sequence with autograd, returning keys in sequence order."""
    parts = _gather_ranks(x, group).chunk(group.size(), dim=0)
    cp = len(parts)
    chunks: list[Tensor | None] = [None] * (2 * cp)
    for r, part in enumerate(parts):
        a, b = part.chunk(2, dim=0)
        chunks[r], chunks[2 * cp - 1 - r] = a, b
    return torch.cat(chunks, dim=0)


class SDPAttention(torch.nn.Module):
    """megatron ``DotProductAttention`` interface: ``forward(q, k, v, attention_mask, ...) -> [s, b, h*dv]``.

    ``q``: ``[s, b, heads_local, dk]``, ``k``: ``[s, b, groups_local, dk]``, ``v``: ``[s, b, groups_local, dv]``.
    ``attention_mask`` (optional) is megatron's boolean mask, True where attention is *not* allowed.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__()
        from megatron.core.process_groups_config import ProcessGroupCollection

        self.config = config
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        k_dim = k_channels or config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(k_dim)
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.cp_group = getattr(pg_collection, "cp", None)
        self.cp_size = self.cp_group.size() if self.cp_group is not None else 1

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type=None, attention_bias: Tensor | None = None, packed_seq_params=None) -> Tensor:
        from megatron.core.transformer.enums import AttnMaskType

        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by SDPAttention (use kernels.layers: local or te)")
        mask_type = attn_mask_type or self.attn_mask_type
        if packed_seq_params is not None:
            if attention_mask is not None:
                raise ValueError("SDPAttention takes packed sequences as packed_seq_params (cu_seqlens) or as an "
                                 "attention_mask, not both")
            causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
            return self._packed(query, key, value, packed_seq_params, causal=causal)
        s_q = query.shape[0]
        if self.cp_size > 1:
            key = all_gather_seq(key, self.cp_group)
            value = all_gather_seq(value, self.cp_group)
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        gqa = q.shape[1] != k.shape[1]
        causal_default = mask_type == AttnMaskType.causal and attention_mask is None
        mask = None
        is_causal = False
        if self.cp_size > 1:
            from torch.distributed import get_rank

            rank = get_rank(self.cp_group)
            q_pos = cp_positions(s_q, self.cp_size, rank, q.device)
            k_pos = torch.arange(k.shape[2], device=q.device)
            allowed = k_pos[None, :] <= q_pos[:, None]
            if attention_mask is not None:
                raise ValueError("explicit attention masks with context parallelism are not supported (recipes reject sft with cp > 1)")
            mask = allowed
        elif attention_mask is not None:
            mask = ~attention_mask  # SDPA: True = take part in attention
        elif causal_default and s_q > 1:
            is_causal = True
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0, is_causal=is_causal,
            scale=self.softmax_scale, enable_gqa=gqa,
        )
        # [b, h, s, dv] -> [s, b, h*dv]
        b, h, s, dv = out.shape
        return out.permute(2, 0, 1, 3).reshape(s, b, h * dv)

    def _packed(self, query: Tensor, key: Tensor, value: Tensor, params, *, causal: bool) -> Tensor:
        """THD attention (``[t, h, d]``, megatron squeezes the batch of 1) over ``params``' samples -> ``[t, h*dv]``."""
        from loongforge_megatron.engine.packing import bounds_of
        from loongforge_megatron.layers.varlen import varlen_attention

        if params.qkv_format != "thd":
            raise ValueError(f"SDPAttention takes packed sequences in the thd format, got qkv_format "
                             f"{params.qkv_format!r}")
        q, k, v = (t.squeeze(1) if t.dim() == 4 else t for t in (query, key, value))
        bounds = bounds_of(params)
        dropout = self.dropout if self.training else 0.0
        if self.cp_size == 1:
            if bounds[-1] != q.shape[0]:
                raise ValueError(f"packed_seq_params.cu_seqlens_q ends at {bounds[-1]} but the packed sequence "
                                 f"holds {q.shape[0]} tokens")
            cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
            longest = max(b - a for a, b in zip(bounds, bounds[1:], strict=False))
            out = varlen_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                                   max_seqlen_k=longest, causal=causal, scale=self.softmax_scale, dropout=dropout,
                                   bounds_q=bounds, bounds_k=bounds)
        else:
            from torch.distributed import get_rank

            plan = _cp_plan(params, bounds, cp_size=self.cp_size, cp_rank=get_rank(self.cp_group), causal=causal,
                            local_tokens=q.shape[0], device=q.device)
            # every rank's local keys, in rank order; plan.key_index picks each local chunk's keys from them
            k_all, v_all = _gather_ranks(k, self.cp_group), _gather_ranks(v, self.cp_group)
            k_seg, v_seg = k_all.index_select(0, plan.key_index), v_all.index_select(0, plan.key_index)
            out = varlen_attention(q, k_seg, v_seg, cu_seqlens_q=plan.cu_q, cu_seqlens_k=plan.cu_k,
                                   max_seqlen_q=plan.max_q, max_seqlen_k=plan.max_k, causal=causal,
                                   scale=self.softmax_scale, dropout=dropout, bounds_q=plan.bounds_q,
                                   bounds_k=plan.bounds_k)
        return out.reshape(out.shape[0], -1)


class _CPPlan:
    """Which gathered keys each of this CP rank's local chunks attends (built once per micro-batch)."""

    def __init__(self, bounds: list[int], *, cp_size: int, cp_rank: int, causal: bool, device) -> None:
        from loongforge_megatron.engine.packing import cp_indices

        # position in the rank-ordered gathered buffer of every global token
        held = torch.cat([cp_indices(bounds, cp_size=cp_size, cp_rank=r) for r in range(cp_size)])
        where = torch.empty_like(held)
        where[held] = torch.arange(held.numel())
        keys, bq, bk = [], [0], [0]
        for a, b in zip(bounds, bounds[1:], strict=False):
            chunk = (b - a) // (2 * cp_size)
            if chunk == 0:
                continue
            for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
                end = a + (c + 1) * chunk if causal else b
                keys.append(torch.arange(a, end))
                bq.append(bq[-1] + chunk)
                bk.append(bk[-1] + end - a)
        self.key_index = where[torch.cat(keys)].to(device) if keys else torch.zeros(0, dtype=torch.long, device=device)
        self.bounds_q, self.bounds_k = bq, bk
        self.cu_q = torch.tensor(bq, dtype=torch.int32, device=device)
        self.cu_k = torch.tensor(bk, dtype=torch.int32, device=device)
        self.max_q = max((y - x for x, y in zip(bq, bq[1:], strict=False)), default=0)
        self.max_k = max((y - x for x, y in zip(bk, bk[1:], strict=False)), default=0)


def _cp_plan(params, bounds: list[int], *, cp_size: int, cp_rank: int, causal: bool, local_tokens: int,
             device) -> _CPPlan:
    """The :class:`_CPPlan` of ``params`` (cached on it: every layer of the forward uses the same one)."""
    from loongforge_megatron.engine.packing import check_cu_seqlens

    cache = getattr(params, "_loongforge_cp_plans", None)
    if cache is None:
        check_cu_seqlens(bounds, total=local_tokens * cp_size, multiple_of=2 * cp_size,
                         what="packed_seq_params.cu_seqlens_q")
        cache = params._loongforge_cp_plans = {}
    plan = cache.get(causal)
    if plan is None:
        plan = cache[causal] = _CPPlan(bounds, cp_size=cp_size, cp_rank=cp_rank, causal=causal, device=device)
    return plan
