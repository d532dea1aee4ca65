"""Qwen3 dense: Llama layout + per-head q/k RMSNorm (``q_norm``/``k_norm`` -> ``q_layernorm``/``k_layernorm``)."""

from __future__ import annotations

from loongforge.checkpoint import NameMap

from loongforge_megatron.conversion.common import (
    Family,
    HFConfig,
    base_megatron_config,
    dense_mlp,
    ends,
    gqa_attention,
    norms,
)


def name_map(h: HFConfig, *, divisible_by: int = 128) -> NameMap:
    first, last = ends(h, divisible_by=divisible_by)
    return NameMap(first + norms() + gqa_attention(h, qk_norm=True) + dense_mlp() + last)


def megatron_config(h: HFConfig) -> dict:
    cfg = base_megatron_config(h)
    cfg["transformer"]["qk_layernorm"] = True
    return cfg


FAMILY = Family("qwen3", ("qwen3",), name_map, megatron_config)
