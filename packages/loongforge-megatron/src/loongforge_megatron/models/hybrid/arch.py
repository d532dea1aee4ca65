"""The architecture of a gated-DeltaNet hybrid LM: a decoder :class:`Arch` plus the DeltaNet heads and the per-layer
pattern (``layer_types``) of linear and full attention layers."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from loongforge_megatron.models.gpt.arch import Arch
from loongforge_megatron.models.hybrid.layers import LinearShape

LayerType = Literal["linear_attention", "full_attention"]


class HybridArch(Arch):
    """Decoder shape + gated DeltaNet layers. ``layer_types`` unset: every ``full_attention_interval``-th layer is
    full attention (the HF configs' default), the others linear."""

    layer_types: list[LayerType] | None = Field(None, description="each layer's token mixer (HF layer_types)")
    full_attention_interval: int = Field(4, ge=1, description="with layer_types unset: every n-th layer is full "
                                         "attention")
    linear_num_key_heads: int = Field(16, ge=1, description="gated DeltaNet query / key heads")
    linear_num_value_heads: int = Field(32, ge=1, description="gated DeltaNet value heads (a multiple of the key heads)")
    linear_key_head_dim: int = Field(128, ge=1)
    linear_value_head_dim: int = Field(128, ge=1)
    linear_conv_kernel_dim: int = Field(4, ge=1, description="width of the short causal convolution")

    @model_validator(mode="after")
    def _check_hybrid(self) -> HybridArch:
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                             f"linear_num_key_heads ({self.linear_num_key_heads})")
        if self.layer_types is not None and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        return self

    @property
    def layers(self) -> list[str]:
        """Each layer's token mixer."""
        if self.layer_types is not None:
            return list(self.layer_types)
        n = self.full_attention_interval
        return ["full_attention" if (i + 1) % n == 0 else "linear_attention" for i in range(self.num_layers)]

    @property
    def linear_shape(self) -> LinearShape:
        return LinearShape(key_heads=self.linear_num_key_heads, value_heads=self.linear_num_value_heads,
                           key_dim=self.linear_key_head_dim, value_dim=self.linear_value_head_dim,
                           conv_width=self.linear_conv_kernel_dim)

    def num_params(self) -> int:
        """Parameter count: the decoder's, with each linear layer's DeltaNet in place of its attention (and the
        full attention layers' output gate)."""
        h, s = self.hidden_size, self.linear_shape
        k, v = s.key_heads * s.key_dim, s.value_heads * s.value_dim
        gdn = h * (2 * k + 2 * v + 2 * s.value_heads) + (2 * k + v) * s.conv_width + 2 * s.value_heads + s.value_dim + v * h
        linear = self.layers.count("linear_attention")
        full = self.num_layers - linear
        gate = h * self.num_attention_heads * self.kv_channels
        return super().num_params() - linear * self._attn_params() + linear * gdn + full * gate
