"""DeepSeek Sparse Attention (DSA) on megatron's MLA: a lightning indexer scores every key for each query, each
query attends to its ``topk`` best keys, and the indexer learns from a KL loss against the attention itself.

The indexer (transformers' ``DeepseekV32Indexer``)::

    q_i = wq_b(qr) -> [s, b, H_i, D_i]      k_i = LayerNorm(wk(x)) -> [s, b, D_i]      (RoPE, half-split, on the
    w   = weights_proj(x) * H_i**-0.5                                                 first qk_rope_head_dim dims)
    score[b, t, j] = sum_h w[t, h] * relu(q_i[t, h] . k_i[j] * D_i**-0.5)   (causal: -inf where j > t)

Training runs in two phases (the :class:`DSAPhase` all layers share, switched by the model's step hook):
dense warm-up (full causal attention; the indexer alone learns, from the KL loss to the dense attention
distribution) then sparse training (attention restricted to the top-k; the KL loss over the selected keys). The
indexer reads detached inputs, so its loss trains the indexer only (DeepSeek-V3.2's recipe); the loss is attached
to the attention output with megatron-core's ``DSAIndexerLossAutoScaler`` so it back-propagates on every pipeline
stage, and follows the token-sum convention of the LM loss (``calculate_per_token_loss``).

The restricted attention is exact plain torch (a boolean mask over SDPA) off CUDA, and the kernel registry's
``sparse_mla_attention`` (Triton / TileLang) on CUDA. The kernel takes MLA's absorbed form (q [T, H, D], kv
[T, G, D], value = kv's first d_v channels); megatron's MLA gives per-head k and v, which map onto it exactly as
``q' = [0 | q]`` and ``kv' = [v | k]`` with one kv group per head (q' . kv' = q . k; value = v).

Under context parallelism (megatron's load-balanced layout, ``layers/attention.py``) a rank holds two mirrored
chunks of queries; the top-k needs every earlier key, so the indexer's keys and the attention's keys and values are
all-gathered over the CP group in sequence order (megatron-core's DSA gathers its indexer keys the same way), and
the causal masks use global positions. Each rank's indexer loss covers its own queries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class DSAPhase:
    """What every DSA layer of a model reads: the recipe's values and the current phase (``sparse``)."""

    topk: int
    loss_weight: float
    warmup_steps: int
    provider: str = "auto"
    accelerator: Any = None
    sparse: bool = False
    losses: list[tuple[Tensor, int]] = field(default_factory=list)  # this step's (indexer loss sum, queries)
    layers: int = 0  # DSA layers on this rank
    kernel_calls: int = 0  # forwards that ran the registry's sparse MLA kernel
    selection: tuple[Tensor, Tensor] | None = None  # the last indexer's (idx, valid), for layers that share it

    def at_step(self, step: int) -> None:
        """Enter the phase of optimizer step ``step`` (0-based): sparse from ``warmup_steps`` on."""
        self.sparse = step >= self.warmup_steps
        self.losses.clear()

    def loss_per_token(self) -> float:
        """This step's weighted indexer loss per query token, summed over this rank's DSA layers."""
        if not self.losses:
            return 0.0
        total = float(sum(float(loss) for loss, _ in self.losses))
        return total / sum(n for _, n in self.losses) * self.layers


class LightningIndexer(torch.nn.Module):
    """The indexer's projections and norm; parameter names are megatron-core's ``DSAIndexer``'s."""

    def __init__(self, *, hidden_size: int, q_lora_rank: int, heads: int, head_dim: int, rope_dim: int,
                 dtype: torch.dtype, interleaved: bool = False) -> None:
        super().__init__()
        self.heads, self.head_dim, self.rope_dim, self.interleaved = heads, head_dim, rope_dim, interleaved
        self.linear_wq_b = torch.nn.Linear(q_lora_rank, heads * head_dim, bias=False, dtype=dtype)
        self.linear_wk = torch.nn.Linear(hidden_size, head_dim, bias=False, dtype=dtype)
        # NOTE: transformers' k_norm is a LayerNorm with its default bias and eps 1e-6 (not the model's RMSNorm)
        self.k_norm = torch.nn.LayerNorm(head_dim, eps=1e-6, dtype=dtype)
        self.linear_weights_proj = torch.nn.Linear(hidden_size, heads, bias=False, dtype=dtype)

    def project(self, x: Tensor, qr: Tensor, *, cos: Tensor, sin: Tensor, gather: Any = None
                ) -> tuple[Tensor, Tensor, Tensor]:
        """The indexer's queries ``[s, b, H, D]``, keys ``[keys, b, D]`` and head weights ``[s, b, H]`` (fp32, with
        ``H**-0.5`` folded in) from ``x`` [s, b, hidden] and ``qr`` [s, b, q_lora_rank] (``cos`` / ``sin``: these
        tokens' rotations). Under context parallelism ``gather`` turns this rank's keys into the whole sequence's."""
        s, b, _ = x.shape
        q = self.linear_wq_b(qr).view(s, b, self.heads, self.head_dim)
        k = self.k_norm(self.linear_wk(x)).view(s, b, 1, self.head_dim)
        q = _rope(q, cos, sin, self.rope_dim, interleaved=self.interleaved)
        k = _rope(k, cos, sin, self.rope_dim, interleaved=self.interleaved).squeeze(2)
        if gather is not None:
            k = gather(k)
        return q, k, self.linear_weights_proj(x).float() * self.heads**-0.5

    def forward(self, x: Tensor, qr: Tensor, *, cos: Tensor, sin: Tensor, gather: Any = None,
                future: Tensor | None = None) -> Tensor:
        """Index scores ``[b, s, keys]`` (fp32, causal -inf) of the whole sequence at once (``future`` [s, keys]
        masks the keys after each query; None: keys = queries). Training reads them a query block at a time
        (:func:`index_and_learn`): at long context the per-head scores do not fit."""
        q, k, w = self.project(x, qr, cos=cos, sin=sin, gather=gather)
        if future is None:
            future = _future(0, q.shape[0], k.shape[0], x.device)
        return index_scores(q, k, w, future)


def index_scores(q: Tensor, k: Tensor, w: Tensor, future: Tensor) -> Tensor:
    """``score[b, t, j] = sum_h w[t, h] * relu(q[t, h] . k[j] * D**-0.5)``, -inf where ``future`` [t, j]:
    ``q`` [t, b, H, D], ``k`` [keys, b, D], ``w`` [t, b, H] -> ``[b, t, keys]`` fp32.

    NOTE: the dot products run in the projections' dtype (bf16 on GPU: tensor cores, fp32 accumulation; DeepSeek's
    own indexer runs them in FP8), the ReLU and the head sum in fp32."""
    scores = torch.einsum("sbhd,tbd->bsht", q, k).float() * q.shape[-1] ** -0.5
    scores = torch.einsum("bsht,sbh->bst", F.relu(scores), w)
    return scores.masked_fill(future, float("-inf"))


def _future(start: int, end: int, n_keys: int, device) -> Tensor:
    """``[end - start, n_keys]``: True at the keys after each of the queries ``start:end`` (keys = queries)."""
    return torch.arange(n_keys, device=device)[None, :] > torch.arange(start, end, device=device)[:, None]


def _rope(t: Tensor, cos: Tensor, sin: Tensor, dim: int, *, interleaved: bool = False) -> Tensor:
    """Half-split RoPE on ``t``'s leading ``dim`` channels (``cos`` / ``sin``: [s, dim], transformers' layout);
    ``interleaved``: the pairs are (0, 1), (2, 3) ... (GLM-5's indexer): de-interleaved first, as transformers does."""
    rot, rest = t[..., :dim], t[..., dim:]
    if interleaved:
        rot = torch.cat([rot[..., 0::2], rot[..., 1::2]], dim=-1)
    c, s_ = cos.view(cos.shape[0], 1, 1, dim).to(t.dtype), sin.view(sin.shape[0], 1, 1, dim).to(t.dtype)
    half = dim // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * c + rotated * s_, rest], dim=-1)


def select_topk(scores: Tensor, topk: int) -> tuple[Tensor, Tensor]:
    """The ``topk`` best keys per query: indices ``[b, s, k]`` (int64) and whether each is a real key (not a masked
    future one, which a query with fewer than ``topk`` keys also draws)."""
    k = min(topk, scores.shape[-1])
    values, idx = scores.detach().topk(k, dim=-1)
    return idx, torch.isfinite(values)


def selection_mask(idx: Tensor, valid: Tensor, n_keys: int) -> Tensor:
    """Boolean ``[b, s, n_keys]``: True at each query's selected real keys."""
    mask = torch.zeros(*idx.shape[:-1], n_keys, dtype=torch.bool, device=idx.device)
    return mask.scatter(-1, idx, valid)


def indexer_kl_loss(scores: Tensor, query: Tensor, key: Tensor, *, scale: float, allowed: Tensor,
                    tp_group: Any = None) -> Tensor:
    """Sum over queries of KL(p || softmax(scores)) where p is the attention distribution summed over all heads
    (TP ranks' heads all-reduced) and L1-normalised; both restricted to ``allowed`` [b, s, keys] keys.

    ``scores`` [b, s, keys]; ``query`` [s, b, h, d], ``key`` [keys, b, h, d] are detached: the loss trains the
    indexer only."""
    from megatron.core.transformer.experimental_attention_variant import dsa_indexer_loss as kl

    with torch.no_grad():
        # NOTE: the logits in the attention's own dtype (as its kernels compute them), the softmax in fp32
        attn = torch.einsum("sbhd,tbhd->bhst", query, key).float() * scale
        target = attn.masked_fill(~allowed.unsqueeze(1), float("-inf")).softmax(-1).sum(1)
        del attn
        if tp_group is not None and tp_group.size() > 1:
            torch.distributed.all_reduce(target, group=tp_group)
        target = kl.normalize_indexer_target_(target)
    log_p = scores.masked_fill(~allowed, float("-inf")).log_softmax(-1)
    log_p = log_p.masked_fill(~allowed, 0.0)
    return kl.indexer_kl_sum(target, log_p, allowed)


# NOTE: elements (fp32) of one query block's per-head scores, [b, block, heads, keys]: 1 GiB (at 32k keys and 32 index
# heads, 256 queries a block: the per-block launches stay few)
BLOCK_ELEMENTS = 2**28


def index_and_learn(indexer: LightningIndexer, x: Tensor, qr: Tensor, *, cos: Tensor, sin: Tensor, topk: int,
                    gather: Any = None, future: Tensor | None = None, query: Tensor | None = None,
                    key: Tensor | None = None, scale: float = 1.0, sparse: bool = False, tp_group: Any = None,
                    block: int | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """Each query's ``topk`` keys (:func:`select_topk`: ``idx``, ``valid`` [b, s, k]) and, given the attention's
    detached ``query`` / ``key``, the indexer loss (:func:`indexer_kl_loss`, over the selected keys when
    ``sparse``, else over every causal key; None without them).

    The scores are made ``block`` queries at a time (default: :data:`BLOCK_ELEMENTS` per-head scores), so neither
    the per-head scores ``[b, s, H, keys]`` nor the scores ``[b, s, keys]`` exist for the whole sequence; with the
    loss each block is checkpointed (its scores and target are remade in the backward), so only the indexer's
    projections are kept for the backward. ``future`` [s, keys] as in :meth:`LightningIndexer.forward`."""
    from torch.utils.checkpoint import checkpoint

    q, k, w = indexer.project(x, qr, cos=cos, sin=sin, gather=gather)
    s, b, heads, _ = q.shape
    n_keys = k.shape[0]
    if block is None:
        width = max(heads, query.shape[2] if query is not None else 0)
        block = max(1, BLOCK_ELEMENTS // (b * width * n_keys))

    def learn_block(qb: Tensor, wb: Tensor, kk: Tensor, fut: Tensor, queries: Tensor, keys: Tensor
                    ) -> tuple[Tensor, Tensor, Tensor]:
        scores = index_scores(qb, kk, wb, fut)
        idx, valid = select_topk(scores, topk)
        allowed = selection_mask(idx, valid, n_keys) if sparse else ~fut.expand(b, -1, -1)
        loss = indexer_kl_loss(scores, queries, keys, scale=scale, allowed=allowed, tp_group=tp_group)
        return loss, idx, valid

    idxs, valids, loss = [], [], None
    for start in range(0, s, block):
        end = min(start + block, s)
        fut = future[start:end] if future is not None else _future(start, end, n_keys, x.device)
        if query is None:
            with torch.no_grad():
                idx, valid = select_topk(index_scores(q[start:end], k, w[start:end], fut), topk)
        else:
            part, idx, valid = checkpoint(learn_block, q[start:end], w[start:end], k, fut, query[start:end], key,
                                          use_reentrant=False)
            loss = part if loss is None else loss + part
        idxs.append(idx)
        valids.append(valid)
    return torch.cat(idxs, dim=1), torch.cat(valids, dim=1), loss


def restricted_attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, *, scale: float) -> Tensor:
    """Exact attention over each query's allowed keys (``mask`` [b, s, keys], True = attend; None: causal, SDPA's
    flash path on GPU): SDPA, ``[s, b, h*dv]``."""
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    if mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), scale=scale)
    b, h, s, dv = out.shape
    return out.permute(2, 0, 1, 3).reshape(s, b, h * dv)


def kernel_attention(op: Any, query: Tensor, key: Tensor, value: Tensor, idx: Tensor, valid: Tensor, *,
                     scale: float) -> Tensor:
    """The same attention through the sparse MLA kernel ``op`` (module docstring: ``q' = [0 | q]``, ``kv' = [v |
    k]``, one group per head); tokens are the flattened ``[s, b]`` rows."""
    s, b, h, dk = query.shape
    dv, n_keys = value.shape[-1], key.shape[0]
    q = torch.cat([query.new_zeros(s, b, h, dv), query], dim=-1).reshape(s * b, h, dv + dk)
    kv = torch.cat([value, key], dim=-1).reshape(n_keys * b, h, dv + dk)
    # key j of batch row r is token j * b + r; a masked slot is -1
    rows = torch.arange(b, device=idx.device).view(b, 1, 1)
    flat = torch.where(valid, idx * b + rows, -1).permute(1, 0, 2).reshape(s * b, 1, -1)
    out = op(q, kv, flat.expand(-1, h, -1).to(torch.int32), scale, dv)
    return out.reshape(s, b, h * dv)


class SparseMLAttention(torch.nn.Module):
    """megatron core attention for MLA with DSA (megatron's MLASelfAttention hands it ``x`` and ``qr`` when
    ``requires_dsa_inputs``): ``forward(q, k, v, mask, ..., x, qr) -> [s, b, h*dv]``."""

    requires_dsa_inputs = True

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None, cp_comm_type: str | None = None,
                 pg_collection=None, *, index_heads: int, index_head_dim: int, rope_interleaved: bool = False,
                 shared_layers: frozenset[int] = frozenset()) -> None:
        super().__init__()
        from megatron.core.process_groups_config import ProcessGroupCollection

        self.config = config
        # NOTE: megatron's Attention base builds a core attention before MLA rebuilds it with its scale
        head = k_channels or (config.qk_head_dim + config.qk_pos_emb_head_dim)
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head)
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.tp_group = pg_collection.tp
        self.cp_group = getattr(pg_collection, "cp", None)
        if self.cp_group is not None and self.cp_group.size() == 1:
            self.cp_group = None
        # NOTE: a layer in ``shared_layers`` (0-based) has no indexer: it attends to the keys the last layer with
        # one chose (GLM-5's cross-layer top-k sharing)
        self.indexer = None if layer_number - 1 in shared_layers else LightningIndexer(
            hidden_size=config.hidden_size, q_lora_rank=config.q_lora_rank, heads=index_heads,
            head_dim=index_head_dim, rope_dim=config.qk_pos_emb_head_dim, dtype=config.params_dtype,
            interleaved=rope_interleaved)
        self.phase: DSAPhase | None = None  # set for the whole model by the family (one object, every layer)
        self._rope_cache: tuple[int, Tensor, Tensor] | None = None

    def _cos_sin(self, s: int, device) -> tuple[Tensor, Tensor]:
        """cos / sin [tokens, rope_dim] of the MLA's rotary embedding (YaRN's mscale folded in), half-split layout,
        for this rank's tokens of a sequence of ``s``."""
        if self._rope_cache is None or self._rope_cache[0] != s or self._rope_cache[1].device != device:
            from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
            from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

            c, dim = self.config, self.config.qk_pos_emb_head_dim
            if c.rope_type == "yarn":
                rope = YarnRotaryEmbedding(dim, rotary_base=c.rotary_base, scaling_factor=c.rotary_scaling_factor,
                                           original_max_position_embeddings=c.original_max_position_embeddings,
                                           beta_fast=c.beta_fast, beta_slow=c.beta_slow, mscale=c.mscale,
                                           mscale_all_dim=c.mscale_all_dim)
                freqs, mscale = rope(s)
            else:
                rope = RotaryEmbedding(dim, rotary_percent=1.0, rotary_base=c.rotary_base)
                freqs, mscale = rope(s), 1.0
            # NOTE: under context parallelism megatron's rotary embedding returns this CP rank's tokens only
            freqs = freqs.view(-1, dim).to(device)
            self._rope_cache = (s, (freqs.cos() * mscale).float(), (freqs.sin() * mscale).float())
        return self._rope_cache[1], self._rope_cache[2]

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type=None, attention_bias: Tensor | None = None, packed_seq_params=None,
                x: Tensor | None = None, qr: Tensor | None = None) -> Tensor:
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
        from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossAutoScaler

        phase = self.phase
        if phase is None or x is None or qr is None:
            raise ValueError("SparseMLAttention runs inside MLASelfAttention of a model whose family set its phase")
        if packed_seq_params is not None or attention_mask is not None:
            raise ValueError("DSA attention takes causal, unpacked sequences (no packed_seq_params or attention_mask)")
        s = query.shape[0]
        x, qr = x.detach(), qr.detach()
        if self.config.sequence_parallel and self.tp_group.size() > 1:
            x = gather_from_sequence_parallel_region(x, group=self.tp_group)
            qr = gather_from_sequence_parallel_region(qr, group=self.tp_group)
        learn = self.training and torch.is_grad_enabled() and phase.loss_weight > 0 and self.indexer is not None
        cp, future, gather = self.cp_group, None, None
        if cp is not None:
            # NOTE: context parallelism: each rank's queries (two mirrored chunks of the sequence) score and attend
            # to the whole sequence's keys, gathered over CP in sequence order (their gradients go back to the rank
            # that made them); the masks use global positions
            from loongforge_megatron.layers.attention import all_gather_seq, cp_positions

            def gather(t: Tensor) -> Tensor:
                return all_gather_seq(t, cp)

            positions = cp_positions(s, cp.size(), cp.rank(), x.device)
            future = torch.arange(s * cp.size(), device=x.device)[None, :] > positions[:, None]
            key, value = gather(key), gather(value)
        n_keys = s if cp is None else key.shape[0]
        loss = None
        if self.indexer is None:
            if phase.selection is None:
                raise ValueError("a DSA layer that shares the top-k of an earlier layer runs before any layer with an "
                                 "indexer (the first layer of a pipeline stage must have one)")
            idx, valid = phase.selection
        else:
            cos, sin = self._cos_sin(s if cp is None else s * cp.size(), x.device)
            with torch.enable_grad() if learn else torch.no_grad():
                idx, valid, loss = index_and_learn(
                    self.indexer, x, qr, cos=cos, sin=sin, topk=phase.topk, gather=gather, future=future,
                    query=query.detach() if learn else None, key=key.detach() if learn else None,
                    scale=self.softmax_scale, sparse=phase.sparse, tp_group=self.tp_group)
            phase.selection = (idx, valid)
        if not phase.sparse:
            causal = None if cp is None else (~future).expand(idx.shape[0], s, n_keys)
            out = restricted_attention(query, key, value, causal, scale=self.softmax_scale)
        elif query.device.type == "cuda" and (op := self._kernel()) is not None:
            out = kernel_attention(op, query, key, value, idx, valid, scale=self.softmax_scale)
            phase.kernel_calls += 1
        else:
            out = restricted_attention(query, key, value, selection_mask(idx, valid, n_keys), scale=self.softmax_scale)
        if loss is not None:
            loss = loss * phase.loss_weight
            phase.losses.append((loss.detach(), idx.shape[0] * s))
            out = DSAIndexerLossAutoScaler.apply(out, loss)
        return out

    def _kernel(self):
        """The registry's ``sparse_mla_attention`` for CUDA (None without a kernel provider and ``auto``)."""
        from loongforge.errors import PluginError
        from loongforge.kernels import select_op

        try:
            return select_op("sparse_mla_attention", provider=self.phase.provider, device_type="cuda",
                             accelerator=self.phase.accelerator)
        except PluginError:
            if self.phase.provider != "auto":
                raise
            return None


def sparse_layer_spec(layer_spec: Any, *, index_heads: int, index_head_dim: int, rope_interleaved: bool = False,
                      shared_layers: frozenset[int] = frozenset()) -> Any:
    """``layer_spec`` (an MLA layer's ModuleSpec) with :class:`SparseMLAttention` as its core attention."""
    import dataclasses

    from megatron.core.transformer.spec_utils import ModuleSpec

    attn = layer_spec.submodules.self_attention
    core = ModuleSpec(module=SparseMLAttention, params={"index_heads": index_heads, "index_head_dim": index_head_dim,
                                                        "rope_interleaved": rope_interleaved,
                                                        "shared_layers": shared_layers})
    attn = dataclasses.replace(attn, submodules=dataclasses.replace(attn.submodules, core_attention=core))
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(layer_spec.submodules, self_attention=attn))


def phase_of(chunks: list[torch.nn.Module], phase: DSAPhase) -> int:
    """Give every DSA layer of ``chunks`` the model's one ``phase``; returns how many there are."""
    layers = [m for c in chunks for m in c.modules() if isinstance(m, SparseMLAttention)]
    for m in layers:
        m.phase = phase
    phase.layers = len(layers)
    return len(layers)
