"""A hybrid LM's own ``model`` keys: the gated DeltaNet heads and the per-layer pattern (override a preset / HF
config like every architecture key)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from loongforge_megatron.config import ModelConfig


class HybridModelConfig(ModelConfig):
    """``model`` of a gated-DeltaNet hybrid LM."""

    layer_types: list[Literal["linear_attention", "full_attention"]] | None = Field(
        None, description="each layer's token mixer (the HF config's layer_types)")
    full_attention_interval: int | None = Field(None, ge=1, description="with layer_types unset: every n-th layer "
                                                "is full attention, the others gated DeltaNet")
    linear_num_key_heads: int | None = Field(None, ge=1, description="gated DeltaNet query / key heads")
    linear_num_value_heads: int | None = Field(None, ge=1, description="gated DeltaNet value heads (a multiple of "
                                               "the key heads)")
    linear_key_head_dim: int | None = Field(None, ge=1)
    linear_value_head_dim: int | None = Field(None, ge=1)
    linear_conv_kernel_dim: int | None = Field(None, ge=1, description="width of the DeltaNet's short causal "
                                               "convolution")
    moe_shared_expert_ffn: int | None = Field(None, ge=1, description="the gated shared expert's intermediate size")
