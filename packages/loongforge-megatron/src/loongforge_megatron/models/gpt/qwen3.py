"""Qwen3 dense: Llama's layout + per-head q/k RMSNorm (``q_norm``/``k_norm`` -> ``q_layernorm``/``k_layernorm``),
optional ``attention_bias`` (which also biases o_proj)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loongforge.checkpoint import NameMap

from loongforge_megatron.models.gpt import names
from loongforge_megatron.models.gpt.arch import Arch
from loongforge_megatron.models.gpt.family import GPTFamily
from loongforge_megatron.models.gpt.qwen2 import write_window

QWEN3 = dict(family="qwen3", vocab_size=151936, rope_theta=1000000.0, norm_eps=1e-6, qk_norm=True, head_dim=128, max_position_embeddings=40960)

PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(QWEN3, num_layers=28, hidden_size=1024, ffn_hidden_size=3072, num_attention_heads=16, num_query_groups=8, tie_embeddings=True),
    "qwen3-1.7b": dict(QWEN3, num_layers=28, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=16, num_query_groups=8, tie_embeddings=True),
    "qwen3-4b": dict(QWEN3, num_layers=36, hidden_size=2560, ffn_hidden_size=9728, num_attention_heads=32, num_query_groups=8, tie_embeddings=True),
    "qwen3-8b": dict(QWEN3, num_layers=36, hidden_size=4096, ffn_hidden_size=12288, num_attention_heads=32, num_query_groups=8),
    "qwen3-14b": dict(QWEN3, num_layers=40, hidden_size=5120, ffn_hidden_size=17408, num_attention_heads=40, num_query_groups=8),
    "qwen3-32b": dict(QWEN3, num_layers=64, hidden_size=5120, ffn_hidden_size=25600, num_attention_heads=64, num_query_groups=8),
    "qwen3-tiny": dict(QWEN3, vocab_size=512, num_layers=4, hidden_size=64, head_dim=16, ffn_hidden_size=176, num_attention_heads=4, num_query_groups=2, max_position_embeddings=256),
}


class Qwen3(GPTFamily):
    """``Qwen3ForCausalLM``."""

    name = "qwen3"
    model_types = ("qwen3",)
    presets = PRESETS
    hf_architecture = "Qwen3ForCausalLM"

    def read_hf(self, cfg: dict, fields: dict[str, Any], *, path: Path) -> dict[str, Any]:
        fields.update(qk_norm=True, qkv_bias=bool(cfg.get("attention_bias", False)))
        return fields

    def write_hf(self, arch: Arch, cfg: dict) -> dict:
        cfg["attention_bias"] = arch.qkv_bias
        return write_window(arch, cfg)

    def name_map(self, cfg: dict, *, divisible_by: int = 128) -> NameMap:
        return names.decoder(cfg, divisible_by=divisible_by, qk_norm=True)


SPEC = Qwen3()
