"""GR00T N1.5's flow-matching action head in plain torch: per-embodiment encoders/decoder and a DiT.

Follows ``gr00t/model/action_head`` (``flow_matching_action_head.py``, ``cross_attention_dit.py``; parameter names
kept: ``W``/``b``, ``to_q``/``to_k``/``to_v``/``to_out``, ``norm1``/``norm3``/``ff``, ``proj_out_1``/``proj_out_2``).
Differences: no dropout (GR00T uses 0.2; it would make the data-parallel equivalence tests depend on the
RNG split), the VLM padding mask is applied in the VL self-attention and the DiT's cross-attention (GR00T passes
none), and the action position embedding has ``chunk_size`` rows (GR00T: 1024).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from loongforge_embodied.policies.groot.configuration_groot import GrootArch


class CategorySpecificLinear(nn.Module):
    """One linear layer per embodiment: ``W`` (E, in, out), ``b`` (E, out), rows picked by the embodiment id.

    Indexing with the batch's ids means only the rows of embodiments in the batch receive gradients."""

    def __init__(self, num_categories: int, in_dim: int, out_dim: int):
        super().__init__()
        self.W = nn.Parameter(0.02 * torch.randn(num_categories, in_dim, out_dim))
        self.b = nn.Parameter(torch.zeros(num_categories, out_dim))

    def forward(self, x: torch.Tensor, cat_ids: torch.Tensor) -> torch.Tensor:
        """x (B, T, in), cat_ids (B,) → (B, T, out)."""
        return torch.baddbmm(self.b[cat_ids].unsqueeze(1).to(x.dtype), x, self.W[cat_ids].to(x.dtype))


class CategorySpecificMLP(nn.Module):
    def __init__(self, num_categories: int, in_dim: int, hidden: int, out_dim: int):
        super().__init__()
        self.layer1 = CategorySpecificLinear(num_categories, in_dim, hidden)
        self.layer2 = CategorySpecificLinear(num_categories, hidden, out_dim)

    def forward(self, x: torch.Tensor, cat_ids: torch.Tensor) -> torch.Tensor:
        return self.layer2(F.relu(self.layer1(x, cat_ids)), cat_ids)


def sinusoidal(t: torch.Tensor, dim: int) -> torch.Tensor:
    """GR00T's ``SinusoidalPositionalEncoding`` of (B, T) timesteps: [sin, cos] with periods up to 10⁴."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    x = t.float().unsqueeze(-1) * freqs
    return torch.cat([torch.sin(x), torch.cos(x)], dim=-1)


class MultiEmbodimentActionEncoder(nn.Module):
    """Noisy action chunk + flow timestep → action tokens: W3(swish(W2([W1(a), sin(τ)]))) per embodiment."""

    def __init__(self, action_dim: int, width: int, num_embodiments: int):
        super().__init__()
        self.width = width
        self.W1 = CategorySpecificLinear(num_embodiments, action_dim, width)
        self.W2 = CategorySpecificLinear(num_embodiments, 2 * width, width)
        self.W3 = CategorySpecificLinear(num_embodiments, width, width)

    def forward(self, actions: torch.Tensor, timesteps: torch.Tensor, cat_ids: torch.Tensor) -> torch.Tensor:
        a = self.W1(actions, cat_ids)
        tau = sinusoidal(timesteps[:, None].expand(-1, actions.shape[1]), self.width).to(a.dtype)
        return self.W3(F.silu(self.W2(torch.cat([a, tau], dim=-1), cat_ids)), cat_ids)


class TimestepEncoder(nn.Module):
    """diffusers' ``Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=1)`` + ``TimestepEmbedding``."""

    def __init__(self, dim: int, channels: int = 256):
        super().__init__()
        self.channels = channels
        self.linear_1 = nn.Linear(channels, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, timesteps: torch.Tensor) -> torch.Tensor:
        half = self.channels // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=timesteps.device)
                          / (half - 1))
        x = timesteps.float()[:, None] * freqs[None]
        emb = torch.cat([torch.cos(x), torch.sin(x)], dim=-1).to(self.linear_1.weight.dtype)
        return self.linear_2(F.silu(self.linear_1(emb)))


class AdaLayerNorm(nn.Module):
    """LayerNorm (no affine) modulated by the timestep: ``norm(x)·(1 + scale) + shift``."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim)
        self.norm = nn.LayerNorm(dim, eps=eps, elementwise_affine=False)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        scale, shift = self.linear(F.silu(temb)).chunk(2, dim=-1)
        return self.norm(x) * (1 + scale[:, None]) + shift[:, None]


class Attention(nn.Module):
    """Multi-head attention (self, or cross to ``context`` of width ``context_dim``) through SDPA."""

    def __init__(self, dim: int, *, heads: int, head_dim: int, context_dim: int | None = None):
        super().__init__()
        self.heads, inner = heads, heads * head_dim
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(context_dim or dim, inner)
        self.to_v = nn.Linear(context_dim or dim, inner)
        self.to_out = nn.Linear(inner, dim)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None,
                key_mask: torch.Tensor | None = None) -> torch.Tensor:
        kv = x if context is None else context
        b, n, _ = x.shape
        q, k, v = (p(s).reshape(b, s.shape[1], self.heads, -1).transpose(1, 2)
                   for p, s in ((self.to_q, x), (self.to_k, kv), (self.to_v, kv)))
        mask = key_mask[:, None, None, :] if key_mask is not None else None
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))


class TransformerBlock(nn.Module):
    """GR00T's ``BasicTransformerBlock``: (Ada)LayerNorm → attention → residual, LayerNorm → GELU MLP → residual.

    ``ada=True`` (DiT blocks): norm1 is modulated by the timestep embedding; ``context_dim`` set: the attention
    is cross-attention to the VLM tokens."""

    def __init__(self, dim: int, *, heads: int, head_dim: int, ada: bool, context_dim: int | None = None):
        super().__init__()
        self.ada = ada
        self.norm1 = AdaLayerNorm(dim) if ada else nn.LayerNorm(dim)
        self.attn1 = Attention(dim, heads=heads, head_dim=head_dim, context_dim=context_dim)
        self.norm3 = nn.LayerNorm(dim, elementwise_affine=not ada)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, temb: torch.Tensor | None = None, context: torch.Tensor | None = None,
                key_mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.norm1(x, temb) if self.ada else self.norm1(x)
        x = x + self.attn1(h, context, key_mask)
        return x + self.ff(self.norm3(x))


class DiT(nn.Module):
    """Diffusion transformer over [state, future, action] tokens; even blocks cross-attend to the VLM tokens,
    odd blocks self-attend (GR00T's ``interleave_self_attention``). Output: AdaLN-modulated norm → ``out_dim``."""

    def __init__(self, a: GrootArch):
        super().__init__()
        d = a.dit_dim
        self.timestep_encoder = TimestepEncoder(d)
        self.transformer_blocks = nn.ModuleList(
            TransformerBlock(d, heads=a.dit_heads, head_dim=a.dit_head_dim, ada=True,
                             context_dim=a.lm_hidden if i % 2 == 0 else None)
            for i in range(a.dit_layers))
        self.norm_out = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.proj_out_1 = nn.Linear(d, 2 * d)
        self.proj_out_2 = nn.Linear(d, a.hidden)
        self.checkpointing = False

    def forward(self, x: torch.Tensor, context: torch.Tensor, context_mask: torch.Tensor,
                timesteps: torch.Tensor) -> torch.Tensor:
        temb = self.timestep_encoder(timesteps).to(x.dtype)
        for i, block in enumerate(self.transformer_blocks):
            args = (x, temb, context, context_mask) if i % 2 == 0 else (x, temb)
            x = _run(block, args, self.checkpointing)
        shift, scale = self.proj_out_1(F.silu(temb)).chunk(2, dim=-1)
        return self.proj_out_2(self.norm_out(x) * (1 + scale[:, None]) + shift[:, None])


def _run(block: nn.Module, args: tuple, recompute: bool) -> torch.Tensor:
    if recompute and torch.is_grad_enabled():
        return checkpoint(block, *args, use_reentrant=False)
    return block(*args)


class FlowMatchingActionHead(nn.Module):
    """VLM tokens + state + noisy action chunk + timestep → predicted velocity over the chunk (max_action_dim)."""

    def __init__(self, a: GrootArch):
        super().__init__()
        self.arch = a
        self.vlln = nn.LayerNorm(a.lm_hidden)
        self.vl_self_attention = nn.ModuleList(
            TransformerBlock(a.lm_hidden, heads=a.vl_heads, head_dim=a.lm_hidden // a.vl_heads, ada=False)
            for _ in range(a.vl_layers))
        self.state_encoder = CategorySpecificMLP(a.num_embodiments, a.max_state_dim, a.hidden, a.dit_dim)
        self.action_encoder = MultiEmbodimentActionEncoder(a.max_action_dim, a.dit_dim, a.num_embodiments)
        self.future_tokens = nn.Embedding(a.future_tokens, a.dit_dim)
        self.position_embedding = nn.Embedding(a.chunk_size, a.dit_dim)
        self.model = DiT(a)
        self.action_decoder = CategorySpecificMLP(a.num_embodiments, a.hidden, a.hidden, a.max_action_dim)
        for emb in (self.future_tokens, self.position_embedding):
            nn.init.normal_(emb.weight, std=0.02)
        self.checkpointing = False

    def blocks(self) -> list[nn.Module]:
        return [*self.vl_self_attention, *self.model.transformer_blocks]

    def set_checkpointing(self, on: bool) -> None:
        self.checkpointing = self.model.checkpointing = on

    def encode_context(self, vl: torch.Tensor, vl_mask: torch.Tensor) -> torch.Tensor:
        """LayerNorm + self-attention over the VLM tokens (once per sample; reused by every Euler step)."""
        x = self.vlln(vl)
        for block in self.vl_self_attention:
            x = _run(block, (x, None, None, vl_mask), self.checkpointing)
        return x

    def forward(self, context: torch.Tensor, context_mask: torch.Tensor, state: torch.Tensor, x_t: torch.Tensor,
                timesteps: torch.Tensor, embodiment: torch.Tensor) -> torch.Tensor:
        """Velocity prediction (B, T, max_action_dim); ``timesteps``: GR00T's discretised t ∈ [0, buckets)."""
        b, horizon = x_t.shape[:2]
        s = self.state_encoder(state[:, None].to(context.dtype), embodiment)
        act = self.action_encoder(x_t.to(context.dtype), timesteps, embodiment)
        act = act + self.position_embedding.weight[:horizon].to(act.dtype)
        future = self.future_tokens.weight.to(act.dtype)[None].expand(b, -1, -1)
        h = self.model(torch.cat([s, future, act], dim=1), context, context_mask, timesteps)
        return self.action_decoder(h[:, -horizon:], embodiment)
