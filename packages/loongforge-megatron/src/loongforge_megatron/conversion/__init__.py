"""HF <-> megatron-core checkpoint conversion (offline layout, online per-rank sharding, HF export).

The name maps are the model families' (``models/``, found through the ``loongforge.megatron.models`` registry).
Parameter names follow megatron-core's local (non-TransformerEngine) layer specs.
"""

from __future__ import annotations

from loongforge_megatron.conversion.convert import hf_to_megatron, megatron_to_hf, reshard
from loongforge_megatron.conversion.layout import MegatronLayout
from loongforge_megatron.conversion.online import gather_to_hf, gather_to_hf_dir, shard_state_dict_for_rank
from loongforge_megatron.models.registry import get_family

__all__ = [
    "MegatronLayout", "gather_to_hf", "gather_to_hf_dir", "get_family", "hf_to_megatron",
    "megatron_to_hf", "reshard", "shard_state_dict_for_rank",
]
