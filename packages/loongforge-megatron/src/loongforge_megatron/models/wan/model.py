"""Wan's transformer on megatron-core: diffusers' ``WanTransformer3DModel`` as tensor-parallel modules.

Every block's projections are megatron's column / row parallel linears and its feed-forward is megatron's ``MLP``
(GELU-tanh), so a block splits its heads over TP ranks::

    x  [b, tokens, h]   (every TP rank holds the whole residual stream)
    x += gate1 * self_attention(norm1(x) * (1 + scale1) + shift1)        q k v column-parallel (heads split),
    x += cross_attention(norm2(x), text [, image tokens])                 out row-parallel (all-reduce)
    x += gate2 * mlp(norm3(x) * (1 + scale2) + shift2)                   fc1 column, fc2 row

``shift / scale / gate`` are the block's learned table plus the timestep embedding's projection. The query / key
RMSNorm of Wan spans all heads (not one head): each rank sums its heads' squares and the sums are all-reduced over
the TP group (:class:`HeadsRMSNorm`). Self-attention rotates queries and keys by a 3-D RoPE (frames, rows, columns
each own a slice of the head's channels, pairs interleaved as diffusers does). The embedders (3-D patch
convolution, timestep, text, image-encoder tokens) and the output head are small and held whole on every rank.

Context parallelism splits the video tokens over the CP group (Ulysses or ring: see :class:`WanModel`). Packed
micro-batches of videos of different sizes attend sample by sample (``layers/packing.py``). Sequence parallelism
(``config.sequence_parallel``) splits the residual stream's tokens over the TP ranks as megatron does: the
column-parallel projections of the video tokens all-gather them, the row-parallel ones reduce-scatter; the text /
image-token projections of the cross-attention see whole inputs (no sequence split). Pipeline parallelism is not
supported.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule

from loongforge_megatron.engine.model import unwrap
from loongforge_megatron.engine.step import _to_device
from loongforge_megatron.layers.megatron_layers import row_parallel_linear
from loongforge_megatron.layers.packing import Packing, attend_segments
from loongforge_megatron.layers.sequence_parallel import (
    gather_tokens,
    mark_sequence_parallel,
    seq_first,
    whole_input,
)
from loongforge_megatron.layers.ulysses import heads_to_tokens, tokens_to_heads
from loongforge_megatron.models import flow_matching as fm


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """Wan's MLP and text-projection activation (diffusers' ``gelu-approximate``)."""
    return F.gelu(x, approximate="tanh")


def timestep_features(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal timestep features ``[..., dim]``, [cos | sin], as diffusers' ``Timesteps(flip_sin_to_cos=True,
    downscale_freq_shift=0)`` computes them for Wan."""
    half = dim // 2
    exponent = -math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half
    args = t[..., None].float() * torch.exp(exponent)
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def rope_tables(arch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin ``[rope_max_seq_len, head_dim]`` of the frame, row and column axes side by side, each frequency
    repeated for its pair of channels (diffusers' ``get_1d_rotary_pos_embed(use_real, repeat_interleave_real)``,
    computed in float64 and stored in float32)."""
    cos, sin = [], []
    pos = torch.arange(arch.rope_max_seq_len, dtype=torch.float64)
    for dim in arch.rope_dims:
        freqs = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64)[: dim // 2] / dim))
        angles = torch.outer(pos, freqs)
        cos.append(angles.cos().repeat_interleave(2, dim=1).float())
        sin.append(angles.sin().repeat_interleave(2, dim=1).float())
    return torch.cat(cos, dim=1), torch.cat(sin, dim=1)


def rope_for(cos: torch.Tensor, sin: torch.Tensor, *, dims: tuple[int, int, int],
             grid: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin ``[tokens, 1, head_dim]`` of a ``frames x rows x columns`` patch grid (tokens frame-major)."""
    f, h, w = grid
    out = []
    for table in (cos, sin):
        tf, th, tw = table.split(list(dims), dim=1)
        parts = (tf[:f].view(f, 1, 1, -1).expand(f, h, w, -1), th[:h].view(1, h, 1, -1).expand(f, h, w, -1),
                 tw[:w].view(1, 1, w, -1).expand(f, h, w, -1))
        out.append(torch.cat(parts, dim=-1).reshape(f * h * w, 1, -1))
    return out[0], out[1]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved channel pairs of ``x`` ``[b, tokens, heads, d]`` (diffusers' Wan attention)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2).type_as(x)


class _AllReduceSum(torch.autograd.Function):
    """Sum over the TP group both ways: every rank's value feeds every rank's output (the norm of all heads)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        x = x.clone()
        torch.distributed.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class FP32LayerNorm(torch.nn.LayerNorm):
    """LayerNorm computed in fp32 whatever the weights' dtype (diffusers' ``FP32LayerNorm``): Wan normalises in fp32,
    and with bf16 parameters a plain LayerNorm refuses the fp32 input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.float() if self.weight is not None else None
        bias = self.bias.float() if self.bias is not None else None
        return F.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps).type_as(x)


class HeadsRMSNorm(torch.nn.Module):
    """RMSNorm over all heads' channels (``hidden_size``) of a head-split projection: this rank holds
    ``hidden_size / tp`` of them, and the sum of squares is all-reduced over the TP group."""

    def __init__(self, hidden: int, *, eps: float, tp_group: Any, dtype: torch.dtype):
        super().__init__()
        self.tp_group, self.hidden, self.eps = tp_group, hidden, eps
        tp = tp_group.size() if tp_group is not None else 1
        self.weight = torch.nn.Parameter(torch.ones(hidden // tp, dtype=dtype))
        tensor_parallel.set_tensor_model_parallel_attributes(self.weight, True, 0, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        squares = x.float().pow(2).sum(-1, keepdim=True)
        if self.tp_group is not None and self.tp_group.size() > 1:
            squares = _AllReduceSum.apply(squares, self.tp_group)
        return (x.float() * torch.rsqrt(squares / self.hidden + self.eps)).type_as(x) * self.weight


def _column(config: Any, size_in: int, size_out: int, tp_group: Any) -> ColumnParallelLinear:
    return ColumnParallelLinear(size_in, size_out, config=config, init_method=config.init_method, bias=True,
                                gather_output=False, skip_bias_add=False, tp_group=tp_group)


def _row(config: Any, size_in: int, size_out: int, tp_group: Any) -> Any:
    return row_parallel_linear()(size_in, size_out, config=config, init_method=config.output_layer_init_method,
                                 bias=True, input_is_parallel=True, skip_bias_add=False, tp_group=tp_group)


def patchify(video: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """``[b, c, F, H, W]`` -> ``[b, tokens, pt * ph * pw * c]`` in the output head's layout (tokens frame-major)."""
    b, c, f, h, w = video.shape
    pt, ph, pw = patch
    x = video.reshape(b, c, f // pt, pt, h // ph, ph, w // pw, pw).permute(0, 2, 4, 6, 3, 5, 7, 1)
    return x.reshape(b, (f // pt) * (h // ph) * (w // pw), -1)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Full (non-causal) attention of ``[b, s, heads, d]`` tensors -> ``[b, s, heads * d]``."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2).flatten(2)


class WanAttention(MegatronModule):
    """Self- or cross-attention of a Wan block, heads split over TP: ``to_q / to_k / to_v`` column-parallel,
    ``to_out`` row-parallel, query / key :class:`HeadsRMSNorm`. With ``image_dim`` (cross-attention of Wan2.1
    I2V) the queries also attend the image-encoder tokens through ``add_k_proj / add_v_proj`` (keys normed by
    ``norm_added_k``) and the two results are summed before ``to_out``."""

    def __init__(self, config: Any, *, tp_group: Any, image_dim: int | None = None, cp_group: Any = None,
                 cp_comm_type: str = "a2a", cross: bool = False):
        super().__init__(config=config)
        h, tp = config.hidden_size, tp_group.size()
        self.cp_group = cp_group if cp_group is not None and cp_group.size() > 1 else None
        self.cp_comm_type, self.sp = cp_comm_type, bool(config.sequence_parallel)
        self.heads = config.num_attention_heads // tp
        kv_config = whole_input(config) if cross else config
        self.to_q = _column(config, h, h, tp_group)
        self.to_k, self.to_v = _column(kv_config, h, h, tp_group), _column(kv_config, h, h, tp_group)
        self.to_out = _row(config, h, h, tp_group)
        norm = dict(eps=config.layernorm_epsilon, tp_group=tp_group, dtype=config.params_dtype)
        self.norm_q, self.norm_k = HeadsRMSNorm(h, **norm), HeadsRMSNorm(h, **norm)
        self.add_k_proj = self.add_v_proj = self.norm_added_k = None
        if image_dim is not None:
            self.add_k_proj = _column(kv_config, image_dim, h, tp_group)
            self.add_v_proj = _column(kv_config, image_dim, h, tp_group)
            self.norm_added_k = HeadsRMSNorm(h, **norm)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.heads, -1))

    def _self_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     packing: Packing | None) -> torch.Tensor:
        """Self-attention of this rank's video tokens (of every packed sample, each over its own)."""
        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if packing is None:
                return _attend(q, k, v)
            return attend_segments(q, k, v, bounds_q=packing.bounds, bounds_k=packing.bounds)

        if self.cp_group is None:
            return attend(q, k, v)
        if self.cp_comm_type == "p2p":
            # NOTE: ring context parallelism: the keys / values pass around the CP group, heads stay whole
            from loongforge_megatron.layers.ring_attention import ring_attention

            segments = None if packing is None else packing.segments(q.device)
            return ring_attention(q, k, v, group=self.cp_group, segments=segments).flatten(2)
        # NOTE: Ulysses context parallelism: trade the token split for a head split, attend, trade back
        q, k, v = (tokens_to_heads(t, self.cp_group) for t in (q, k, v))
        return heads_to_tokens(attend(q, k, v).unflatten(-1, (q.shape[2], -1)), self.cp_group).flatten(2)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, *, rope: Any = None,
                image: torch.Tensor | None = None, packing: Packing | None = None) -> torch.Tensor:
        kv = x if context is None else context
        kv_sp = self.sp and context is None
        q = self._heads(self.norm_q(seq_first(self.to_q, x, sp=self.sp)[0]))
        k = self._heads(self.norm_k(seq_first(self.to_k, kv, sp=kv_sp)[0]))
        v = self._heads(seq_first(self.to_v, kv, sp=kv_sp)[0])
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)

        def cross(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # NOTE: a packed sample's tokens attend its own text / image tokens only
            return _attend(q, k, v) if packing is None else attend_segments(q, k, v, bounds_q=packing.local_bounds)

        out = self._self_attend(q, k, v, packing) if context is None else cross(k, v)
        if image is not None and self.add_k_proj is not None:
            ki = self._heads(self.norm_added_k(self.add_k_proj(image)[0]))
            vi = self._heads(self.add_v_proj(image)[0])
            out = out + cross(ki, vi)
        return seq_first(self.to_out, out, sp=self.sp)[0]


class WanLayer(MegatronModule):
    """One Wan block (see the module docstring); ``modulation`` ``[b, 6, h]`` or ``[b, tokens, 6, h]`` (a
    timestep per token) is the timestep embedding's projection."""

    def __init__(self, config: Any, *, arch: Any, tp_group: Any, cp_group: Any = None, cp_comm_type: str = "a2a"):
        super().__init__(config=config)
        h, eps, dtype = arch.hidden_size, arch.norm_eps, config.params_dtype
        self.norm1 = torch.nn.LayerNorm(h, eps=eps, elementwise_affine=False, dtype=dtype)
        self.attn1 = WanAttention(config, tp_group=tp_group, cp_group=cp_group, cp_comm_type=cp_comm_type)
        self.norm2 = (FP32LayerNorm(h, eps=eps, elementwise_affine=True, dtype=dtype) if arch.cross_attn_norm
                      else torch.nn.Identity())
        self.attn2 = WanAttention(config, tp_group=tp_group, image_dim=arch.added_kv_proj_dim, cross=True)
        self.norm3 = torch.nn.LayerNorm(h, eps=eps, elementwise_affine=False, dtype=dtype)
        self.mlp = MLP(config=config, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                               linear_fc2=row_parallel_linear()), tp_group=tp_group)
        self.scale_shift_table = torch.nn.Parameter(torch.randn(1, 6, h, dtype=dtype) / h**0.5)
        self.sp = bool(config.sequence_parallel)
        if self.sp:
            mark_sequence_parallel(self.norm2)
            self.scale_shift_table.sequence_parallel = True

    def forward(self, x: torch.Tensor, text: torch.Tensor, modulation: torch.Tensor, rope: Any,
                image: torch.Tensor | None, packing: Packing | None = None) -> torch.Tensor:
        table = self.scale_shift_table if modulation.dim() == 3 else self.scale_shift_table.unsqueeze(0)
        mod = (table + modulation.float()).unbind(-2)  # 6 x [b, 1 | tokens, h]
        shift1, scale1, gate1, shift2, scale2, gate2 = (m if modulation.dim() == 4 else m.unsqueeze(1) for m in mod)
        y = (self.norm1(x.float()) * (1 + scale1) + shift1).type_as(x)
        x = (x.float() + self.attn1(y, rope=rope, packing=packing) * gate1).type_as(x)
        x = x + self.attn2(self.norm2(x.float()).type_as(x), text, image=image, packing=packing)
        y = (self.norm3(x.float()) * (1 + scale2) + shift2).type_as(x)
        out, bias = seq_first(self.mlp, y, sp=self.sp)
        out = out if bias is None else out + bias
        return (x.float() + out.float() * gate2).type_as(x)


class _Mlp2(torch.nn.Module):
    """``linear_2(act(linear_1(x)))`` (diffusers' ``TimestepEmbedding`` / ``PixArtAlphaTextProjection``)."""

    def __init__(self, size_in: int, hidden: int, act: Any, dtype: torch.dtype):
        super().__init__()
        self.linear_1 = torch.nn.Linear(size_in, hidden, dtype=dtype)
        self.linear_2 = torch.nn.Linear(hidden, hidden, dtype=dtype)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class ImageEmbedder(torch.nn.Module):
    """Image-encoder tokens -> the model's width: LayerNorm, Linear, GELU, Linear, LayerNorm (diffusers'
    ``WanImageEmbedding``), with an optional learned position embedding of the tokens."""

    def __init__(self, image_dim: int, hidden: int, *, pos_len: int | None, dtype: torch.dtype):
        super().__init__()
        self.norm1 = FP32LayerNorm(image_dim, dtype=dtype)
        self.proj = torch.nn.Linear(image_dim, image_dim, dtype=dtype)
        self.out = torch.nn.Linear(image_dim, hidden, dtype=dtype)
        self.norm2 = FP32LayerNorm(hidden, dtype=dtype)
        self.pos_embed = torch.nn.Parameter(torch.zeros(1, pos_len, image_dim, dtype=dtype)) if pos_len else None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.pos_embed is not None:
            b, n, d = tokens.shape
            tokens = tokens.view(-1, 2 * n, d) + self.pos_embed
        x = self.norm1(tokens.float()).type_as(tokens)
        x = self.out(F.gelu(self.proj(x)))
        return self.norm2(x.float()).type_as(x)


class WanModel(MegatronModule):
    """``forward(x [b, in_channels, F, H, W], timesteps [b] or [b, tokens], text [b, L, text_dim],
    image [b, Li, image_dim] | None) -> velocity [b, out_channels, F, H, W]`` (or, ``tokens_out``, this context-
    parallel rank's tokens ``[b, tokens / cp, pt * ph * pw * out_channels]``: what the loss reads; sequence
    parallelism's split gathered).

    Context parallelism (``cp_group`` of size cp): after the patch embedding each rank keeps its contiguous
    ``1 / cp`` of the video tokens (with their RoPE and per-token modulation); self-attention exchanges tokens for
    heads (``cp_comm_type`` a2a: Ulysses all-to-all) or passes the keys / values around the group (p2p: ring
    attention), cross-attention needs no exchange (every rank holds the text).

    :meth:`forward_packed` (``forward(..., grids=)``) takes a packed micro-batch of videos of different sizes."""

    def __init__(self, config: Any, arch: Any, *, tp_group: Any, cp_group: Any = None, recompute: bool = False,
                 cp_comm_type: str = "a2a"):
        super().__init__(config=config)
        self.arch, self.recompute = arch, recompute
        self.cp_group = cp_group if cp_group is not None and cp_group.size() > 1 else None
        self.tp_group, self.sp = tp_group, bool(config.sequence_parallel)
        h, dtype = arch.hidden_size, config.params_dtype
        self.patch_embedding = torch.nn.Conv3d(arch.in_channels, h, kernel_size=arch.patch_size,
                                               stride=arch.patch_size, dtype=dtype)
        self.time_embedder = _Mlp2(arch.freq_dim, h, F.silu, dtype)
        self.time_proj = torch.nn.Linear(h, 6 * h, dtype=dtype)
        self.text_embedder = _Mlp2(arch.text_dim, h, gelu_tanh, dtype)
        self.image_embedder = (ImageEmbedder(arch.image_dim, h, pos_len=arch.pos_embed_seq_len, dtype=dtype)
                               if arch.image_dim is not None else None)
        cos, sin = rope_tables(arch)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.layers = torch.nn.ModuleList(WanLayer(config, arch=arch, tp_group=tp_group, cp_group=cp_group,
                                                   cp_comm_type=cp_comm_type) for _ in range(arch.num_layers))
        self.norm_out = torch.nn.LayerNorm(h, eps=arch.norm_eps, elementwise_affine=False, dtype=dtype)
        self.proj_out = torch.nn.Linear(h, arch.out_channels * math.prod(arch.patch_size), dtype=dtype)
        self.scale_shift_table = torch.nn.Parameter(torch.randn(1, 2, h, dtype=dtype) / h**0.5)
        self._init_weights()
        if self.sp:
            # NOTE: these see only this rank's tokens (the text / image embedders feed whole-input projections,
            # whose backward already sums over TP)
            for m in (self.patch_embedding, self.time_embedder, self.time_proj, self.proj_out):
                mark_sequence_parallel(m)
            self.scale_shift_table.sequence_parallel = True

    @torch.no_grad()
    def _init_weights(self) -> None:
        """Whole-held modules: xavier-uniform weights (the patch kernel flattened), zero biases; the output head
        zero, so a fresh model predicts zero velocity. The blocks' linears come from the config's init."""
        for m in self.modules():
            if isinstance(m, (torch.nn.Linear, torch.nn.Conv3d)):
                torch.nn.init.xavier_uniform_(m.weight.view(m.weight.shape[0], -1))
                torch.nn.init.zeros_(m.bias)
        torch.nn.init.zeros_(self.proj_out.weight)

    def set_input_tensor(self, input_tensor: Any) -> None:
        """megatron's schedules call this on every model (only stages after the first use it: none here)."""

    def _layer(self, layer: WanLayer, hidden: torch.Tensor, context: torch.Tensor, modulation: torch.Tensor,
               rope: tuple[torch.Tensor, torch.Tensor], tokens: torch.Tensor | None,
               packing: Packing | None = None) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled():
            # NOTE: megatron's checkpoint saves its tensor arguments one by one: the RoPE pair goes in as two
            def run(h, c, m, cos, sin, i):
                return layer(h, c, m, (cos, sin), i, packing)

            return tensor_parallel.checkpoint(run, False, hidden, context, modulation, *rope, tokens)
        return layer(hidden, context, modulation, rope, tokens, packing)

    def cp_local(self, tokens: torch.Tensor) -> torch.Tensor:
        """This context-parallel rank's share of ``[b, tokens, ...]`` (all of it without context parallelism)."""
        if self.cp_group is None:
            return tokens
        n = tokens.shape[1] // self.cp_group.size()
        return tokens[:, self.cp_group.rank() * n: (self.cp_group.rank() + 1) * n]

    def sp_local(self, tokens: torch.Tensor) -> torch.Tensor:
        """This TP rank's share of ``[b, tokens, ...]`` under sequence parallelism (all of it without)."""
        if not self.sp:
            return tokens
        n = tokens.shape[1] // self.tp_group.size()
        return tokens[:, self.tp_group.rank() * n: (self.tp_group.rank() + 1) * n]

    def local(self, tokens: torch.Tensor) -> torch.Tensor:
        """The tokens of ``[b, tokens, ...]`` this rank's residual stream holds (context, then sequence split)."""
        return self.sp_local(self.cp_local(tokens))

    def sp_gather(self, tokens: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`sp_local` (every TP rank then computes the same loss)."""
        return gather_tokens(tokens, self.tp_group, sp=self.sp)

    def forward(self, x: torch.Tensor, timesteps: torch.Tensor, text: torch.Tensor,
                image: torch.Tensor | None = None, *, tokens_out: bool = False, grids: Any = None,
                per_token: bool = False) -> torch.Tensor:
        if grids is not None:  # a packed micro-batch (what a DDP-wrapped model passes on)
            return self.forward_packed(x, grids, timesteps, text, image, per_token=per_token)
        b, _, frames, height, width = x.shape
        pt, ph, pw = self.arch.patch_size
        grid = (frames // pt, height // ph, width // pw)
        rope = rope_for(self.rope_cos, self.rope_sin, dims=self.arch.rope_dims, grid=grid)
        hidden = self.local(self.patch_embedding(x).flatten(2).transpose(1, 2)).contiguous()  # [b, tokens, h]
        if self.cp_group is not None:  # NOTE: attention sees the CP rank's tokens (sequence parallelism gathers)
            rope = tuple(t.transpose(0, 1) for t in (self.cp_local(r.transpose(0, 1)) for r in rope))
        timesteps = self.local(timesteps) if timesteps.dim() == 2 else timesteps
        dtype = self.time_proj.weight.dtype
        temb = self.time_embedder(timestep_features(timesteps, self.arch.freq_dim).to(dtype))
        modulation = self.time_proj(F.silu(temb)).unflatten(-1, (6, -1))  # [b, (tokens,) 6, h]
        context = self.text_embedder(text.to(dtype))
        tokens = None
        if self.image_embedder is not None:
            if image is None:
                raise ValueError("this Wan model attends image-encoder tokens: give image [b, tokens, image_dim]")
            tokens = self.image_embedder(image.to(dtype))
        for layer in self.layers:
            hidden = self._layer(layer, hidden, context, modulation, rope, tokens)
        shift, scale = (self.scale_shift_table.unsqueeze(0) if temb.dim() == 3 else self.scale_shift_table).add(
            temb.unsqueeze(-2)).unbind(-2)
        if temb.dim() == 2:
            shift, scale = shift.unsqueeze(1), scale.unsqueeze(1)
        hidden = (self.norm_out(hidden.float()) * (1 + scale) + shift).type_as(hidden)
        out = self.proj_out(hidden)
        out = self.sp_gather(out)
        if tokens_out:
            return out
        if self.cp_group is not None:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            out = gather_from_sequence_parallel_region(out.transpose(0, 1).contiguous(), group=self.cp_group,
                                                       tensor_parallel_output_grad=False).transpose(0, 1)
        out = out.reshape(b, *grid, pt, ph, pw, -1)
        return out.permute(0, 7, 1, 4, 2, 5, 3, 6).reshape(b, -1, frames, height, width)

    def packing(self, grids: Any) -> Packing:
        """The :class:`Packing` of samples with patch ``grids`` ``[n, 3]`` on this CP rank."""
        rows = [tuple(int(v) for v in g) for g in (grids.tolist() if isinstance(grids, torch.Tensor) else grids)]
        if self.cp_group is None:
            return Packing.of(rows)
        return Packing.of(rows, cp_rank=self.cp_group.rank(), cp_size=self.cp_group.size())

    def forward_packed(self, patches: torch.Tensor, grids: Any, timesteps: torch.Tensor, text: torch.Tensor,
                       image: torch.Tensor | None = None, *, per_token: bool = False) -> torch.Tensor:
        """Packed videos of different sizes: ``patches [T, pt * ph * pw * in_channels]`` (every sample's
        :func:`patchify` tokens, joined), their patch ``grids`` ``[n, 3]``, ``timesteps [n]`` (``per_token``: one
        per token, ``[T]``), ``text [n, L, text_dim]``, ``image [n, Li, image_dim]`` -> this CP rank's ``[1, T / cp,
        pt * ph * pw * out_channels]``.

        Every sample is the same function as :meth:`forward` of it alone: its own RoPE grid, timestep, text."""
        packing = self.packing(grids)
        grid_rows = [tuple(int(v) for v in g) for g in (grids.tolist() if isinstance(grids, torch.Tensor) else grids)]
        conv = self.patch_embedding
        # NOTE: a patch convolution is a linear map of each patch's values, in patchify's (pt, ph, pw, c) order
        weight = conv.weight.permute(0, 2, 3, 4, 1).flatten(1)
        hidden = self.sp_local(F.linear(packing.local(patches).to(weight.dtype), weight, conv.bias)[None])
        ropes = [rope_for(self.rope_cos, self.rope_sin, dims=self.arch.rope_dims, grid=g) for g in grid_rows]
        rope = tuple(packing.local(torch.cat(parts)) for parts in zip(*ropes, strict=True))
        dtype = self.time_proj.weight.dtype
        temb = self.time_embedder(timestep_features(timesteps, self.arch.freq_dim).to(dtype))  # [n or T, h]
        rows = packing.local if per_token else packing.per_token  # NOTE: -> this rank's tokens' rows
        modulation = self.sp_local(rows(self.time_proj(F.silu(temb)).unflatten(-1, (6, -1)))[None])
        context = packing.present(self.text_embedder(text.to(dtype)))
        tokens = None
        if self.image_embedder is not None:
            if image is None:
                raise ValueError("this Wan model attends image-encoder tokens: give image [n, tokens, image_dim]")
            tokens = packing.present(self.image_embedder(image.to(dtype)))
        for layer in self.layers:
            hidden = self._layer(layer, hidden, context, modulation, rope, tokens, packing)
        temb = self.sp_local(rows(temb)[None])[0]
        shift, scale = (self.scale_shift_table + temb[:, None]).unbind(-2)  # [tokens of this rank, h] each
        hidden = (self.norm_out(hidden.float()) * (1 + scale) + shift).type_as(hidden)
        return self.sp_gather(self.proj_out(hidden))


def transformer_config(arch: Any, *, plan: Any, precision: str, grad_accum_fusion: bool = False) -> TransformerConfig:
    """megatron-core ``TransformerConfig`` of a Wan model under ``plan``.

    NOTE: initialised on the CPU (``use_cpu_initialization``): megatron draws each parallel weight whole and splits
    it, so every TP layout starts from the same weights.
    """
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    return TransformerConfig(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads, num_query_groups=arch.num_attention_heads,
        kv_channels=arch.head_dim, normalization="LayerNorm", layernorm_epsilon=arch.norm_eps,
        gated_linear_unit=False, activation_func=gelu_tanh, add_bias_linear=True, add_qkv_bias=True,
        hidden_dropout=0.0, attention_dropout=0.0,
        init_method=torch.nn.init.xavier_uniform_, output_layer_init_method=torch.nn.init.xavier_uniform_,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=grad_accum_fusion, persist_layer_norm=False, tensor_model_parallel_size=plan.tp,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=precision == "bf16", fp16=precision == "fp16",
        use_cpu_initialization=True, calculate_per_token_loss=True, variable_seq_lengths=False,
        sequence_parallel=plan.sp,
    )


def build_wan(*, config: Any, arch: Any, device: torch.device, recompute: bool = False,
              compile_mode: str | None = None, cp_comm_type: str = "a2a") -> list[torch.nn.Module]:
    """``[WanModel]`` for this rank, before DDP (one chunk). ``compile_mode`` compiles each block;
    ``cp_comm_type`` picks the context-parallel self-attention (a2a: Ulysses, p2p: ring)."""
    from megatron.core import parallel_state as mpu

    model = WanModel(config, arch, tp_group=mpu.get_tensor_model_parallel_group(),
                     cp_group=mpu.get_context_parallel_group(), recompute=recompute, cp_comm_type=cp_comm_type)
    model.model_type = ModelType.encoder_or_decoder  # NOTE: megatron's schedules read it
    model.to(device=device)
    if compile_mode is not None:
        for layer in model.layers:
            layer.compile(mode=None if compile_mode == "default" else compile_mode)
    return [model]


def forward_step(data_iterator: Iterator[dict[str, Any]], model: torch.nn.Module, *, objective: fm.FlowMatching):
    """megatron's ``forward_step_func`` for Wan: flow matching (velocity target) on the batch's clean latent
    video ``x0``, noise and noise levels ``sigmas`` (drawn per sample by the dataset); an I2V batch's
    ``condition`` channels are concatenated to the noisy input, its ``image`` tokens go to the cross-attention; a
    sample with ``first_clean`` (TI2V image-to-video) keeps its first latent frame clean at timestep 0, out of the
    loss."""
    param = next(model.parameters())
    batch = _to_device(next(data_iterator), param.device)
    if "grid" in batch:
        return _packed_step(batch, model, objective=objective, dtype=param.dtype)
    x0, noise, sigmas = batch["x0"], batch["noise"], batch["sigmas"]
    noisy = fm.add_noise(x0, noise, sigmas)
    timesteps, keep = objective.timesteps(sigmas), None
    inner = unwrap(model)
    patch, local = inner.arch.patch_size, inner.cp_local
    if "first_clean" in batch:
        clean = batch["first_clean"].bool()
        noisy = torch.cat([torch.where(clean.view(-1, 1, 1, 1, 1), x0[:, :, :1], noisy[:, :, :1]), noisy[:, :, 1:]],
                          dim=2)
        per_frame = (x0.shape[3] // patch[1]) * (x0.shape[4] // patch[2])
        first = torch.arange(x0.shape[2] // patch[0] * per_frame, device=x0.device) < per_frame
        frozen = clean[:, None] & first[None]  # [b, tokens]
        timesteps, keep = timesteps[:, None].expand(frozen.shape).masked_fill(frozen, 0.0), ~frozen
    if "condition" in batch:
        noisy = torch.cat([noisy, batch["condition"]], dim=1)
    pred = model(noisy.to(param.dtype), timesteps, batch["text"], batch.get("image"), tokens_out=True)
    # NOTE: the loss over this context-parallel rank's tokens (the same elements as the video's, in token order);
    # megatron sums the ranks' sums and counts. Sequence parallelism gathered the TP ranks' tokens: every TP rank
    # computes the same loss, as without it
    err = fm.squared_error(pred, local(patchify(x0, patch)), local(patchify(noise, patch)))
    if keep is not None:
        err = err[local(keep[..., None]).expand_as(err)]
    return err, fm.loss_func


def _packed_step(batch: dict[str, Any], model: torch.nn.Module, *, objective: fm.FlowMatching, dtype: torch.dtype):
    """:func:`forward_step` of a packed micro-batch (``x0`` / ``noise`` / ``condition`` as joined patch tokens,
    one ``grid`` row per sample): each token is noised at its sample's level."""
    x0, noise, sigmas, grids = batch["x0"], batch["noise"], batch["sigmas"], batch["grid"]
    inner = unwrap(model)
    packing = inner.packing(grids)
    counts = torch.tensor(packing.counts, device=x0.device)
    noisy = fm.add_noise(x0, noise, sigmas.repeat_interleave(counts))
    timesteps, keep = objective.timesteps(sigmas), None
    if "first_clean" in batch:
        # NOTE: a clean sample's first latent frame: its first grid[1] x grid[2] tokens (patchify's frame-major order)
        rows = torch.as_tensor(grids, device=x0.device).view(-1, 3)
        starts = torch.cumsum(counts, 0) - counts
        position = torch.arange(x0.shape[0], device=x0.device) - starts.repeat_interleave(counts)
        frozen = batch["first_clean"].bool().repeat_interleave(counts) & (
            position < (rows[:, 1] * rows[:, 2]).repeat_interleave(counts))
        noisy = torch.where(frozen[:, None], x0, noisy)
        timesteps, keep = timesteps.repeat_interleave(counts).masked_fill(frozen, 0.0), ~frozen
    if "condition" in batch:
        # NOTE: channels join inside each patch: patchify's values are (pt, ph, pw, channels)
        patch = math.prod(inner.arch.patch_size)
        noisy = torch.cat([noisy.unflatten(-1, (patch, -1)), batch["condition"].unflatten(-1, (patch, -1))],
                          dim=-1).flatten(1)
    pred = model(noisy.to(dtype), timesteps, batch["text"], batch.get("image"), grids=grids,
                 per_token=keep is not None)
    err = fm.squared_error(pred[0], packing.local(x0), packing.local(noise))
    if keep is not None:
        err = err[packing.local(keep)]
    return err, fm.loss_func
