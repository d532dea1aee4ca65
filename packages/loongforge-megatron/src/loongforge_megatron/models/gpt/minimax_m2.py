"""MiniMax-M2 (``MiniMaxM2ForCausalLM``): GQA attention whose q / k RMSNorms span the whole q / k projection (all
heads: ``layers/projection_norm.py``), RoPE on the leading ``rotary_dim`` dims of each head, and MoE in every layer
with a sigmoid router carrying ``e_score_correction_bias`` (DeepSeek-V3's aux-loss-free routing, one group, no
scaling, top-k normalised), no shared experts. Checkpoints keep Mixtral's names (``block_sparse_moe``, ``w1/w2/w3``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loongforge.checkpoint import Entry, Expert, GatedMLP, NameMap, Replicated, RowParallel
from loongforge.errors import RecipeError

from loongforge_megatron.models.gpt.arch import Arch
from loongforge_megatron.models.gpt.family import GPTFamily
from loongforge_megatron.models.gpt.glm4_moe import partial_rotary
from loongforge_megatron.models.gpt.names import (
    H,
    HFConfig,
    L,
    ends,
    experts,
    gqa_attention,
    hd,
    kv_heads,
    norms,
)

_M2 = dict(family="minimax_m2", qk_norm=True, norm_eps=1e-6, rope_theta=5000000.0, moe_score_function="sigmoid",
           moe_expert_bias=True)

PRESETS: dict[str, dict[str, Any]] = {
    # transformers' MiniMaxM2Config defaults (MiniMaxAI/MiniMax-M2); its released config.json rotates rotary_dim 64
    # of the 128 head dims
    "minimax-m2": dict(_M2, num_layers=62, hidden_size=3072, ffn_hidden_size=1536, num_attention_heads=48,
                       num_query_groups=8, head_dim=128, vocab_size=200064, max_position_embeddings=196608,
                       rotary_percent=0.5, num_experts=256, moe_topk=8, moe_ffn_hidden_size=1536),
    "minimax-m2-tiny": dict(_M2, num_layers=2, hidden_size=64, ffn_hidden_size=32, num_attention_heads=4,
                            num_query_groups=2, head_dim=16, vocab_size=512, max_position_embeddings=256,
                            rotary_percent=0.5, num_experts=4, moe_topk=2, moe_ffn_hidden_size=32),
}

_MOE = "block_sparse_moe."


def rotary_share(cfg: HFConfig) -> float:
    """The share of each head's dims RoPE rotates: the released configs' ``rotary_dim``, else transformers'
    ``partial_rotary_factor``."""
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["rotary_dim"] / head if cfg.get("rotary_dim") else partial_rotary(cfg)


def attention(cfg: HFConfig) -> list[Entry]:
    """GQA projections (fused QKV) and the whole-projection q / k norm weights, replicated on every TP rank."""
    a, hf = L + "self_attention.", H + "self_attn."
    return gqa_attention(cfg) + [
        Entry(a + "q_layernorm.weight", hf + "q_norm.weight", Replicated(),
              shape=lambda c: (c["num_attention_heads"] * hd(c),)),
        Entry(a + "k_layernorm.weight", hf + "k_norm.weight", Replicated(), shape=lambda c: (kv_heads(c) * hd(c),)),
    ]


def moe(num_experts: int) -> list[Entry]:
    """Router with its correction bias and the routed experts (Mixtral's ``w1`` gate, ``w3`` up, ``w2`` down)."""
    ex = L + "mlp.experts.local_experts.*."
    hf = H + _MOE + "experts.*."
    return [
        Entry(L + "mlp.router.weight", H + _MOE + "gate.weight", Replicated(),
              shape=lambda c: (experts(c), c["hidden_size"])),
        Entry(L + "mlp.router.expert_bias", H + _MOE + "e_score_correction_bias", Replicated(),
              shape=lambda c: (experts(c),)),
        Entry(ex + "linear_fc1.weight", {"gate": hf + "w1.weight", "up": hf + "w3.weight"},
              Expert(GatedMLP(), num_experts), shape=lambda c: (c["intermediate_size"], c["hidden_size"])),
        Entry(ex + "linear_fc2.weight", hf + "w2.weight", Expert(RowParallel(), num_experts),
              shape=lambda c: (c["hidden_size"], c["intermediate_size"])),
    ]


class MiniMaxM2(GPTFamily):
    """``MiniMaxM2ForCausalLM``."""

    name = "minimax_m2"
    model_types = ("minimax_m2",)
    presets = PRESETS
    hf_architecture = "MiniMaxM2ForCausalLM"

    def num_experts(self, cfg: HFConfig) -> int:
        return cfg.get("num_local_experts") or cfg.get("num_experts") or 0

    def read_hf(self, cfg: dict, fields: dict[str, Any], *, path: Path) -> dict[str, Any]:
        if cfg.get("use_qk_norm") is False or cfg.get("qk_norm_type", "per_layer") != "per_layer":
            raise RecipeError(f"{path}: MiniMax-M2 here normalises q / k over the whole projection (use_qk_norm true, "
                              f"qk_norm_type per_layer), got use_qk_norm {cfg.get('use_qk_norm')!r} qk_norm_type "
                              f"{cfg.get('qk_norm_type')!r}", key="model.hf")
        if cfg.get("shared_intermediate_size"):
            raise RecipeError(f"{path}: shared_intermediate_size {cfg['shared_intermediate_size']}: MiniMax-M2's "
                              "layout has no shared experts (only 0 is supported)", key="model.hf")
        fields.update(qk_norm=True, rotary_percent=rotary_share(cfg), num_experts=self.num_experts(cfg),
                      moe_topk=cfg["num_experts_per_tok"], moe_ffn_hidden_size=cfg["intermediate_size"],
                      moe_score_function="sigmoid", moe_expert_bias=True, moe_norm_topk=True)
        return fields

    def write_hf(self, arch: Arch, cfg: dict) -> dict:
        rotary = round(arch.rotary_percent * arch.kv_channels)
        cfg.update(intermediate_size=arch.moe_ffn_hidden_size, num_local_experts=arch.num_experts,
                   num_experts_per_tok=arch.moe_topk, rotary_dim=rotary,
                   rope_parameters={"rope_type": "default", "rope_theta": arch.rope_theta,
                                    "partial_rotary_factor": rotary / arch.kv_channels},
                   use_qk_norm=True, qk_norm_type="per_layer", scoring_func="sigmoid", use_routing_bias=True,
                   shared_intermediate_size=0, router_aux_loss_coef=arch.moe_aux_loss_coeff,
                   output_router_logits=False)
        return cfg

    def name_map(self, cfg: HFConfig, *, divisible_by: int = 128) -> NameMap:
        first, last = ends(cfg, divisible_by=divisible_by)
        return NameMap(first + norms() + attention(cfg) + moe(self.num_experts(cfg)) + last)

    def check_family(self, recipe: Any, plan: Any, arch: Arch) -> None:
        super().check_family(recipe, plan, arch)
        wrong = [(key, what) for key, what, on in (
            ("model.num_experts", "MoE in every layer (num_experts)", not arch.is_moe or arch.moe_first_dense_layers),
            ("model.qk_norm", "q / k norms (qk_norm true)", not arch.qk_norm),
            ("model.moe_shared_expert_ffn", "no shared experts", bool(arch.moe_shared_expert_ffn)),
            ("model.moe_score_function", "sigmoid routing with expert bias",
             arch.moe_score_function != "sigmoid" or not arch.moe_expert_bias),
        ) if on]
        if wrong:
            key, what = wrong[0]
            raise RecipeError(f"the minimax_m2 layout needs {what}", key=key)

    def layers(self, spec: Any, *, arch: Arch) -> Any:
        from loongforge_megatron.layers.projection_norm import with_projection_qk_norm

        return with_projection_qk_norm(spec, q_heads=arch.num_attention_heads, k_heads=arch.kv_heads)


SPEC = MiniMaxM2()
