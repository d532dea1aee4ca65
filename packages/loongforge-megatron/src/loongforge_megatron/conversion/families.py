"""Model-family registry: HF ``model_type`` -> Family (config translation + name map)."""

from __future__ import annotations

from loongforge.errors import CheckpointError

from loongforge_megatron.conversion import deepseek_v3, dit, llama, llava, qwen3, qwen3_moe
from loongforge_megatron.conversion.common import Family, HFConfig

FAMILIES: dict[str, Family] = {f.name: f for f in (llama.FAMILY, qwen3.FAMILY, qwen3_moe.FAMILY, deepseek_v3.FAMILY,
                                                   llava.FAMILY, dit.FAMILY)}


def get_family(name: str | None = None, *, hf_config: HFConfig | None = None) -> Family:
    """The family by name, or detected from ``hf_config['model_type']`` (a diffusers config's ``_class_name``)
    when ``name`` is None."""
    if name is None:
        model_type = (hf_config or {}).get("model_type") or (hf_config or {}).get("_class_name")
        for fam in FAMILIES.values():
            if model_type in fam.model_types:
                return fam
        known = sorted(t for f in FAMILIES.values() for t in f.model_types)
        raise CheckpointError(f"config.json model_type '{model_type}' is not supported; known: {', '.join(known)}")
    if name not in FAMILIES:
        raise CheckpointError(f"unknown model family '{name}'; known: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[name]
