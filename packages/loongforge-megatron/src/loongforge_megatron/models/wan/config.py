"""Wan's own recipe keys: the architecture beyond the shared ones in ``model``; the latent video shape, the text /
image token counts, the flow-matching values and the two-expert switch in ``data``."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, PositiveInt, model_validator

from loongforge_megatron.config import ModelConfig
from loongforge_megatron.models.flow_matching import FlowMatchingData


class WanModelConfig(ModelConfig):
    """``model`` of a Wan model: an HF directory is a diffusers ``WanTransformer3DModel`` folder (a pipeline's
    ``transformer`` / ``transformer_2``); the shared architecture keys (num_layers, hidden_size,
    num_attention_heads, ffn_hidden_size, norm_eps) plus the ones below."""

    not_arch: ClassVar[tuple[str, ...]] = ("cp_comm_type",)

    cp_comm_type: Literal["a2a", "p2p"] = Field(
        "a2a", description="context parallelism's self-attention (megatron-core's names): a2a (Ulysses: all-to-all "
        "of tokens for heads; heads must split over tp x cp) or p2p (ring: keys / values passed around the CP group; "
        "any head count)")
    patch_size: tuple[int, int, int] | None = Field(None, description="latent patch (frames, height, width)")
    in_channels: int | None = Field(None, ge=1, description="input channels (noisy latent + an I2V condition)")
    out_channels: int | None = Field(None, ge=1)
    text_dim: int | None = Field(None, ge=1, description="width of the text embeddings (UMT5-XXL: 4096)")
    freq_dim: int | None = Field(None, ge=2)
    image_dim: int | None = Field(None, ge=1, description="width of the image-encoder tokens (Wan2.1 I2V)")
    added_kv_proj_dim: int | None = Field(None, ge=1)
    pos_embed_seq_len: int | None = Field(None, ge=1)
    cross_attn_norm: bool | None = None
    rope_max_seq_len: int | None = Field(None, ge=1)


class WanDataConfig(FlowMatchingData):
    """``data`` of a Wan model: format ``synthetic``: seeded latent videos with matching text embeddings (and
    image tokens / condition channels where the model takes them), for tests and benchmarks; ``latent_cache``: the
    clips ``loongforge data prepare`` encoded into ``data.path`` from ``data.frames`` (with an image-to-video model's
    first-frame condition and image tokens)."""

    formats_without_path: ClassVar[tuple[str, ...]] = ("synthetic",)

    format: str = Field("synthetic", description="synthetic | latent_cache")
    frames: str | None = Field(None, description="data prepare: a folder with one sub-folder per clip, its frames "
                               "as *.png (name order, one size, 1 + 4k of them) and its caption.txt")
    autoencoder: str | None = Field(None, description="data prepare: a diffusers AutoencoderKLWan folder (a "
                                    "pipeline's autoencoder) that encodes the frames")
    text_encoder: str | None = Field(None, description="data prepare: a transformers UMT5 / T5 encoder folder with "
                                     "its tokenizer, which encodes the captions")
    image_encoder: str | None = Field(None, description="data prepare of an image-to-video model with image tokens "
                                      "(Wan2.1 I2V): a transformers CLIPVisionModel folder with its image processor, "
                                      "which encodes each clip's first frame")
    latent_frames: int = Field(21, ge=1, description="latent frames per sample ((video frames - 1) / 4 + 1: 81 -> 21)")
    latent_height: int = Field(60, ge=1, description="latent rows (pixels / 8; Wan2.2 TI2V-5B: / 16)")
    latent_width: int = Field(104, ge=1, description="latent columns")
    text_length: int = Field(512, ge=1, description="text tokens per sample (Wan pads prompts to 512)")
    packed_frames: list[PositiveInt] = Field(
        default_factory=list, description="variable-length samples: each sample draws its latent frame count from "
        "this list (instead of latent_frames) and a micro-batch's samples are packed into one sequence (cu_seqlens "
        "over their video tokens, RoPE per sample)")
    image_tokens: int = Field(257, ge=1, description="image-encoder tokens per sample (models with image_dim)")
    first_frame_clean: float = Field(
        0.0, ge=0, le=1, description="image-to-video training of a model without condition channels (Wan2.2 "
        "TI2V-5B, its pipeline's expand_timesteps): with this probability a sample's first latent frame stays clean, "
        "its tokens get timestep 0 and the loss leaves them out")
    expert: Literal["high_noise", "low_noise"] | None = Field(
        None, description="train one expert of a two-expert (A14B) model on its timesteps: high_noise at or above "
        "boundary_ratio x 1000, low_noise below")
    boundary_ratio: float | None = Field(None, gt=0, lt=1, description="the switch between the experts "
                                         "(model_index.json; T2V-A14B 0.875, I2V-A14B 0.9)")

    @model_validator(mode="after")
    def _expert_needs_boundary(self) -> WanDataConfig:
        if (self.expert is None) != (self.boundary_ratio is None):
            raise ValueError("data.expert and data.boundary_ratio come together (the expert trains on its side of "
                             "the boundary)")
        return self
