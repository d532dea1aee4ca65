"""GLM-5 (``GlmMoeDsaForCausalLM``): DeepSeek-V3.2's MLA + MoE + DeepSeek Sparse Attention at GLM's sizes, with an
interleaved-RoPE indexer and cross-layer top-k sharing (``indexer_types``: a ``shared`` layer has no indexer and
attends to the keys the last ``full`` layer chose)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loongforge.errors import RecipeError

from loongforge_megatron.models.gpt.arch import Arch
from loongforge_megatron.models.gpt.deepseek_v32 import DeepseekV32
from loongforge_megatron.models.gpt.names import HFConfig

_GLM5 = dict(family="glm_moe_dsa", norm_eps=1e-5, moe_score_function="sigmoid", moe_expert_bias=True,
             moe_routed_scaling=2.5, moe_num_groups=1, moe_group_topk=1, qk_norm=True, dsa_index_rope_interleaved=True)

PRESETS: dict[str, dict[str, Any]] = {
    # transformers' GlmMoeDsaConfig defaults (zai-org/GLM-5)
    "glm-5": dict(_GLM5, num_layers=78, hidden_size=6144, ffn_hidden_size=12288, num_attention_heads=64,
                  vocab_size=154880, max_position_embeddings=202752, num_experts=256, moe_topk=8,
                  moe_ffn_hidden_size=2048, moe_shared_expert_ffn=2048, moe_first_dense_layers=3, q_lora_rank=2048,
                  kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, dsa_index_heads=32,
                  dsa_index_head_dim=128, dsa_index_topk=2048),
    "glm-5-tiny": dict(_GLM5, num_layers=3, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4, vocab_size=512,
                       max_position_embeddings=256, num_experts=4, moe_topk=2, moe_ffn_hidden_size=32,
                       moe_shared_expert_ffn=32, moe_first_dense_layers=1, q_lora_rank=32, kv_lora_rank=16,
                       qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, dsa_index_heads=8,
                       dsa_index_head_dim=16, dsa_index_topk=16, dsa_index_shared_layers=[2]),
}


def _indexer_types(cfg: HFConfig) -> list[str]:
    """``indexer_types`` as transformers derives it when a config.json leaves it out (index_topk_freq /
    index_skip_topk_offset, or index_topk_pattern)."""
    n = cfg["num_hidden_layers"]
    if cfg.get("indexer_types"):
        return list(cfg["indexer_types"])
    pattern = cfg.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq, offset = max(cfg.get("index_topk_freq", 1), 1), cfg.get("index_skip_topk_offset", 2)
    return ["full" if (max(i - offset + 1, 0) % freq) == 0 else "shared" for i in range(n)]


class GlmMoeDsa(DeepseekV32):
    """``GlmMoeDsaForCausalLM`` (GLM-5)."""

    name = "glm_moe_dsa"
    model_types = ("glm_moe_dsa",)
    trained_types = ("glm_moe_dsa",)
    presets = PRESETS
    hf_architecture = "GlmMoeDsaForCausalLM"
    layout_name = "GLM-5"

    def read_hf(self, cfg: dict, fields: dict[str, Any], *, path: Path) -> dict[str, Any]:
        fields = super().read_hf(cfg, fields, path=path)
        shared = sorted(self.shared_layers(cfg))
        fields.update(dsa_index_rope_interleaved=True, dsa_index_shared_layers=shared or None,
                      dsa_index_heads=cfg.get("index_n_heads", 32))
        return fields

    def write_hf(self, arch: Arch, cfg: dict) -> dict:
        cfg = super().write_hf(arch, cfg)
        shared = set(arch.dsa_index_shared_layers or ())
        cfg["indexer_types"] = ["shared" if i in shared else "full" for i in range(arch.num_layers)]
        return cfg

    def shared_layers(self, cfg: HFConfig) -> frozenset[int]:
        return frozenset(i for i, t in enumerate(_indexer_types(cfg)) if t == "shared")

    def check_family(self, recipe: Any, plan: Any, arch: Arch) -> None:
        super().check_family(recipe, plan, arch)
        if arch.dsa_index_shared_layers and plan.pp > 1:
            # NOTE: a shared layer reads the top-k of the layer before it, which may sit on the previous stage
            raise RecipeError(f"layers {arch.dsa_index_shared_layers} reuse an earlier layer's top-k (indexer_types "
                              "shared), which does not cross pipeline stages here: use parallel.pp 1",
                              key="parallel.pp")


SPEC = GlmMoeDsa()
