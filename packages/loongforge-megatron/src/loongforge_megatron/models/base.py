"""Defaults of the :class:`ModelSpec` HF-checkpoint hooks, for a family whose checkpoint is a plain decoder's."""

from __future__ import annotations

from typing import Any

from loongforge_megatron.models.spec import HFConfig


class HFCheckpoint:
    """A transformers checkpoint with ``model.safetensors``, no experts, nothing to ignore but rotary buffers."""

    hf_weights = "model"

    def complete_hf_config(self, cfg: HFConfig) -> HFConfig:
        return cfg

    def num_experts(self, cfg: HFConfig) -> int:
        return 0

    def text_config(self, cfg: HFConfig) -> HFConfig:
        """The language model's part of the config (a VLM nests it), for the layer count and the vocabulary."""
        return cfg

    def ignore_hf(self, cfg: HFConfig, name: str) -> bool:
        return "rotary_emb.inv_freq" in name

    def hf_alias(self, name: str) -> str:
        """A checkpoint's tensor name -> the name map's spelling."""
        return name

    def hf_extra(self, cfg: HFConfig) -> dict[str, Any]:
        """HF tensors an export adds that the megatron model has no parameter for."""
        return {}

    def export_config(self, cfg: HFConfig) -> HFConfig:
        """The config.json an HF export writes for a source config."""
        return cfg
