"""Qwen3-MoE: Qwen3 attention + router and routed experts (no shared experts); ``mlp_only_layers`` and
``decoder_sparse_step`` keep some layers dense (the name map reads them; training refuses them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loongforge.checkpoint import NameMap
from loongforge.errors import RecipeError

from loongforge_megatron.models.gpt.arch import Arch
from loongforge_megatron.models.gpt.names import (
    HFConfig,
    dense_mlp,
    ends,
    fused_experts,
    gqa_attention,
    norms,
    routed_experts,
)
from loongforge_megatron.models.gpt.qwen3 import QWEN3, Qwen3

PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": dict(QWEN3, family="qwen3_moe", num_layers=48, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=32, num_query_groups=4, num_experts=128, moe_topk=8, moe_ffn_hidden_size=768),
    "qwen3-235b-a22b": dict(QWEN3, family="qwen3_moe", num_layers=94, hidden_size=4096, ffn_hidden_size=12288, num_attention_heads=64, num_query_groups=4, num_experts=128, moe_topk=8, moe_ffn_hidden_size=1536),
    "qwen3-moe-tiny": dict(QWEN3, family="qwen3_moe", vocab_size=512, num_layers=4, hidden_size=64, head_dim=16, ffn_hidden_size=176, num_attention_heads=4, num_query_groups=2, num_experts=4, moe_topk=2, moe_ffn_hidden_size=48, max_position_embeddings=256),
}


def num_experts(h: HFConfig) -> int:
    # NOTE: hub configs say num_experts; transformers 5 saves it as num_local_experts.
    return h.get("num_experts", h.get("num_local_experts", 0))


def is_moe_layer(h: HFConfig, layer: int) -> bool:
    step = h.get("decoder_sparse_step", 1) or 1
    return num_experts(h) > 0 and layer not in (h.get("mlp_only_layers") or []) and (layer + 1) % step == 0


class Qwen3Moe(Qwen3):
    """``Qwen3MoeForCausalLM``."""

    name = "qwen3_moe"
    model_types = ("qwen3_moe",)
    presets = PRESETS
    hf_architecture = "Qwen3MoeForCausalLM"

    def read_hf(self, cfg: dict, fields: dict[str, Any], *, path: Path) -> dict[str, Any]:
        fields = super().read_hf(cfg, fields, path=path)
        fields.update(num_experts=num_experts(cfg), moe_topk=cfg["num_experts_per_tok"],
                      moe_ffn_hidden_size=cfg["moe_intermediate_size"], moe_norm_topk=bool(cfg.get("norm_topk_prob", True)))
        if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
            raise RecipeError("Qwen3-MoE configs with mlp_only_layers / decoder_sparse_step != 1 are not supported", key="model.hf")
        return fields

    def write_hf(self, arch: Arch, cfg: dict) -> dict:
        cfg = super().write_hf(arch, cfg)
        cfg.update(num_experts=arch.num_experts, num_experts_per_tok=arch.moe_topk, moe_intermediate_size=arch.moe_ffn_hidden_size,
                   norm_topk_prob=arch.moe_norm_topk, decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False,
                   router_aux_loss_coef=arch.moe_aux_loss_coeff)
        return cfg

    def num_experts(self, cfg: HFConfig) -> int:
        return num_experts(cfg)

    def name_map(self, cfg: HFConfig, *, divisible_by: int = 128) -> NameMap:
        return name_map(cfg, divisible_by=divisible_by)


def name_map(cfg: HFConfig, *, divisible_by: int = 128, fused: bool = False) -> NameMap:
    """Qwen3-MoE's layers; ``fused``: the experts as transformers' 3-D ``gate_up_proj`` / ``down_proj``
    (Qwen3-VL-MoE's checkpoints), else one tensor per expert (Qwen3-MoE's)."""
    first, last = ends(cfg, divisible_by=divisible_by)

    def moe(i: int) -> bool:
        return is_moe_layer(cfg, i)

    def dense(i: int) -> bool:
        return not is_moe_layer(cfg, i)

    body = norms() + gqa_attention(cfg, qk_norm=True) + dense_mlp(layers=dense)
    experts = (fused_experts(num_experts(cfg), hidden=cfg["hidden_size"], ffn=cfg["moe_intermediate_size"], layers=moe)
               if fused else routed_experts(num_experts(cfg), layers=moe))
    return NameMap(first + body + experts + last)


SPEC = Qwen3Moe()
