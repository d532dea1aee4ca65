"""Llama 2 / 3 / 3.1 / 3.2: presets, HF config both ways (``attention_bias``), name map."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loongforge.checkpoint import NameMap
from loongforge.errors import CheckpointError

from loongforge_megatron.models.gpt import names
from loongforge_megatron.models.gpt.arch import Arch
from loongforge_megatron.models.gpt.family import GPTFamily

_LLAMA3 = dict(vocab_size=128256, rope_theta=500000.0, norm_eps=1e-5)

PRESETS: dict[str, dict[str, Any]] = {
    # Llama 2
    "llama2-7b": dict(num_layers=32, hidden_size=4096, ffn_hidden_size=11008, num_attention_heads=32, vocab_size=32000, max_position_embeddings=4096),
    "llama2-13b": dict(num_layers=40, hidden_size=5120, ffn_hidden_size=13824, num_attention_heads=40, vocab_size=32000, max_position_embeddings=4096),
    "llama2-70b": dict(num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64, num_query_groups=8, vocab_size=32000, max_position_embeddings=4096),
    # Llama 3 / 3.1 / 3.2
    "llama3-8b": dict(_LLAMA3, num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32, num_query_groups=8, max_position_embeddings=8192),
    "llama3-70b": dict(_LLAMA3, num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64, num_query_groups=8, max_position_embeddings=8192),
    "llama3.1-8b": dict(_LLAMA3, num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32, num_query_groups=8, max_position_embeddings=131072, rope_scaling_factor=8.0, rope_original_max_position=8192),
    "llama3.1-70b": dict(_LLAMA3, num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64, num_query_groups=8, max_position_embeddings=131072, rope_scaling_factor=8.0, rope_original_max_position=8192),
    "llama3.1-405b": dict(_LLAMA3, num_layers=126, hidden_size=16384, ffn_hidden_size=53248, num_attention_heads=128, num_query_groups=8, max_position_embeddings=131072, rope_scaling_factor=8.0, rope_original_max_position=8192),
    "llama3.2-1b": dict(_LLAMA3, num_layers=16, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=32, num_query_groups=8, head_dim=64, tie_embeddings=True, max_position_embeddings=131072, rope_scaling_factor=32.0, rope_original_max_position=8192),
    "llama3.2-3b": dict(_LLAMA3, num_layers=28, hidden_size=3072, ffn_hidden_size=8192, num_attention_heads=24, num_query_groups=8, head_dim=128, tie_embeddings=True, max_position_embeddings=131072, rope_scaling_factor=32.0, rope_original_max_position=8192),
    "llama-tiny": dict(num_layers=4, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4, num_query_groups=2, vocab_size=512, max_position_embeddings=256),
}


class Llama(GPTFamily):
    """``LlamaForCausalLM``."""

    name = "llama"
    model_types = ("llama",)
    presets = {k: {"family": "llama", **v} for k, v in PRESETS.items()}
    hf_architecture = "LlamaForCausalLM"

    def read_hf(self, cfg: dict, fields: dict[str, Any], *, path: Path) -> dict[str, Any]:
        fields["qkv_bias"] = bool(cfg.get("attention_bias", False))
        return fields

    def write_hf(self, arch: Arch, cfg: dict) -> dict:
        cfg.update(attention_bias=arch.qkv_bias, mlp_bias=False)
        return cfg

    def name_map(self, cfg: dict, *, divisible_by: int = 128) -> NameMap:
        if cfg.get("mlp_bias") or cfg.get("attention_bias"):
            raise CheckpointError(f"{self.name}: attention_bias/mlp_bias on o_proj or the MLP are not supported")
        return names.decoder(cfg, divisible_by=divisible_by)


SPEC = Llama()
