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

Context parallelism: each CP rank keeps its contiguous ``1 / cp`` of the image tokens and the whole text;
``cp_comm_type`` p2p (ring) attends the text keys locally and the image keys around the ring
(``layers/ring_attention.py``), merged by their log-sum-exps; a2a (Ulysses, ``layers/ulysses.py``) trades the
image tokens' split for a head split and attends this rank's heads of every text and image token. Sequence
parallelism (``config.sequence_parallel``) splits the image stream's tokens over TP
(``layers/sequence_parallel.py``); the text stream and the modulations see whole inputs. Packed micro-batches of
samples of different sizes (``layers/packing.py``; an Edit sample's reference images follow its noisy image) join
their image tokens into one sequence and their texts into one row; every token attends only its own sample's real
text and image tokens (:class:`Packed`), under every layout. Pipeline parallelism is not supported.
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
from loongforge_megatron.layers.packing import Packing, attend_segments
from loongforge_megatron.layers.sequence_parallel import (
    gather_tokens,
    mark_sequence_parallel,
    seq_first,
    sum_grad_over_tp,
    whole_input,
)
from loongforge_megatron.layers.ulysses import gather_heads, heads_to_tokens, own_heads, tokens_to_heads
from loongforge_megatron.models import flow_matching as fm
from loongforge_megatron.models.qwen_image.arch import ROPE_THETA, TIME_FEATURES

Grid = tuple[int, int, int]  # frames, rows, columns of one image's patches


@dataclass(frozen=True)
class Packed:
    """A packed micro-batch as the blocks read it (built once per forward from its :class:`Packing`: the samples'
    image tokens, each sample's noisy image then its reference images, and this CP rank's share of them). The texts
    of its ``n`` samples are one row of ``n x L`` tokens before the image tokens.

    - ``mod_rows`` / ``sample_rows``: for each image token of this rank's residual stream, its row of the blocks'
      timestep table (the samples', then with ``zero_cond_t`` the timestep 0's of the reference images) and its
      sample (the output head's modulation);
    - the ring reads which sample each token belongs to: ``q_seg`` (this rank's queries: texts, then its image
      tokens), ``img_seg`` (every image token), ``txt_seg``, and ``txt_ok`` (real text tokens, not padding);
    - the attention over every token (one CP rank, or Ulysses) regroups them sample by sample for the varlen
      attention: ``order_q`` (each sample's texts, then its image tokens), ``order_k`` (its real texts, then its
      image tokens), their ``bounds_q`` / ``bounds_k``, and ``inverse_q`` back."""

    mod_rows: torch.Tensor
    sample_rows: torch.Tensor
    q_seg: torch.Tensor
    img_seg: torch.Tensor
    txt_seg: torch.Tensor
    txt_ok: torch.Tensor
    order_q: torch.Tensor
    inverse_q: torch.Tensor
    order_k: torch.Tensor
    bounds_q: tuple[int, ...]
    bounds_k: tuple[int, ...]

    @classmethod
    def of(cls, packing: Packing, *, main: Sequence[int], text_mask: torch.Tensor, residual: tuple[int, int],
           zero_cond_t: bool) -> Packed:
        """``main``: each sample's noisy-image tokens (its first ones); ``text_mask [n, L]`` bool; ``residual``:
        this rank's residual-stream image tokens ``[start, end)`` (of all of them)."""
        device = text_mask.device
        n, length = text_mask.shape
        bounds = packing.bounds
        img_seg = packing.segments(device)
        rows = img_seg.clone()
        if zero_cond_t:  # NOTE: a sample's reference images take the timestep 0's row
            for i, m in enumerate(main):
                rows[bounds[i] + m:bounds[i + 1]] += n
        samples = torch.arange(n, device=device)
        txt_seg = samples.repeat_interleave(length)
        text_pos = torch.arange(n * length, device=device).view(n, length)
        img_pos = n * length + torch.arange(bounds[-1], device=device)
        real = [int(v) for v in text_mask.sum(1).tolist()]
        order_q = torch.cat([torch.cat([text_pos[i], img_pos[bounds[i]:bounds[i + 1]]]) for i in range(n)])
        order_k = torch.cat([torch.cat([text_pos[i][text_mask[i]], img_pos[bounds[i]:bounds[i + 1]]])
                             for i in range(n)])
        bounds_q, bounds_k = [0], [0]
        for i, c in enumerate(packing.counts):
            bounds_q.append(bounds_q[-1] + length + c)
            bounds_k.append(bounds_k[-1] + real[i] + c)
        start, end = residual
        return cls(mod_rows=rows[start:end], sample_rows=img_seg[start:end],
                   q_seg=torch.cat([txt_seg, packing.local(img_seg)]), img_seg=img_seg, txt_seg=txt_seg,
                   txt_ok=text_mask.flatten(), order_q=order_q, inverse_q=torch.argsort(order_q), order_k=order_k,
                   bounds_q=tuple(bounds_q), bounds_k=tuple(bounds_k))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of every token ``[1, n L + T, heads, d]`` (texts, then every image token) within its own
        sample, real text keys only -> ``[1, n L + T, heads, d]``."""
        out = attend_segments(q[:, self.order_q], k[:, self.order_k], v[:, self.order_k], bounds_q=self.bounds_q,
                              bounds_k=self.bounds_k)
        return out[:, self.inverse_q].unflatten(-1, (q.shape[2], -1))


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
    and ``to_add_out`` (text) row-parallel, per-head q / k RMSNorms for each stream.

    Context parallelism (this rank's image tokens, every text token): ``cp_comm_type`` p2p attends the text keys
    locally and the image keys around the ring, merged by their log-sum-exps; a2a (Ulysses) trades the image
    tokens' split for a head split, attends this rank's heads of the text and every image token, and gathers the
    text's heads back."""

    def __init__(self, config: Any, *, tp_group: Any, cp_group: Any = None, cp_comm_type: str = "p2p"):
        super().__init__(config=config)
        h, d = config.hidden_size, config.kv_channels
        self.cp_group = cp_group if cp_group is not None and cp_group.size() > 1 else None
        self.ring = self.cp_group is not None and cp_comm_type == "p2p"
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
        """``img [b, tokens, h]`` (this rank's residual stream) and ``txt [b, L, h]`` -> their attention outputs;
        ``mask [b, L]`` True for real text tokens. Packed (``packed``): ``img [1, tokens, h]`` and the samples'
        texts ``txt [n, L, h]``, every token attending only its own sample's real text and image tokens."""
        img_rope, txt_rope = rope

        def image(proj: Any) -> torch.Tensor:  # NOTE: sequence parallelism gathers the CP rank's image tokens here
            return self._heads(seq_first(proj, img, sp=self.sp)[0])

        def text(proj: Any) -> torch.Tensor:
            return self._heads(proj(txt)[0])

        tq = apply_rope(self.added_q_layernorm(text(self.add_q_proj)), txt_rope)
        tk = apply_rope(self.added_k_layernorm(text(self.add_k_proj)), txt_rope)
        tv = text(self.add_v_proj)
        iq = apply_rope(self.q_layernorm(image(self.to_q)), img_rope)
        ik = apply_rope(self.k_layernorm(image(self.to_k)), img_rope)
        iv = image(self.to_v)
        rows, length = txt.shape[:2]
        if packed is not None:  # NOTE: the samples' texts are one row of tokens
            tq, tk, tv = (t.flatten(0, 1)[None] for t in (tq, tk, tv))
        n = tq.shape[1]
        if self.ring:
            from loongforge_megatron.layers.ring_attention import (
                attention_lse,
                merge_attention,
                ring_attention,
            )

            q = torch.cat([tq, iq], dim=1)
            if packed is None:
                local = attention_lse(q, tk, tv, key_mask=mask)
                ring = ring_attention(q, ik, iv, group=self.cp_group, return_lse=True)
            else:
                text_mask = (packed.q_seg[:, None] == packed.txt_seg[None, :]) & packed.txt_ok[None, :]
                local = attention_lse(q, tk, tv, mask=text_mask)
                ring = ring_attention(q, ik, iv, group=self.cp_group, segments=packed.img_seg,
                                      q_segments=packed.q_seg, return_lse=True)
            out = merge_attention(local, ring)
            t_out, i_out = out[:, :n], out[:, n:]
        else:
            if self.cp_group is not None:  # NOTE: Ulysses: every image token, this rank's heads
                iq, ik, iv = (tokens_to_heads(t, self.cp_group) for t in (iq, ik, iv))
                tq, tk, tv = (own_heads(t, self.cp_group) for t in (tq, tk, tv))
            q, k, v = (torch.cat(p, dim=1) for p in ((tq, iq), (tk, ik), (tv, iv)))
            if packed is not None:
                out = packed.attend(q, k, v)
            else:
                keys = None
                if mask is not None:
                    keep = torch.ones(mask.shape[0], ik.shape[1], dtype=torch.bool, device=mask.device)
                    keys = torch.cat([mask, keep], dim=1)[:, None, None, :]
                out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                     attn_mask=keys).transpose(1, 2)
            t_out, i_out = out[:, :n], out[:, n:]
            if self.cp_group is not None:
                t_out, i_out = gather_heads(t_out, self.cp_group), heads_to_tokens(i_out, self.cp_group)
        t_out = t_out.flatten(2).reshape(rows, length, -1)
        return (seq_first(self.to_out, i_out.flatten(2).contiguous(), sp=self.sp)[0],
                self.to_add_out(t_out.contiguous())[0])


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


class QwenImageLayer(MegatronModule):
    """One dual-stream block (see the module docstring). ``temb`` ``[b, 1, h]`` is the timestep embedding;
    ``temb_ref`` (``zero_cond_t``) the timestep 0's, which modulates the image tokens after the first ``main`` (of
    this rank's). Packed (``packed``): ``temb [rows, 1, h]`` is a table the image tokens pick their rows of
    (:class:`Packed`), its first ``n`` rows the ``n`` samples' (their texts')."""

    def __init__(self, config: Any, *, arch: Any, tp_group: Any, cp_group: Any = None, cp_comm_type: str = "p2p"):
        super().__init__(config=config)
        h, eps, dtype = arch.hidden_size, arch.norm_eps, config.params_dtype
        whole = whole_input(config)  # NOTE: the modulations and the text stream see whole inputs
        self.tp_group, self.sp = tp_group, bool(config.sequence_parallel)
        self.img_mod, self.txt_mod = (_column(whole, h, 6 * h, tp_group, gather=True) for _ in range(2))
        self.img_norm1, self.img_norm2, self.txt_norm1, self.txt_norm2 = (
            torch.nn.LayerNorm(h, eps=eps, elementwise_affine=False, dtype=dtype) for _ in range(4))
        self.attn = JointAttention(config, tp_group=tp_group, cp_group=cp_group, cp_comm_type=cp_comm_type)
        sub = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=row_parallel_linear())
        self.img_mlp = MLP(config=config, submodules=sub, tp_group=tp_group)
        self.txt_mlp = MLP(config=whole, submodules=sub, tp_group=tp_group)

    @staticmethod
    def _mlp(mlp: MLP, x: torch.Tensor, *, sp: bool = False) -> torch.Tensor:
        out, bias = seq_first(mlp, x, sp=sp)
        return out if bias is None else out + bias

    def forward(self, img: torch.Tensor, txt: torch.Tensor, temb: torch.Tensor, rope: Any, mask: Any,
                temb_ref: torch.Tensor | None = None, main: int = 0,
                packed: Packed | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        # NOTE: sequence parallelism: the image modulation serves this rank's tokens only; its gradient is summed
        img_params = sum_grad_over_tp(self.img_mod(F.silu(temb))[0], self.tp_group, sp=self.sp)  # [b, 1, 6h]
        txt_temb = temb
        if packed is not None:
            # NOTE: temb [rows, 1, h]: the samples' timestep embeddings (then zero_cond_t's timestep 0 rows); each
            # image token takes its row, each sample's text its own
            img_params = img_params[packed.mod_rows].transpose(0, 1)
            txt_temb = temb[:txt.shape[0]]
        elif temb_ref is not None:
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
    is this rank's image tokens, ``[b, tokens / cp, ...]`` (:meth:`local_range`); ``cp_comm_type`` picks the
    joint attention's exchange (p2p: ring, a2a: Ulysses).

    :meth:`forward_packed` (``x [T, in_channels]``) takes a packed micro-batch of samples of different sizes."""

    def __init__(self, config: Any, arch: Any, *, tp_group: Any, recompute: bool = False, cp_group: Any = None,
                 cp_comm_type: str = "p2p"):
        super().__init__(config=config)
        self.arch, self.recompute = arch, recompute
        self.cp_group = cp_group if cp_group is not None and cp_group.size() > 1 else None
        self.tp_group, self.sp = tp_group, bool(config.sequence_parallel)
        h, dtype = arch.hidden_size, config.params_dtype
        self.img_in = torch.nn.Linear(arch.in_channels, h, dtype=dtype)
        self.txt_norm = torch.nn.RMSNorm(arch.joint_attention_dim, eps=arch.norm_eps, dtype=dtype)
        self.txt_in = torch.nn.Linear(arch.joint_attention_dim, h, dtype=dtype)
        self.time_embedder = TimestepEmbedder(h, dtype)
        self.layers = torch.nn.ModuleList(QwenImageLayer(config, arch=arch, tp_group=tp_group, cp_group=cp_group,
                                                         cp_comm_type=cp_comm_type)
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
               mask: Any, temb_ref: Any = None, main: int = 0,
               packed: Packed | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.recompute and torch.is_grad_enabled():
            # NOTE: megatron's checkpoint saves its arguments for backward: tensors (or None) only
            def run(img, txt, temb, img_rope, txt_rope, mask, temb_ref):
                return layer(img, txt, temb, (img_rope, txt_rope), mask, temb_ref, main, packed)

            return tensor_parallel.checkpoint(run, False, img, txt, temb, *rope, mask, temb_ref)
        return layer(img, txt, temb, rope, mask, temb_ref, main, packed)

    def local_range(self, tokens: int) -> tuple[int, int]:
        """This CP rank's image tokens ``[start, end)`` of ``tokens`` (all of them without context parallelism)."""
        if self.cp_group is None:
            return 0, tokens
        n = tokens // self.cp_group.size()
        return self.cp_group.rank() * n, (self.cp_group.rank() + 1) * n

    def residual_range(self, start: int, end: int) -> tuple[int, int]:
        """The image tokens this rank's residual stream holds of its CP rank's ``[start, end)``: sequence
        parallelism splits them again over TP."""
        if not self.sp:
            return start, end
        n = (end - start) // self.tp_group.size()
        first = start + self.tp_group.rank() * n
        return first, first + n

    def forward(self, x: torch.Tensor, timesteps: torch.Tensor, text: torch.Tensor,
                text_mask: torch.Tensor | None = None, *, grids: Sequence[Grid]) -> torch.Tensor:
        if x.dim() == 2:
            return self.forward_packed(x, timesteps, text, text_mask, grids=grids)
        start, end = self.local_range(x.shape[1])
        first, last = self.residual_range(start, end)
        img = self.img_in(x[:, first:last])
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
        mask = None if text_mask is None else text_mask.to(torch.bool)
        for layer in self.layers:
            img, txt = self._layer(layer, img, txt, temb, rope, mask, temb_ref, main)
        out_mod = sum_grad_over_tp(self.norm_out_linear(F.silu(temb).to(dtype)), self.tp_group, sp=self.sp)
        scale, shift = out_mod.chunk(2, dim=-1)
        return gather_tokens(self.proj_out(self.norm_out(img) * (1 + scale) + shift), self.tp_group, sp=self.sp)

    def forward_packed(self, x: torch.Tensor, timesteps: torch.Tensor, text: torch.Tensor,
                       text_mask: torch.Tensor | None, *, grids: Any) -> torch.Tensor:
        """Packed samples of different sizes: ``x [T, in_channels]`` (every sample's images' packed patches,
        joined: its noisy image, then an Edit model's reference images), ``grids`` (each sample's images' rows, in
        order), ``timesteps [n]``, ``text [n, L, dim]`` and ``text_mask [n, L]`` -> this CP rank's ``[1, T / cp,
        patch^2 x out_channels]``; each sample is the same function as :meth:`forward` of it alone."""
        rows = [tuple(int(v) for v in g) for g in (grids.tolist() if isinstance(grids, torch.Tensor) else grids)]
        n, length = text.shape[:2]
        if len(rows) % n:
            raise ValueError(f"{len(rows)} image grids do not divide among {n} packed samples")
        per = len(rows) // n
        samples = [rows[i * per:(i + 1) * per] for i in range(n)]
        counts = [sum(math.prod(g) for g in sample) for sample in samples]
        cp = {} if self.cp_group is None else dict(cp_rank=self.cp_group.rank(), cp_size=self.cp_group.size())
        packing = Packing.of_counts(counts, **cp)
        first, last = self.residual_range(packing.start, packing.end)
        img = self.img_in(x[first:last])[None]
        dtype = img.dtype
        t = timesteps.to(dtype)
        temb = self.time_embedder(timestep_features(t).to(dtype))  # [n, h]
        table = temb
        if self.arch.zero_cond_t:  # NOTE: the reference images' rows follow the samples'
            table = torch.cat([temb, self.time_embedder(timestep_features(t * 0).to(dtype))])
        txt = self.txt_in(self._text_rms(text))
        ropes = [rope_freqs(axes=self.arch.axes_dims_rope, grids=sample, text_length=length) for sample in samples]
        rope = (packing.local(torch.cat([r[0] for r in ropes])).to(x.device),
                torch.stack([r[1] for r in ropes]).to(x.device))
        ok = (text_mask.to(torch.bool) if text_mask is not None
              else torch.ones(n, length, dtype=torch.bool, device=x.device))
        packed = Packed.of(packing, main=[math.prod(sample[0]) for sample in samples], text_mask=ok,
                           residual=(first, last), zero_cond_t=self.arch.zero_cond_t)
        for layer in self.layers:
            img, txt = self._layer(layer, img, txt, table[:, None], rope, None, packed=packed)
        out_mod = sum_grad_over_tp(self.norm_out_linear(F.silu(temb).to(dtype)), self.tp_group, sp=self.sp)
        scale, shift = out_mod[packed.sample_rows][None].chunk(2, dim=-1)
        return gather_tokens(self.proj_out(self.norm_out(img) * (1 + scale) + shift), self.tp_group, sp=self.sp)


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
                     compile_mode: str | None = None, cp_comm_type: str = "p2p") -> list[torch.nn.Module]:
    """``[QwenImageModel]`` for this rank, before DDP (one chunk). ``compile_mode`` compiles each block;
    ``cp_comm_type`` picks the context-parallel joint attention (p2p: ring, a2a: Ulysses)."""
    from megatron.core import parallel_state as mpu

    model = QwenImageModel(config, arch, tp_group=mpu.get_tensor_model_parallel_group(), recompute=recompute,
                           cp_group=mpu.get_context_parallel_group(), cp_comm_type=cp_comm_type)
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
    if "grid" in batch:
        return _packed_step(batch, model, dtype=param.dtype)
    x0, noise, sigmas = batch["x0"], batch["noise"], batch["sigmas"]
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


def sample_order(sizes: Sequence[int], *, samples: int) -> torch.Tensor:
    """Where each token of a packed sequence comes from in ``cat(noisy images, reference images)``: each of the
    ``samples`` samples owns ``len(sizes) / samples`` consecutive images of ``sizes`` tokens (its noisy image,
    then its references), and its tokens are its noisy image's, then its references'."""
    per = len(sizes) // samples
    main = [sizes[i * per] for i in range(samples)]
    parts, at_main, at_ref = [], 0, sum(main)
    for i in range(samples):
        refs = sum(sizes[i * per + 1:(i + 1) * per])
        parts += [torch.arange(at_main, at_main + main[i]), torch.arange(at_ref, at_ref + refs)]
        at_main, at_ref = at_main + main[i], at_ref + refs
    return torch.cat(parts)


def _packed_step(batch: dict[str, Any], model: torch.nn.Module, *, dtype: torch.dtype):
    """:func:`forward_step` of a packed micro-batch: ``x0`` / ``noise`` the noisy images' joined patch tokens,
    ``reference`` (Edit) the reference images', one ``grid`` row per image (a sample's noisy image, then its
    references); each token is noised at its sample's level and only the noisy images' tokens are scored."""
    x0, noise, sigmas, grid = batch["x0"], batch["noise"], batch["sigmas"], batch["grid"]
    sizes = [math.prod(int(v) for v in g) for g in grid.tolist()]
    per = len(sizes) // sigmas.shape[0]
    counts = torch.tensor(sizes[::per], device=x0.device)
    noisy = fm.add_noise(x0, noise, sigmas.repeat_interleave(counts))
    order = sample_order(sizes, samples=sigmas.shape[0]).to(x0.device)
    tokens = torch.cat([noisy, batch.get("reference", x0[:0]).to(noisy.dtype)])[order]
    pred = model(tokens.to(dtype), sigmas, batch["text"], batch.get("text_mask"), grids=grid)[0]
    # NOTE: this context-parallel rank's tokens of the noisy images (megatron sums the ranks' sums and counts)
    start, end = unwrap(model).local_range(tokens.shape[0])
    local = order[start:end]
    scored = local < x0.shape[0]
    src = local[scored]
    return fm.squared_error(pred[scored], x0[src], noise[src]), fm.loss_func
