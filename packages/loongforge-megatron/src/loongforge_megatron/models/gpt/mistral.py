"""Mistral: a Llama with sliding-window attention (``sliding_window``), exported as ``MistralForCausalLM``.

A Mistral config without a window (``sliding_window: null``) is a Llama and is read as one (family llama).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loongforge_megatron.models.gpt.arch import Arch
from loongforge_megatron.models.gpt.llama import Llama

PRESETS: dict[str, dict[str, Any]] = {
    "mistral-7b": dict(family="mistral", num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                       num_query_groups=8, vocab_size=32000, max_position_embeddings=32768, rope_theta=10000.0,
                       sliding_window=4096),
}


class Mistral(Llama):
    """``MistralForCausalLM``: Llama's layout and name map, plus the window."""

    name = "mistral"
    model_types = ("mistral",)
    presets = PRESETS
    hf_architecture = "MistralForCausalLM"

    def read_hf(self, cfg: dict, fields: dict[str, Any], *, path: Path) -> dict[str, Any]:
        fields = super().read_hf(cfg, fields, path=path)
        # NOTE: Mistral applies a non-null sliding_window; without one it computes what a Llama does
        fields["sliding_window"] = cfg.get("sliding_window")
        if fields["sliding_window"] is None:
            fields["family"] = "llama"
        return fields

    def write_hf(self, arch: Arch, cfg: dict) -> dict:
        cfg = super().write_hf(arch, cfg)
        cfg["sliding_window"] = arch.sliding_window
        return cfg


SPEC = Mistral()
