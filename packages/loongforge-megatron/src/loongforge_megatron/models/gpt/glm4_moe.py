"""GLM-4.5-style MoE (``Glm4MoeForCausalLM``): GQA attention with q/k/v biases, optional per-head q/k RMSNorm and
RoPE on the leading half of each head (``partial_rotary_factor``), ``first_k_dense_replace`` dense layers, then
MoE layers laid out as DeepSeek-V3's: a sigmoid router with ``e_score_correction_bias`` and group-limited top-k,
routed experts and shared experts; checkpoints may carry multi-token-prediction layers in DeepSeek's layout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loongforge.checkpoint import NameMap
from loongforge.errors import CheckpointError, RecipeError

from loongforge_megatron.models.gpt.arch import Arch
from loongforge_megatron.models.gpt.deepseek_v3 import DeepSeekMoEFamily, mlp, with_mtp
from loongforge_megatron.models.gpt.names import HFConfig, ends, gqa_attention, norms

_GLM = dict(family="glm4_moe", qkv_bias=True, rotary_percent=0.5, norm_eps=1e-5, moe_score_function="sigmoid",
            moe_expert_bias=True, moe_num_groups=1, moe_group_topk=1)

PRESETS: dict[str, dict[str, Any]] = {
    # zai-org/GLM-4.5-Air and GLM-4.5 config.json
    "glm-4.5-air": dict(_GLM, num_layers=46, hidden_size=4096, ffn_hidden_size=10944, num_attention_heads=96, num_query_groups=8, head_dim=128, vocab_size=151552, max_position_embeddings=131072, rope_theta=1000000.0,
                        num_experts=128, moe_topk=8, moe_ffn_hidden_size=1408, moe_shared_expert_ffn=1408, moe_first_dense_layers=1, moe_routed_scaling=1.0),
    "glm-4.5": dict(_GLM, num_layers=92, hidden_size=5120, ffn_hidden_size=12288, num_attention_heads=96, num_query_groups=8, head_dim=128, vocab_size=151552, max_position_embeddings=131072, rope_theta=1000000.0, qk_norm=True,
                    num_experts=160, moe_topk=8, moe_ffn_hidden_size=1536, moe_shared_expert_ffn=1536, moe_first_dense_layers=3, moe_routed_scaling=2.5),
    "glm4-moe-tiny": dict(_GLM, num_layers=3, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4, num_query_groups=2, head_dim=16, vocab_size=512, max_position_embeddings=256, qk_norm=True,
                          num_experts=4, moe_topk=2, moe_ffn_hidden_size=32, moe_shared_expert_ffn=32, moe_first_dense_layers=1, moe_routed_scaling=2.5, moe_num_groups=2, moe_group_topk=1),
}


def partial_rotary(cfg: dict) -> float:
    """``partial_rotary_factor``: top level (the hub's configs) or inside transformers 5's ``rope_parameters``."""
    params = cfg.get("rope_parameters") or {}
    return float(cfg.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0)


class Glm4Moe(DeepSeekMoEFamily):
    """``Glm4MoeForCausalLM`` (GLM's ``attention_bias`` biases q/k/v only: megatron's add_qkv_bias)."""

    layout_name = "GLM-4.5"

    name = "glm4_moe"
    model_types = ("glm4_moe",)
    presets = PRESETS
    hf_architecture = "Glm4MoeForCausalLM"
    mtp = True

    def read_hf(self, cfg: dict, fields: dict[str, Any], *, path: Path) -> dict[str, Any]:
        fields.update(
            qkv_bias=bool(cfg.get("attention_bias", False)),
            qk_norm=bool(cfg.get("use_qk_norm", False)),
            rotary_percent=partial_rotary(cfg),
            num_experts=cfg["n_routed_experts"],
            moe_topk=cfg["num_experts_per_tok"],
            moe_ffn_hidden_size=cfg["moe_intermediate_size"],
            moe_shared_expert_ffn=cfg["moe_intermediate_size"] * cfg.get("n_shared_experts", 1),
            moe_first_dense_layers=cfg.get("first_k_dense_replace", 0),
            moe_score_function="sigmoid",
            moe_expert_bias=True,
            moe_norm_topk=bool(cfg.get("norm_topk_prob", True)),
            moe_routed_scaling=cfg.get("routed_scaling_factor", 1.0),
            moe_num_groups=cfg.get("n_group"),
            moe_group_topk=cfg.get("topk_group"),
        )
        if not cfg.get("n_shared_experts"):
            raise RecipeError(f"{path}: n_shared_experts 0 is not supported for glm4_moe (the name map expects "
                              "shared experts)", key="model.hf")
        return fields

    def write_hf(self, arch: Arch, cfg: dict) -> dict:
        cfg.update(attention_bias=arch.qkv_bias, use_qk_norm=arch.qk_norm, partial_rotary_factor=arch.rotary_percent,
                   n_routed_experts=arch.num_experts, num_experts_per_tok=arch.moe_topk,
                   moe_intermediate_size=arch.moe_ffn_hidden_size,
                   n_shared_experts=(arch.moe_shared_expert_ffn or 0) // (arch.moe_ffn_hidden_size or 1),
                   first_k_dense_replace=arch.moe_first_dense_layers, norm_topk_prob=arch.moe_norm_topk,
                   routed_scaling_factor=arch.moe_routed_scaling or 1.0, n_group=arch.moe_num_groups or 1,
                   topk_group=arch.moe_group_topk or 1, num_nextn_predict_layers=arch.mtp_num_layers)
        return cfg

    def config_checks(self, sizes: Any) -> None:
        """``partial_rotary_factor`` rotates a whole, even number of each head's dims (no tensor shape shows it)."""
        cfg = {k: sizes.raw(k) for k in ("partial_rotary_factor", "rope_parameters")}
        factor = cfg["partial_rotary_factor"]
        if factor is None and isinstance(cfg["rope_parameters"], dict):
            factor = cfg["rope_parameters"].get("partial_rotary_factor")
        head = sizes.get("head_dim") or sizes["hidden_size"] // sizes["num_attention_heads"]
        if factor is None:
            return
        ok = isinstance(factor, (int, float)) and not isinstance(factor, bool) and 0 < factor <= 1
        dims = factor * head.value if ok else 0
        if not ok or dims != int(dims) or int(dims) % 2:
            raise CheckpointError(f"{sizes.where}: key 'partial_rotary_factor' must be in (0, 1] and rotate an even "
                                  f"number of the head's {head.value} dims ({head.keys}), got {factor!r:.40}")

    def name_map(self, cfg: HFConfig, *, divisible_by: int = 128) -> NameMap:
        first, last = ends(cfg, divisible_by=divisible_by)
        attention = gqa_attention(cfg, qkv_bias=bool(cfg.get("attention_bias")), qk_norm=bool(cfg.get("use_qk_norm")))
        return NameMap(with_mtp(cfg, first, norms() + attention + mlp(cfg), last))


SPEC = Glm4Moe()
