"""HF <-> megatron-core checkpoint conversion (offline layout, online per-rank sharding, HF export).

Families (config translation + name map): llama (Llama 2/3.x, Mistral, Qwen2/2.5), qwen3, qwen3_moe,
deepseek_v3, llava, dit (diffusers DiTTransformer2DModel). Parameter names follow megatron-core's local
(non-TransformerEngine) layer specs.
"""

from __future__ import annotations

from loongforge_megatron.conversion.convert import hf_to_megatron, megatron_to_hf, reshard
from loongforge_megatron.conversion.families import FAMILIES, get_family
from loongforge_megatron.conversion.layout import MegatronLayout
from loongforge_megatron.conversion.online import gather_to_hf, gather_to_hf_dir, shard_state_dict_for_rank

__all__ = [
    "FAMILIES", "MegatronLayout", "gather_to_hf", "gather_to_hf_dir", "get_family", "hf_to_megatron",
    "megatron_to_hf", "reshard", "shard_state_dict_for_rank",
]
