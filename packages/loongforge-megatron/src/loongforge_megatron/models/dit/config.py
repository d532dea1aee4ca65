"""A DiT's own recipe keys: the latent / patch architecture and the VAE in ``model``, the image side and the
label dropout in ``data``."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from loongforge_megatron.config import DataConfig, ModelConfig


class DiTModelConfig(ModelConfig):
    """``model`` of a DiT: an HF directory is a diffusers ``DiTTransformer2DModel`` folder; the architecture keys
    shared with LMs (num_layers, hidden_size, num_attention_heads, norm_eps) plus the ones below."""

    not_arch: ClassVar[tuple[str, ...]] = ("vae",)

    vae: str | None = Field(None, description="diffusers AutoencoderKL directory that encodes data.path's images")
    patch_size: int | None = Field(None, ge=1)
    sample_size: int | None = Field(None, ge=1, description="latent side (image side / 8)")
    in_channels: int | None = Field(None, ge=1, description="latent channels")
    learn_sigma: bool | None = Field(None, description="also predict the variance (out_channels = 2 x in)")
    num_classes: int | None = Field(None, ge=1)


class DiTDataConfig(DataConfig):
    """``data`` of a DiT: format ``latents``: synthetic latents without ``path``; with it an image folder, one
    sub-folder per class, encoded by ``model.vae``."""

    formats_without_path: ClassVar[tuple[str, ...]] = ("synthetic", "latents")

    format: str = Field("latents", description="latents")
    image_size: int | None = Field(None, ge=8, description="image side in pixels (default: 8 x model.sample_size)")
    class_dropout: float | None = Field(None, ge=0, lt=1, description="probability that a label is replaced by the "
                                        "null class, for classifier-free guidance (default 0.1)")
