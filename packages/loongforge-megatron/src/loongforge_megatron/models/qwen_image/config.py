"""Qwen-Image's own recipe keys: the architecture beyond the shared ones in ``model``; the latent image shape, the
text length and the reference images of the Edit variant in ``data`` (with the flow-matching values)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, PositiveInt

from loongforge_megatron.config import ModelConfig
from loongforge_megatron.models.flow_matching import FlowMatchingData


class QwenImageModelConfig(ModelConfig):
    """``model`` of a Qwen-Image model: an HF directory is a diffusers ``QwenImageTransformer2DModel`` folder (a
    pipeline's ``transformer``); the shared architecture keys (num_layers, hidden_size, num_attention_heads,
    ffn_hidden_size) plus the ones below."""

    not_arch: ClassVar[tuple[str, ...]] = ("cp_comm_type",)

    cp_comm_type: Literal["p2p", "a2a"] = Field(
        "p2p", description="context parallelism's joint attention (megatron-core's names): p2p (ring: the image "
        "keys / values passed around the CP group, the text on every rank; any head count) or a2a (Ulysses: an "
        "all-to-all trades the image tokens' split for a head split, so heads must divide by tp x cp)")
    patch_size: int | None = Field(None, ge=1)
    in_channels: int | None = Field(None, ge=1, description="packed patch channels (latent channels x patch^2)")
    out_channels: int | None = Field(None, ge=1)
    joint_attention_dim: int | None = Field(None, ge=1, description="width of the text encoder's hidden states")
    axes_dims_rope: tuple[int, int, int] | None = None
    zero_cond_t: bool | None = None


class QwenImageDataConfig(FlowMatchingData):
    """``data`` of a Qwen-Image model: format ``synthetic``: seeded latent images with matching text-encoder hidden
    states (each prompt its own length, padding masked), for tests and benchmarks; format ``latent_cache``: the
    images ``loongforge data prepare`` encoded into ``data.path`` from ``data.images``."""

    formats_without_path: ClassVar[tuple[str, ...]] = ("synthetic",)

    format: str = Field("synthetic", description="synthetic | latent_cache")
    images: str | None = Field(None, description="data prepare: a folder of images (*.png / *.jpg / *.jpeg / "
                               "*.webp, sides multiples of 16 pixels), each with its caption in <image>.txt")
    autoencoder: str | None = Field(None, description="data prepare: a diffusers AutoencoderKLQwenImage folder (a "
                                    "pipeline's vae) that encodes the images")
    text_encoder: str | None = Field(None, description="data prepare: a transformers Qwen2.5-VL folder with its "
                                     "tokenizer (a pipeline's text_encoder + tokenizer in one folder), which encodes "
                                     "the captions as QwenImagePipeline does")
    height: int = Field(128, ge=1, description="latent rows per image (pixels / 8)")
    width: int = Field(128, ge=1, description="latent columns per image")
    text_length: int = Field(64, ge=1, description="text tokens per sample (padded; the mask marks the prompt's)")
    packed_sizes: list[tuple[PositiveInt, PositiveInt]] = Field(
        default_factory=list, description="variable-size samples: each sample draws its latent (height, width) from "
        "this list (instead of height / width) and a micro-batch's images are packed into one sequence, each "
        "attending only its own text and image")
    reference_images: int = Field(0, ge=0, le=4, description="Edit: clean reference images (same size) whose "
                                  "patches follow the noisy image's")
