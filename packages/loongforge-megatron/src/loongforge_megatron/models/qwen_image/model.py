"""Qwen-Image's transformer on megatron-core: diffusers' ``QwenImageTransformer2DModel`` as tensor-parallel
modules.

Each block has an image and a text stream of the same width, each with its own modulation, norms, projections and
MLP; one attention runs over both (text tokens first)::

    img, txt  [b, tokens, h]   (every TP rank holds both whole)
    q k v = cat(text stream's add_{q,k,v}_proj(mod(norm(txt))), image stream's to_{q,k,v}(mod(norm(img))))
            column-parallel (heads split), per-head RMSNorm, RoPE (text and image positions)
    img += gate * to_out(attention[text:]);  txt += gate * to_add_out(attention[:text])    row-parallel
    img += gate * img_mlp(mod(norm(img)));   txt += gate * txt_mlp(mod(norm(txt)))        fc1 column, fc2 row

The modulations (``shift / scale / gate`` of both sub-layers, a linear of the timestep embedding) are column-
parallel linears gathered to every rank, so their large weights split over TP. The embedders (patch / text
linears, the text RMSNorm, the timestep MLP) and the output head are small and held whole.

RoPE: each image gets frame / row / column positions (rows and columns centred on 0, the frame is the image's
index: 0 for the noisy image, 1, 2, ... for an Edit model's reference images), the text tokens continue the
positions after the largest image half-size on all three axes; pairs of channels rotate as complex numbers, as
diffusers does.

Context parallelism (ring): each CP rank keeps its contiguous ``1 / cp`` of the image tokens and the whole text;
the joint attention attends the text keys locally and the image keys around the ring
(``layers/ring_attention.py``), merged by their log-sum-exps. Sequence parallelism (``config.sequence_parallel``)
splits the image stream's tokens over TP (``layers/sequence_parallel.py``); the text stream and the modulations
see whole inputs. Pipeline parallelism is not supported.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
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
from loongforge_megatron.layers.sequence_parallel import (
    gather_tokens,
    mark_sequence_parallel,
    seq_first,
    sum_grad_over_tp,
    whole_input,
)
from loongforge_megatron.models import flow_matching as fm
from loongforge_megatron.models.qwen_image.arch import ROPE_THETA, TIME_FEATURES

Grid = tuple[int, int, int]  # frames, rows, columns of one image's patches


@dataclass(frozen=True)
class Packed:
    """Which sample each token of a packed micro-batch belongs to: this rank's queries (texts, then its image
    tokens), every image token, every text token, and which text tokens are real (not padding)."""

    q_seg: torch.Tensor
    img_seg: torch.Tensor
    txt_seg: torch.Tensor
    txt_ok: torch.Tensor


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """The MLPs' activation (diffusers' ``gelu-approximate``)."""
    return F.gelu(x, approximate="tanh")


def timestep_features(t: torch.Tensor) -> torch.Tensor:
    """Sinusoidal features ``[b, 256]`` ([cos | sin]) of noise levels ``t`` in [0, 1], scaled by 1000 after the
    product, in diffusers' order of operations (``Timesteps(256, flip_sin_to_cos, 0, scale=1000)``)."""
    half = TIME_FEATURES // 2
    exponent = -math.log(10000) * torch.arange(0, half, dtype=torch.float32, device=t.device) / half
    args = 1000 * (t[:, None].float() * torch.exp(exponent).to(t.dtype)[None, :])
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def _axis_freqs(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """Complex rotations ``[n, dim / 2]`` of integer ``positions`` on one axis of ``dim`` channels."""
    inv = 1.0 / torch.pow(ROPE_THETA, torch.arange(0, dim, 2).to(torch.float32).div(dim))
    angles = torch.outer(positions, inv)
    return torch.polar(torch.ones_like(angles), angles)


def _centred(n: int) -> torch.Tensor:
    """Positions ``-(n - n // 2) .. n // 2 - 1`` of ``n`` rows or columns (diffusers' ``scale_rope``)."""
    return torch.arange(-(n - n // 2), n // 2)


def rope_freqs(*, axes: Sequence[int], grids: Sequence[Grid], text_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Complex RoPE rotations ``[image tokens, head_dim / 2]`` of the images ``grids`` (in token order; image ``i``
    has frame positions from ``i``) and ``[text_length, head_dim / 2]`` of the text."""
    parts = []
    for idx, (f, h, w) in enumerate(grids):
        frame = _axis_freqs(torch.arange(idx, idx + f), axes[0]).view(f, 1, 1, -1).expand(f, h, w, -1)
        rows = _axis_freqs(_centred(h), axes[1]).view(1, h, 1, -1).expand(f, h, w, -1)
        cols = _axis_freqs(_centred(w), axes[2]).view(1, 1, w, -1).expand(f, h, w, -1)
        parts.append(torch.cat([frame, rows, cols], dim=-1).reshape(f * h * w, -1))
    start = max(max(h // 2, w // 2) for _, h, w in grids)
    pos = torch.arange(start, start + text_length)
    text = torch.cat([_axis_freqs(pos, d) for d in axes], dim=1)
    return torch.cat(parts, dim=0), text


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs of ``x`` ``[b, tokens, heads, d]`` by ``freqs`` ``[tokens, d / 2]`` (complex; or
    ``[b, tokens, d / 2]``: each row its own)."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs.unsqueeze(-2)).flatten(3).type_as(x)


class HeadRMSNorm(torch.nn.Module):
    """RMSNorm over one head's channels (the same weight for every head, so every TP rank holds it whole)."""

    def __init__(self, dim: int, *, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x * torch.rsqrt(x.to(torch.float32).pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            return x.to(self.weight.dtype) * self.weight
        return (x * self.weight).to(dtype)


def _column(config: Any, size_in: int, size_out: int, tp_group: Any, *, gather: bool = False) -> ColumnParallelLinear:
    return ColumnParallelLinear(size_in, size_out, config=config, init_method=config.init_method, bias=True,
                                gather_output=gather, skip_bias_add=False, tp_group=tp_group)


def _row(config: Any, size_in: int, size_out: int, tp_group: Any) -> Any:
    return row_parallel_linear()(size_in, size_out, config=config, init_method=config.output_layer_init_method,
                                 bias=True, input_is_parallel=True, skip_bias_add=False, tp_group=tp_group)


class JointAttention(MegatronModule):
    """One attention over text + image tokens with separate projections per stream, heads split over TP: image
    ``to_q / to_k / to_v`` and text ``add_q_proj / add_k_proj / add_v_proj`` column-parallel, ``to_out`` (image)
    and ``to_add_out`` (text) row-parallel, per-head q / k RMSNorms for each stream."""

    def __init__(self, config: Any, *, tp_group: Any, cp_group: Any = None):
        super().__init__(config=config)
        h, d = config.hidden_size, config.kv_channels
        self.cp_group = cp_group if cp_group is not None and cp_group.size() > 1 else None
        self.heads = config.num_attention_heads // tp_group.size()
        self.sp, whole = bool(config.sequence_parallel), whole_input(config)
        for name in ("to_q", "to_k", "to_v"):
            setattr(self, name, _column(config, h, h, tp_group))
        for name in ("add_q_proj", "add_k_proj", "add_v_proj"):
            setattr(self, name, _column(whole, h, h, tp_group))
        self.to_out, self.to_add_out = _row(config, h, h, tp_group), _row(whole, h, h, tp_group)
        norm = dict(eps=config.layernorm_epsilon, dtype=config.params_dtype)
        # NOTE: named as megatron's q / k layernorms: every rank holds them whole but sees only its heads, so
        # megatron's finalize_model_grads sums their gradients over TP (config.qk_layernorm)
        self.q_layernorm, self.k_layernorm = HeadRMSNorm(d, **norm), HeadRMSNorm(d, **norm)
        self.added_q_layernorm, self.added_k_layernorm = HeadRMSNorm(d, **norm), HeadRMSNorm(d, **norm)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.heads, -1))

    def forward(self, img: torch.Tensor, txt: torch.Tensor, *, rope: tuple[torch.Tensor, torch.Tensor],
                mask: torch.Tensor | None, packed: Packed | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if packed is not None:
            return self._packed(img, txt, rope=rope, packed=packed)
        img_rope, txt_rope = rope

        def image(proj: Any) -> torch.Tensor:  # NOTE: sequence parallelism gathers the image tokens here
            return self._heads(seq_first(proj, img, sp=self.sp)[0])

        q = torch.cat([apply_rope(self.added_q_layernorm(self._heads(self.add_q_proj(txt)[0])), txt_rope),
                       apply_rope(self.q_layernorm(image(self.to_q)), img_rope)], dim=1)
        k = torch.cat([apply_rope(self.added_k_layernorm(self._heads(self.add_k_proj(txt)[0])), txt_rope),
                       apply_rope(self.k_layernorm(image(self.to_k)), img_rope)], dim=1)
        v = torch.cat([self._heads(self.add_v_proj(txt)[0]), image(self.to_v)], dim=1)
        n = txt.shape[1]
        if self.cp_group is not None:
            # NOTE: ring context parallelism: this rank's image tokens; the text (every rank's) is one more block
            from loongforge_megatron.layers.ring_attention import (
                attention_lse,
                merge_attention,
                ring_attention,
            )

            text_keys = None if mask is None else mask[:, 0, 0, :n]
            out = merge_attention(attention_lse(q, k[:, :n], v[:, :n], key_mask=text_keys),
                                  ring_attention(q, k[:, n:], v[:, n:], group=self.cp_group, return_lse=True))
            out = out.flatten(2)
        else:
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 attn_mask=mask).transpose(1, 2).flatten(2)
        return seq_first(self.to_out, out[:, n:].contiguous(), sp=self.sp)[0], self.to_add_out(out[:, :n].contiguous())[0]

    def _packed(self, img: torch.Tensor, txt: torch.Tensor, *, rope: tuple[torch.Tensor, torch.Tensor],
                packed: Packed) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed images ``img [1, tokens, h]`` (this CP rank's) with their texts ``txt [n, L, h]``: the texts'
        tokens join the sequence first, and every token attends only its own sample's (valid) text and image."""
        img_rope, txt_rope = rope
        n, length = txt.shape[:2]

        def joint(txt_proj: Any, img_proj: Any, txt_norm: Any = None, img_norm: Any = None) -> torch.Tensor:
            t, i = self._heads(txt_proj(txt)[0]), self._heads(img_proj(img)[0])
            if txt_norm is not None:
                t, i = apply_rope(txt_norm(t), txt_rope), apply_rope(img_norm(i), img_rope)
            return torch.cat([t.flatten(0, 1)[None], i], dim=1)

        q = joint(self.add_q_proj, self.to_q, self.added_q_layernorm, self.q_layernorm)
        k = joint(self.add_k_proj, self.to_k, self.added_k_layernorm, self.k_layernorm)
        v = joint(self.add_v_proj, self.to_v)
        nl = n * length
        text_mask = (packed.q_seg[:, None] == packed.txt_seg[None, :]) & packed.txt_ok[None, :]
        if self.cp_group is not None:
            from loongforge_megatron.layers.ring_attention import (
                attention_lse,
                merge_attention,
                ring_attention,
            )

            out = merge_attention(attention_lse(q, k[:, :nl], v[:, :nl], mask=text_mask),
                                  ring_attention(q, k[:, nl:], v[:, nl:], group=self.cp_group,
                                                 segments=packed.img_seg, q_segments=packed.q_seg, return_lse=True))
            out = out.flatten(2)
        else:
            mask = torch.cat([text_mask, packed.q_seg[:, None] == packed.img_seg[None, :]], dim=1)
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 attn_mask=mask).transpose(1, 2).flatten(2)
        txt_out = self.to_add_out(out[:, :nl].contiguous())[0].view(n, length, -1)
        return self.to_out(out[:, nl:].contiguous())[0], txt_out


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


class QwenImageLayer(MegatronModule):
    """One dual-stream block (see the module docstring). ``temb`` ``[b, 1, h]`` is the timestep embedding;
    ``temb_ref`` (``zero_cond_t``) the timestep 0's, which modulates the image tokens after the first ``main`` (of
    this rank's)."""

    def __init__(self, config: Any, *, arch: Any, tp_group: Any, cp_group: Any = None):
        super().__init__(config=config)
        h, eps, dtype = arch.hidden_size, arch.norm_eps, config.params_dtype
        whole = whole_input(config)  # NOTE: the modulations and the text stream see whole inputs
        self.tp_group, self.sp = tp_group, bool(config.sequence_parallel)
        self.img_mod, self.txt_mod = (_column(whole, h, 6 * h, tp_group, gather=True) for _ in range(2))
        self.img_norm1, self.img_norm2, self.txt_norm1, self.txt_norm2 = (
            torch.nn.LayerNorm(h, eps=eps, elementwise_affine=False, dtype=dtype) for _ in range(4))
        self.attn = JointAttention(config, tp_group=tp_group, cp_group=cp_group)
        sub = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=row_parallel_linear())
        self.img_mlp = MLP(config=config, submodules=sub, tp_group=tp_group)
        self.txt_mlp = MLP(config=whole, submodules=sub, tp_group=tp_group)

    @staticmethod
    def _mlp(mlp: MLP, x: torch.Tensor, *, sp: bool = False) -> torch.Tensor:
        out, bias = seq_first(mlp, x, sp=sp)
        return out if bias is None else out + bias

    def forward(self, img: torch.Tensor, txt: torch.Tensor, temb: torch.Tensor, rope: Any, mask: Any,
                temb_ref: torch.Tensor | None = None, main: int = 0, packed: Packed | None = None,
                txt_temb: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        txt_temb = temb if txt_temb is None else txt_temb  # NOTE: packed samples: one per image token, one per text
        # NOTE: sequence parallelism: the image modulation serves this rank's tokens only; its gradient is summed
        img_params = sum_grad_over_tp(self.img_mod(F.silu(temb))[0], self.tp_group, sp=self.sp)  # [b, 1, 6h]
        if temb_ref is not None:
            ref = sum_grad_over_tp(self.img_mod(F.silu(temb_ref))[0], self.tp_group, sp=self.sp)
            n = img.shape[1]
            main = min(max(main, 0), n)
            img_params = torch.cat([img_params.expand(-1, main, -1), ref.expand(-1, n - main, -1)], dim=1)
        shift1, scale1, gate1, shift2, scale2, gate2 = img_params.chunk(6, dim=-1)
        tshift1, tscale1, tgate1, tshift2, tscale2, tgate2 = self.txt_mod(F.silu(txt_temb))[0].chunk(6, dim=-1)
        img_attn, txt_attn = self.attn(_modulate(self.img_norm1(img), shift1, scale1),
                                       _modulate(self.txt_norm1(txt), tshift1, tscale1), rope=rope, mask=mask,
                                       packed=packed)
        img = img + gate1 * img_attn
        txt = txt + tgate1 * txt_attn
        img = img + gate2 * self._mlp(self.img_mlp, _modulate(self.img_norm2(img), shift2, scale2), sp=self.sp)
        txt = txt + tgate2 * self._mlp(self.txt_mlp, _modulate(self.txt_norm2(txt), tshift2, tscale2))
        return img, txt


class TimestepEmbedder(torch.nn.Module):
    """``linear_2(silu(linear_1(features)))`` (diffusers' ``TimestepEmbedding``)."""

    def __init__(self, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.linear_1 = torch.nn.Linear(TIME_FEATURES, hidden, dtype=dtype)
        self.linear_2 = torch.nn.Linear(hidden, hidden, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class QwenImageModel(MegatronModule):
    """``forward(x [b, tokens, in_channels], timesteps [b] (noise levels in [0, 1]), text [b, L, joint_attention_dim],
    text_mask [b, L] | None, *, grids) -> [b, tokens, patch^2 x out_channels]``: ``x`` holds the packed patches of
    the images ``grids`` (frames, rows, columns each) one after the other (the noisy image, then an Edit model's
    reference images); ``text_mask`` marks the real (not padded) text tokens. Under context parallelism the output
    is this rank's image tokens, ``[b, tokens / cp, ...]`` (:meth:`local_range`)."""

    def __init__(self, config: Any, arch: Any, *, tp_group: Any, recompute: bool = False, cp_group: Any = None):
        super().__init__(config=config)
        self.arch, self.recompute = arch, recompute
        self.cp_group = cp_group if cp_group is not None and cp_group.size() > 1 else None
        self.tp_group, self.sp = tp_group, bool(config.sequence_parallel)
        h, dtype = arch.hidden_size, config.params_dtype
        self.img_in = torch.nn.Linear(arch.in_channels, h, dtype=dtype)
        self.txt_norm = torch.nn.RMSNorm(arch.joint_attention_dim, eps=arch.norm_eps, dtype=dtype)
        self.txt_in = torch.nn.Linear(arch.joint_attention_dim, h, dtype=dtype)
        self.time_embedder = TimestepEmbedder(h, dtype)
        self.layers = torch.nn.ModuleList(QwenImageLayer(config, arch=arch, tp_group=tp_group, cp_group=cp_group)
                                          for _ in range(arch.num_layers))
        self.norm_out = torch.nn.LayerNorm(h, eps=arch.norm_eps, elementwise_affine=False, dtype=dtype)
        self.norm_out_linear = torch.nn.Linear(h, 2 * h, dtype=dtype)
        self.proj_out = torch.nn.Linear(h, arch.patch_size**2 * arch.out_channels, dtype=dtype)
        self._init_weights()
        if self.sp:  # NOTE: they see only this rank's image tokens
            mark_sequence_parallel(self.img_in)
            mark_sequence_parallel(self.proj_out)

    @torch.no_grad()
    def _init_weights(self) -> None:
        """Whole-held linears: xavier-uniform weights, zero biases; the output head zero, so a fresh model predicts
        zero velocity. The blocks' linears come from the config's init."""
        for m in (self.img_in, self.txt_in, self.time_embedder.linear_1, self.time_embedder.linear_2,
                  self.norm_out_linear, self.proj_out):
            torch.nn.init.xavier_uniform_(m.weight)
            torch.nn.init.zeros_(m.bias)
        torch.nn.init.zeros_(self.proj_out.weight)

    def set_input_tensor(self, input_tensor: Any) -> None:
        """megatron's schedules call this on every model (only stages after the first use it: none here)."""

    def _text_rms(self, text: torch.Tensor) -> torch.Tensor:
        """diffusers' RMSNorm (fp32 statistics; the product with the weight in the weight's dtype)."""
        w = self.txt_norm.weight
        x = text * torch.rsqrt(text.to(torch.float32).pow(2).mean(-1, keepdim=True) + self.arch.norm_eps)
        return (x.to(w.dtype) if w.dtype in (torch.float16, torch.bfloat16) else x) * w

    def _layer(self, layer: QwenImageLayer, img: torch.Tensor, txt: torch.Tensor, temb: torch.Tensor, rope: Any,
               mask: Any, temb_ref: Any, main: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.recompute and torch.is_grad_enabled():
            # NOTE: megatron's checkpoint saves its arguments for backward: tensors (or None) only
            def run(img, txt, temb, img_rope, txt_rope, mask, temb_ref):
                return layer(img, txt, temb, (img_rope, txt_rope), mask, temb_ref, main)

            return tensor_parallel.checkpoint(run, False, img, txt, temb, *rope, mask, temb_ref)
        return layer(img, txt, temb, rope, mask, temb_ref, main)

    def local_range(self, tokens: int) -> tuple[int, int]:
        """This CP rank's image tokens ``[start, end)`` of ``tokens`` (all of them without context parallelism)."""
        if self.cp_group is None:
            return 0, tokens
        n = tokens // self.cp_group.size()
        return self.cp_group.rank() * n, (self.cp_group.rank() + 1) * n

    def forward(self, x: torch.Tensor, timesteps: torch.Tensor, text: torch.Tensor,
                text_mask: torch.Tensor | None = None, *, grids: Sequence[Grid]) -> torch.Tensor:
        if x.dim() == 2:
            return self.forward_packed(x, timesteps, text, text_mask, grids=grids)
        start, end = self.local_range(x.shape[1])
        first = start  # NOTE: the residual stream's first token (sequence parallelism splits the CP rank's again)
        if self.sp:
            n = (end - start) // self.tp_group.size()
            first = start + self.tp_group.rank() * n
        img = self.img_in(x[:, first:first + n] if self.sp else x[:, start:end])
        dtype = img.dtype
        t = timesteps.to(dtype)
        temb = self.time_embedder(timestep_features(t).to(dtype))[:, None]  # [b, 1, h]
        temb_ref, main = None, 0
        if self.arch.zero_cond_t:
            temb_ref = self.time_embedder(timestep_features(t * 0).to(dtype))[:, None]
            main = math.prod(grids[0]) - first
        txt = self.txt_in(self._text_rms(text))
        img_rope, txt_rope = rope_freqs(axes=self.arch.axes_dims_rope, grids=grids, text_length=text.shape[1])
        rope = (img_rope[start:end].to(x.device), txt_rope.to(x.device))
        mask = None
        if text_mask is not None:
            keep = torch.ones(img.shape[0], end - start, dtype=torch.bool, device=img.device)
            mask = torch.cat([text_mask.to(torch.bool), keep], dim=1)[:, None, None, :]
        for layer in self.layers:
            img, txt = self._layer(layer, img, txt, temb, rope, mask, temb_ref, main)
        out_mod = sum_grad_over_tp(self.norm_out_linear(F.silu(temb).to(dtype)), self.tp_group, sp=self.sp)
        scale, shift = out_mod.chunk(2, dim=-1)
        return gather_tokens(self.proj_out(self.norm_out(img) * (1 + scale) + shift), self.tp_group, sp=self.sp)

    def forward_packed(self, x: torch.Tensor, timesteps: torch.Tensor, text: torch.Tensor,
                       text_mask: torch.Tensor | None, *, grids: Any) -> torch.Tensor:
        """Packed images of different sizes: ``x [T, in_channels]`` (every image's packed patches, joined), one
        ``grids`` row, timestep, ``text [n, L, dim]`` and ``text_mask [n, L]`` row per image -> this CP rank's
        ``[1, T / cp, patch^2 x out_channels]``; each image is the same function as :meth:`forward` of it alone."""
        rows = [tuple(int(v) for v in g) for g in (grids.tolist() if isinstance(grids, torch.Tensor) else grids)]
        counts = torch.tensor([math.prod(g) for g in rows], device=x.device)
        start, end = self.local_range(x.shape[0])
        n, length = text.shape[:2]
        img = self.img_in(x[start:end])[None]
        dtype = img.dtype
        temb = self.time_embedder(timestep_features(timesteps.to(dtype)).to(dtype))  # [n, h]
        img_temb = temb.repeat_interleave(counts, dim=0)[start:end][None]  # [1, T / cp, h]
        txt = self.txt_in(self._text_rms(text))
        ropes = [rope_freqs(axes=self.arch.axes_dims_rope, grids=[g], text_length=length) for g in rows]
        rope = (torch.cat([r[0] for r in ropes])[start:end].to(x.device),
                torch.stack([r[1] for r in ropes]).to(x.device))
        samples = torch.arange(n, device=x.device)
        img_seg, txt_seg = samples.repeat_interleave(counts), samples.repeat_interleave(length)
        ok = (text_mask.to(torch.bool) if text_mask is not None
              else torch.ones(n, length, dtype=torch.bool, device=x.device)).flatten()
        packed = Packed(q_seg=torch.cat([txt_seg, img_seg[start:end]]), img_seg=img_seg, txt_seg=txt_seg, txt_ok=ok)
        for layer in self.layers:
            if self.recompute and torch.is_grad_enabled():
                def run(img, txt, img_temb, txt_temb, img_rope, txt_rope, layer=layer):
                    return layer(img, txt, img_temb, (img_rope, txt_rope), None, packed=packed, txt_temb=txt_temb)

                img, txt = tensor_parallel.checkpoint(run, False, img, txt, img_temb, temb[:, None], *rope)
            else:
                img, txt = layer(img, txt, img_temb, rope, None, packed=packed, txt_temb=temb[:, None])
        scale, shift = self.norm_out_linear(F.silu(img_temb).to(dtype)).chunk(2, dim=-1)
        return self.proj_out(self.norm_out(img) * (1 + scale) + shift)


def pack(latent: torch.Tensor, patch: int) -> torch.Tensor:
    """``[b, c, H, W]`` -> ``[b, (H / p) (W / p), c p p]`` (the pipeline's packing, and the layout of the
    output head's channels)."""
    b, c, h, w = latent.shape
    x = latent.view(b, c, h // patch, patch, w // patch, patch).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // patch) * (w // patch), c * patch * patch)


def transformer_config(arch: Any, *, plan: Any, precision: str, grad_accum_fusion: bool = False) -> TransformerConfig:
    """megatron-core ``TransformerConfig`` of a Qwen-Image model under ``plan``.

    NOTE: initialised on the CPU (``use_cpu_initialization``): megatron draws each parallel weight whole and splits
    it, so every TP layout starts from the same weights. ``qk_layernorm``: the per-head norms' gradients are summed
    over TP.
    """
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    return TransformerConfig(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads, num_query_groups=arch.num_attention_heads,
        kv_channels=arch.head_dim, normalization="LayerNorm", layernorm_epsilon=arch.norm_eps, qk_layernorm=True,
        gated_linear_unit=False, activation_func=gelu_tanh, add_bias_linear=True, add_qkv_bias=True,
        hidden_dropout=0.0, attention_dropout=0.0,
        init_method=torch.nn.init.xavier_uniform_, output_layer_init_method=torch.nn.init.xavier_uniform_,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=grad_accum_fusion, persist_layer_norm=False, tensor_model_parallel_size=plan.tp,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=precision == "bf16", fp16=precision == "fp16",
        use_cpu_initialization=True, calculate_per_token_loss=True, variable_seq_lengths=False,
        sequence_parallel=plan.sp,
    )


def build_qwen_image(*, config: Any, arch: Any, device: torch.device, recompute: bool = False,
                     compile_mode: str | None = None) -> list[torch.nn.Module]:
    """``[QwenImageModel]`` for this rank, before DDP (one chunk). ``compile_mode`` compiles each block."""
    from megatron.core import parallel_state as mpu

    model = QwenImageModel(config, arch, tp_group=mpu.get_tensor_model_parallel_group(), recompute=recompute,
                           cp_group=mpu.get_context_parallel_group())
    model.model_type = ModelType.encoder_or_decoder  # NOTE: megatron's schedules read it
    model.to(device=device)
    if compile_mode is not None:
        for layer in model.layers:
            layer.compile(mode=None if compile_mode == "default" else compile_mode)
    return [model]


def forward_step(data_iterator: Iterator[dict[str, Any]], model: torch.nn.Module, *, patch: int):
    """megatron's ``forward_step_func`` for Qwen-Image: flow matching (velocity target) on the batch's clean latent
    image ``x0``, ``noise`` and noise levels ``sigmas``; an Edit batch's clean ``reference`` images
    ``[b, n, c, H, W]`` follow the noisy image's patches, and only the noisy image's tokens are scored.

    NOTE: the model's timestep input is the noise level itself (its embedding scales by 1000 inside)."""
    param = next(model.parameters())
    batch = _to_device(next(data_iterator), param.device)
    x0, noise, sigmas = batch["x0"], batch["noise"], batch["sigmas"]
    if "grid" in batch:  # packed images of different sizes: x0 / noise are their joined patch tokens
        counts = torch.tensor([math.prod(int(v) for v in g) for g in batch["grid"].tolist()], device=x0.device)
        noisy = fm.add_noise(x0, noise, sigmas.repeat_interleave(counts))
        pred = model(noisy.to(param.dtype), sigmas, batch["text"], batch.get("text_mask"), grids=batch["grid"])
        start, end = unwrap(model).local_range(x0.shape[0])
        return fm.squared_error(pred[0], x0[start:end], noise[start:end]), fm.loss_func
    noisy = pack(fm.add_noise(x0, noise, sigmas), patch)
    grid = (1, x0.shape[-2] // patch, x0.shape[-1] // patch)
    grids, tokens = [grid], [noisy]
    reference = batch.get("reference")
    if reference is not None:
        for i in range(reference.shape[1]):
            ref = reference[:, i]
            tokens.append(pack(ref, patch))
            grids.append((1, ref.shape[-2] // patch, ref.shape[-1] // patch))
    pred = model(torch.cat(tokens, dim=1).to(param.dtype), sigmas, batch["text"], batch.get("text_mask"),
                 grids=grids)
    # NOTE: this context-parallel rank's tokens of the noisy image (megatron sums the ranks' sums and counts)
    start, end = unwrap(model).local_range(sum(t.shape[1] for t in tokens))
    scored = slice(start, min(end, noisy.shape[1]))
    pred = pred[:, : max(scored.stop - start, 0)]
    return fm.squared_error(pred, pack(x0, patch)[:, scored], pack(noise, patch)[:, scored]), fm.loss_func
