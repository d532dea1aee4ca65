"""Core attention on ``torch.nn.functional.scaled_dot_product_attention`` (flash / memory-efficient kernels on
GPU, the math kernel on CPU), a drop-in for megatron-core's ``DotProductAttention`` without TransformerEngine.

Adds what the local DotProductAttention lacks: GQA without materialising repeated K/V (``enable_gqa``),
different Q/K and V head sizes (MLA), and context parallelism by all-gathering K/V over the CP group.

Context parallelism (megatron's load-balanced layout): the sequence is cut into 2·cp chunks and CP rank r holds
chunks r and 2·cp−1−r. Each rank attends its local queries to the gathered keys/values of the whole sequence with
a causal mask built from the global positions::

    keys (all CP ranks, gathered, in sequence order)   q chunk r:          attends to chunks 0..r
    [ c0 | c1 | ... | c_{2cp-1} ]                       q chunk 2cp-1-r:    attends to chunks 0..2cp-1-r
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

_AUTO_SCALE = object()


def _cp_positions(seq_local: int, cp_size: int, cp_rank: int, device) -> Tensor:
    """Global positions of this CP rank's local tokens (two mirrored chunks)."""
    chunk = seq_local // 2
    first = torch.arange(chunk, device=device) + cp_rank * chunk
    second = torch.arange(chunk, device=device) + (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([first, second])


def _all_gather_seq(x: Tensor, group) -> Tensor:
    """All-gather ``[s, b, h, d]`` along the sequence with autograd, returning keys in sequence order."""
    import torch.distributed.nn.functional as dist_nn

    parts = dist_nn.all_gather(x.contiguous(), group=group)
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

        if packed_seq_params is not None:
            raise ValueError("SDPAttention takes packed sequences as a block-diagonal attention_mask, not THD")
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by SDPAttention (use kernels.spec: local or te)")
        mask_type = attn_mask_type or self.attn_mask_type
        s_q = query.shape[0]
        if self.cp_size > 1:
            key = _all_gather_seq(key, self.cp_group)
            value = _all_gather_seq(value, self.cp_group)
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        gqa = q.shape[1] != k.shape[1]
        causal_default = mask_type == AttnMaskType.causal and attention_mask is None
        mask = None
        is_causal = False
        if self.cp_size > 1:
            from torch.distributed import get_rank

            rank = get_rank(self.cp_group)
            q_pos = _cp_positions(s_q, self.cp_size, rank, q.device)
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
