"""Qwen3-MoE: Qwen3 attention + router and routed experts (no shared experts); ``mlp_only_layers`` and
``decoder_sparse_step`` keep some layers dense."""

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
    routed_experts,
)


def num_experts(h: HFConfig) -> int:
    # NOTE: hub configs say num_experts; transformers 5 saves it as num_local_experts.
    return h.get("num_experts", h.get("num_local_experts", 0))


def is_moe_layer(h: HFConfig, layer: int) -> bool:
    step = h.get("decoder_sparse_step", 1) or 1
    return num_experts(h) > 0 and layer not in (h.get("mlp_only_layers") or []) and (layer + 1) % step == 0


def name_map(h: HFConfig, *, divisible_by: int = 128) -> NameMap:
    first, last = ends(h, divisible_by=divisible_by)

    def moe(i: int) -> bool:
        return is_moe_layer(h, i)

    def dense(i: int) -> bool:
        return not is_moe_layer(h, i)

    body = norms() + gqa_attention(h, qk_norm=True) + dense_mlp(layers=dense)
    return NameMap(first + body + routed_experts(num_experts(h), layers=moe) + last)


def megatron_config(h: HFConfig) -> dict:
    cfg = base_megatron_config(h)
    t = cfg["transformer"]
    t["qk_layernorm"] = True
    t["num_moe_experts"] = num_experts(h)
    t["moe_router_topk"] = h["num_experts_per_tok"]
    t["moe_ffn_hidden_size"] = h["moe_intermediate_size"]
    t["moe_router_topk_scaling_factor"] = None
    t["moe_router_load_balancing_type"] = "aux_loss"
    t["moe_aux_loss_coeff"] = h.get("router_aux_loss_coef", 0.001)
    t["moe_layer_freq"] = [int(is_moe_layer(h, i)) for i in range(h["num_hidden_layers"])]
    # NOTE: HF norm_topk_prob=True (softmax, top-k, renormalise) equals megatron's top-k-then-softmax.
    t["moe_router_pre_softmax"] = not h.get("norm_topk_prob", True)
    return cfg


FAMILY = Family("qwen3_moe", ("qwen3_moe",), name_map, megatron_config, num_experts=num_experts)
