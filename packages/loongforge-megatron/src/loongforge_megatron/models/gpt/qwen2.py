"""Qwen2 / 2.5: Llama's layout with q/k/v biases (and no o_proj bias); an optional sliding window
(``use_sliding_window``) that the export writes back as read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loongforge.checkpoint import NameMap
from loongforge.errors import CheckpointError

from loongforge_megatron.models.gpt import names
from loongforge_megatron.models.gpt.arch import Arch
from loongforge_megatron.models.gpt.family import GPTFamily

_QWEN25 = dict(family="qwen2", vocab_size=151936, rope_theta=1000000.0, norm_eps=1e-6, qkv_bias=True, max_position_embeddings=32768)

PRESETS: dict[str, dict[str, Any]] = {
    "qwen2-7b": dict(_QWEN25, vocab_size=152064, num_layers=28, hidden_size=3584, ffn_hidden_size=18944, num_attention_heads=28, num_query_groups=4),
    "qwen2.5-0.5b": dict(_QWEN25, num_layers=24, hidden_size=896, ffn_hidden_size=4864, num_attention_heads=14, num_query_groups=2, tie_embeddings=True),
    "qwen2.5-1.5b": dict(_QWEN25, num_layers=28, hidden_size=1536, ffn_hidden_size=8960, num_attention_heads=12, num_query_groups=2, tie_embeddings=True),
    "qwen2.5-7b": dict(_QWEN25, vocab_size=152064, num_layers=28, hidden_size=3584, ffn_hidden_size=18944, num_attention_heads=28, num_query_groups=4),
    "qwen2.5-14b": dict(_QWEN25, vocab_size=152064, num_layers=48, hidden_size=5120, ffn_hidden_size=13824, num_attention_heads=40, num_query_groups=8),
    "qwen2.5-32b": dict(_QWEN25, vocab_size=152064, num_layers=64, hidden_size=5120, ffn_hidden_size=27648, num_attention_heads=40, num_query_groups=8),
    "qwen2.5-72b": dict(_QWEN25, vocab_size=152064, num_layers=80, hidden_size=8192, ffn_hidden_size=29568, num_attention_heads=64, num_query_groups=8),
    "qwen2-tiny": dict(_QWEN25, vocab_size=512, num_layers=4, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4, num_query_groups=2, max_position_embeddings=256),
}


def write_window(arch: Arch, cfg: dict) -> dict:
    """A Qwen's sliding window, written back as read (HF's defaults would be use_sliding_window false, or another
    max_window_layers)."""
    if arch.sliding_window:
        cfg.update(use_sliding_window=True, sliding_window=arch.sliding_window)
        if arch.max_window_layers is not None:
            cfg["max_window_layers"] = arch.max_window_layers
    return cfg


class Qwen2(GPTFamily):
    """``Qwen2ForCausalLM``."""

    name = "qwen2"
    model_types = ("qwen2",)
    presets = PRESETS
    hf_architecture = "Qwen2ForCausalLM"

    def read_hf(self, cfg: dict, fields: dict[str, Any], *, path: Path) -> dict[str, Any]:
        fields["qkv_bias"] = True
        return fields

    def write_hf(self, arch: Arch, cfg: dict) -> dict:
        return write_window(arch, cfg)

    def name_map(self, cfg: dict, *, divisible_by: int = 128) -> NameMap:
        if cfg.get("mlp_bias"):
            raise CheckpointError("qwen2: mlp_bias is not supported")
        return names.decoder(cfg, divisible_by=divisible_by, qkv_bias=True)

    def check_family(self, recipe: Any, plan: Any, arch: Arch) -> None:
        """Qwen2's HF layout biases exactly q / k / v: any qkv_bias setting has one."""


SPEC = Qwen2()
