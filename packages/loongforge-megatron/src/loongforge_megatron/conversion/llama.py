"""Llama 2/3/3.1/3.2 (and Mistral); Qwen2/2.5 = Llama + q/k/v biases."""

from __future__ import annotations

from loongforge.checkpoint import NameMap
from loongforge.errors import CheckpointError

from loongforge_megatron.conversion.common import (
    Family,
    HFConfig,
    base_megatron_config,
    dense_mlp,
    ends,
    gqa_attention,
    norms,
)


def _qkv_bias(h: HFConfig) -> bool:
    if h.get("mlp_bias") or (h.get("attention_bias") and h.get("model_type") != "qwen2"):
        raise CheckpointError("llama: attention_bias/mlp_bias on o_proj or the MLP are not supported")
    return h.get("model_type") == "qwen2"


def name_map(h: HFConfig, *, divisible_by: int = 128) -> NameMap:
    first, last = ends(h, divisible_by=divisible_by)
    return NameMap(first + norms() + gqa_attention(h, qkv_bias=_qkv_bias(h)) + dense_mlp() + last)


def megatron_config(h: HFConfig) -> dict:
    cfg = base_megatron_config(h)
    cfg["transformer"]["add_qkv_bias"] = _qkv_bias(h)
    return cfg


FAMILY = Family("llama", ("llama", "mistral", "qwen2"), name_map, megatron_config)
