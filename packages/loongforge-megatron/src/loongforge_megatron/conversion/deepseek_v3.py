"""DeepSeek-V3 (and V2-style MLA): multi-latent attention, ``first_k_dense_replace`` dense layers, then MoE
layers with a sigmoid router carrying ``e_score_correction_bias`` and shared experts."""

from __future__ import annotations

import re

from loongforge.checkpoint import Entry, GatedMLP, NameMap, RowParallel

from loongforge_megatron.conversion.common import (
    Family,
    H,
    HFConfig,
    L,
    base_megatron_config,
    column,
    dense_mlp,
    ends,
    norms,
    replicated,
    routed_experts,
)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def is_moe_layer(h: HFConfig, layer: int) -> bool:
    freq = h.get("moe_layer_freq", 1) or 1
    return h["n_routed_experts"] > 0 and layer >= h.get("first_k_dense_replace", 0) and layer % freq == 0


def mla_attention(h: HFConfig) -> list[Entry]:
    """MLA projections: all column-parallel in the local spec (down projections are gathered after the matmul)."""
    a = "self_attention."
    out = []
    if h.get("q_lora_rank") is None:
        out.append(column(a + "linear_q_proj.weight", "self_attn.q_proj.weight"))
    else:
        out += [
            column(a + "linear_q_down_proj.weight", "self_attn.q_a_proj.weight"),
            replicated(a + "q_layernorm.weight", "self_attn.q_a_layernorm.weight"),
            column(a + "linear_q_up_proj.weight", "self_attn.q_b_proj.weight"),
        ]
    out += [
        column(a + "linear_kv_down_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"),
        replicated(a + "kv_layernorm.weight", "self_attn.kv_a_layernorm.weight"),
        column(a + "linear_kv_up_proj.weight", "self_attn.kv_b_proj.weight"),
        Entry(L + a + "linear_proj.weight", H + "self_attn.o_proj.weight", RowParallel()),
    ]
    return out


def name_map(h: HFConfig, *, divisible_by: int = 128) -> NameMap:
    first, last = ends(h, divisible_by=divisible_by)

    def moe(i: int) -> bool:
        return is_moe_layer(h, i)

    def dense(i: int) -> bool:
        return not is_moe_layer(h, i)

    shared = []
    if h.get("n_shared_experts"):
        s = "mlp.shared_experts."
        shared = [
            Entry(L + s + "linear_fc1.weight", {"gate": H + s + "gate_proj.weight", "up": H + s + "up_proj.weight"},
                  GatedMLP(), layers=moe),
            Entry(L + s + "linear_fc2.weight", H + s + "down_proj.weight", RowParallel(), layers=moe),
        ]
    experts = routed_experts(h["n_routed_experts"], layers=moe, router_bias="e_score_correction_bias")
    return NameMap(first + norms() + mla_attention(h) + dense_mlp(layers=dense) + experts + shared + last)


def megatron_config(h: HFConfig) -> dict:
    cfg = base_megatron_config(h)
    t = cfg["transformer"]
    t.pop("num_query_groups")
    t.pop("kv_channels")
    scaling = h.get("rope_scaling") or h.get("rope_parameters") or {}
    t.update(
        multi_latent_attention=True,
        q_lora_rank=h.get("q_lora_rank"),
        kv_lora_rank=h["kv_lora_rank"],
        qk_head_dim=h["qk_nope_head_dim"],
        qk_pos_emb_head_dim=h["qk_rope_head_dim"],
        v_head_dim=h["v_head_dim"],
        qk_layernorm=True,
        rope_type="yarn" if scaling.get("rope_type", scaling.get("type")) == "yarn" else "rope",
        num_moe_experts=h["n_routed_experts"],
        moe_router_topk=h["num_experts_per_tok"],
        moe_ffn_hidden_size=h["moe_intermediate_size"],
        moe_shared_expert_intermediate_size=h["moe_intermediate_size"] * (h.get("n_shared_experts") or 0) or None,
        moe_layer_freq=[int(is_moe_layer(h, i)) for i in range(h["num_hidden_layers"])],
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_pre_softmax=True,
        moe_router_topk_scaling_factor=h.get("routed_scaling_factor"),
        moe_router_num_groups=h.get("n_group"),
        moe_router_group_topk=h.get("topk_group"),
    )
    return cfg


def _ignore(h: HFConfig, name: str) -> bool:
    # NOTE: released DeepSeek-V3 checkpoints carry multi-token-prediction layers past num_hidden_layers.
    m = _LAYER.match(name)
    return "rotary_emb.inv_freq" in name or (m is not None and int(m.group(1)) >= h["num_hidden_layers"])


FAMILY = Family(
    "deepseek_v3", ("deepseek_v3", "deepseek_v2"), name_map, megatron_config,
    num_experts=lambda h: h["n_routed_experts"], ignore_hf=_ignore,
)
