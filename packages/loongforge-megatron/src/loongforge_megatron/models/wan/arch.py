"""The architecture of a Wan video diffusion transformer (Wan2.1 / Wan2.2), its published sizes, and its
translation to and from diffusers' ``WanTransformer3DModel`` config.json.

One :class:`WanArch` covers text-to-video (T2V), image-to-video with the image-encoder branch (Wan2.1 I2V: extra
key / value projections of the image tokens in every cross-attention) and without it (Wan2.2 I2V: the condition
latent enters through ``in_channels``), and Wan2.2's TI2V-5B (48 latent channels of its high-compression
autoencoder). The two-expert A14B models are two transformers of the same shape, switched by the timestep.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DIFFUSERS_CLASS = "WanTransformer3DModel"
QK_NORM = "rms_norm_across_heads"  # NOTE: the one query / key norm diffusers' WanAttention builds, whatever the key


class WanArch(BaseModel):
    """Wan shape: ``num_layers`` blocks of width ``hidden_size`` (self-attention with 3-D RoPE, cross-attention to
    the text, GELU-tanh MLP of ``ffn_hidden_size``, all modulated by the timestep) over 3-D latent patches."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    family: Literal["wan"] = "wan"
    num_layers: int = Field(ge=1)
    hidden_size: int = Field(ge=6)
    num_attention_heads: int = Field(ge=1)
    ffn_hidden_size: int = Field(ge=1)
    patch_size: tuple[int, int, int] = Field((1, 2, 2), description="latent patch (frames, height, width)")
    in_channels: int = Field(16, ge=1, description="input channels (noisy latent, plus the condition of I2V)")
    out_channels: int = Field(16, ge=1, description="predicted velocity channels")
    text_dim: int = Field(4096, ge=1, description="width of the text encoder's embeddings (UMT5-XXL: 4096)")
    freq_dim: int = Field(256, ge=2, description="sinusoidal timestep features")
    image_dim: int | None = Field(None, ge=1, description="width of the image encoder's tokens (Wan2.1 I2V: 1280)")
    added_kv_proj_dim: int | None = Field(None, ge=1, description="image-token key / value projections' input "
                                          "(Wan2.1 I2V: hidden_size)")
    pos_embed_seq_len: int | None = Field(None, ge=1, description="learned position embedding of the image "
                                          "tokens (first-last-frame models: 2 x 257)")
    cross_attn_norm: bool = Field(True, description="affine LayerNorm before the cross-attention")
    norm_eps: float = Field(1e-6, gt=0)
    rope_max_seq_len: int = Field(1024, ge=1, description="positions the 3-D RoPE tables hold per axis")
    rope_theta: float = Field(10000.0, gt=0)

    # what the backend asks every architecture
    is_moe = property(lambda self: False)
    num_experts = property(lambda self: None)
    spec_name = property(lambda self: "wan")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_heads(self) -> int:
        return self.num_attention_heads

    @property
    def has_image_branch(self) -> bool:
        return self.added_kv_proj_dim is not None

    @property
    def rope_dims(self) -> tuple[int, int, int]:
        """Head channels RoPE gives to frames, rows and columns (diffusers' split: h = w = 2 * (d // 6))."""
        hw = 2 * (self.head_dim // 6)
        return self.head_dim - 2 * hw, hw, hw

    @model_validator(mode="after")
    def _check(self) -> WanArch:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                             f"({self.num_attention_heads})")
        if self.head_dim % 2 or self.head_dim < 6:
            raise ValueError(f"head size {self.head_dim} must be even and at least 6 (3-D RoPE over frames, rows, "
                             "columns)")
        if (self.image_dim is None) != (self.added_kv_proj_dim is None):
            raise ValueError("image_dim and added_kv_proj_dim come together (the image-encoder branch of I2V)")
        if self.freq_dim % 2:
            raise ValueError(f"freq_dim ({self.freq_dim}) must be even (cos and sin halves)")
        return self

    def tokens(self, frames: int, height: int, width: int) -> int:
        """Patch tokens of a latent video of ``frames x height x width``."""
        pt, ph, pw = self.patch_size
        return (frames // pt) * (height // ph) * (width // pw)

    def num_params(self) -> int:
        """Parameter count (as diffusers' model holds it)."""
        h, f, p = self.hidden_size, self.ffn_hidden_size, math.prod(self.patch_size)
        attn = 4 * (h * h + h) + 2 * h
        cross = attn + (2 * (self.added_kv_proj_dim * h + h) + h if self.has_image_branch else 0)
        block = attn + cross + (h * f + f + f * h + h) + (2 * h if self.cross_attn_norm else 0) + 6 * h
        embed = self.in_channels * p * h + h + self.freq_dim * h + h + h * h + h + h * 6 * h + 6 * h
        embed += self.text_dim * h + h + h * h + h
        if self.image_dim is not None:
            d = self.image_dim
            embed += 2 * d + d * d + d + d * h + h + 2 * h + (self.pos_embed_seq_len or 0) * d
        final = h * self.out_channels * p + self.out_channels * p + 2 * h
        return self.num_layers * block + embed + final

    def flops_per_token(self, seq_length: int) -> float:
        """Training FLOPs per video token: 6 x parameters + 12 x layers x hidden x tokens (full self-attention;
        the cross-attention to a few hundred text tokens is left out)."""
        return 6.0 * self.num_params() + 12.0 * self.num_layers * self.hidden_size * seq_length


def check_diffusers_config(cfg: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming the first field of a Wan config.json that our Wan does not implement."""
    qk = cfg.get("qk_norm", QK_NORM)
    if qk != QK_NORM:
        raise ValueError(f"Wan config field qk_norm={qk!r} is not supported (supported: {QK_NORM!r})")
    patch = cfg.get("patch_size", (1, 2, 2))
    if not isinstance(patch, (list, tuple)) or len(patch) != 3:
        raise ValueError(f"Wan config field patch_size={patch!r} must be three sizes (frames, height, width)")


def arch_from_diffusers(cfg: dict[str, Any]) -> WanArch:
    """A :class:`WanArch` from a diffusers ``WanTransformer3DModel`` config (diffusers' defaults where absent)."""
    check_diffusers_config(cfg)
    heads, head_dim = cfg.get("num_attention_heads", 40), cfg.get("attention_head_dim", 128)
    inp = cfg.get("in_channels", 16)
    return WanArch(num_layers=cfg.get("num_layers", 40), hidden_size=heads * head_dim, num_attention_heads=heads,
                   ffn_hidden_size=cfg.get("ffn_dim", 13824), patch_size=tuple(cfg.get("patch_size", (1, 2, 2))),
                   in_channels=inp, out_channels=cfg.get("out_channels") or inp, text_dim=cfg.get("text_dim", 4096),
                   freq_dim=cfg.get("freq_dim", 256), image_dim=cfg.get("image_dim"),
                   added_kv_proj_dim=cfg.get("added_kv_proj_dim"), pos_embed_seq_len=cfg.get("pos_embed_seq_len"),
                   cross_attn_norm=cfg.get("cross_attn_norm", True), norm_eps=cfg.get("eps", 1e-6),
                   rope_max_seq_len=cfg.get("rope_max_seq_len", 1024))


def diffusers_config(arch: WanArch) -> dict[str, Any]:
    """The config.json of a diffusers ``WanTransformer3DModel`` with ``arch``'s shape (what an export writes)."""
    return {
        "_class_name": DIFFUSERS_CLASS,
        "patch_size": list(arch.patch_size),
        "num_attention_heads": arch.num_attention_heads,
        "attention_head_dim": arch.head_dim,
        "in_channels": arch.in_channels,
        "out_channels": arch.out_channels,
        "text_dim": arch.text_dim,
        "freq_dim": arch.freq_dim,
        "ffn_dim": arch.ffn_hidden_size,
        "num_layers": arch.num_layers,
        "cross_attn_norm": arch.cross_attn_norm,
        "qk_norm": QK_NORM,
        "eps": arch.norm_eps,
        "image_dim": arch.image_dim,
        "added_kv_proj_dim": arch.added_kv_proj_dim,
        "rope_max_seq_len": arch.rope_max_seq_len,
        "pos_embed_seq_len": arch.pos_embed_seq_len,
    }


_14B = dict(num_layers=40, hidden_size=5120, num_attention_heads=40, ffn_hidden_size=13824)

PRESETS: dict[str, dict[str, Any]] = {
    # Wan-AI/Wan2.1-T2V-1.3B-Diffusers
    "wan2.1-t2v-1.3b": dict(family="wan", num_layers=30, hidden_size=1536, num_attention_heads=12, ffn_hidden_size=8960),
    # Wan-AI/Wan2.1-T2V-14B-Diffusers
    "wan2.1-t2v-14b": dict(family="wan", **_14B),
    # Wan-AI/Wan2.1-I2V-14B-480P-Diffusers (noisy 16 + mask 4 + condition 16 channels; image-encoder tokens 1280 wide)
    "wan2.1-i2v-14b": dict(family="wan", **_14B, in_channels=36, image_dim=1280, added_kv_proj_dim=5120),
    # Wan-AI/Wan2.2-TI2V-5B-Diffusers (48 latent channels of Wan2.2's 16x16x4 autoencoder)
    "wan2.2-ti2v-5b": dict(family="wan", num_layers=30, hidden_size=3072, num_attention_heads=24, ffn_hidden_size=14336,
                           in_channels=48, out_channels=48),
    # Wan-AI/Wan2.2-T2V-A14B-Diffusers: each of the two experts (transformer / transformer_2)
    "wan2.2-t2v-a14b": dict(family="wan", **_14B),
    # Wan-AI/Wan2.2-I2V-A14B-Diffusers: each expert; the condition latent enters through in_channels, no image tokens
    "wan2.2-i2v-a14b": dict(family="wan", **_14B, in_channels=36),
    "wan-tiny": dict(family="wan", num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                     text_dim=32, freq_dim=32, rope_max_seq_len=64),
}

#: the published A14B pipelines' switch between experts (model_index.json ``boundary_ratio``): timesteps at or above
#: ratio x 1000 go to the high-noise expert
BOUNDARY_RATIO = {"wan2.2-t2v-a14b": 0.875, "wan2.2-i2v-a14b": 0.9}
