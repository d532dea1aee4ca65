"""Kimi-K2 (Moonshot AI): DeepSeek-V3's architecture (MLA, one dense layer, then MoE with a sigmoid router,
expert bias and a shared expert) at 384 routed experts, 64 heads and a 160k vocabulary; its checkpoints say
``model_type: kimi_k2`` with ``architectures: [DeepseekV3ForCausalLM]``, and convert with DeepSeek-V3's map."""

from __future__ import annotations

from typing import Any

from loongforge_megatron.models.gpt.deepseek_v3 import DeepseekV3

# NOTE: moonshotai/Kimi-K2-Instruct's config.json (YaRN 32x over a 4k original context)
_YARN = {"factor": 32.0, "original_max_position_embeddings": 4096.0, "beta_fast": 1.0, "beta_slow": 1.0,
         "mscale": 1.0, "mscale_all_dim": 1.0}

PRESETS: dict[str, dict[str, Any]] = {
    "kimi-k2": dict(family="kimi_k2", num_layers=61, hidden_size=7168, ffn_hidden_size=18432, num_attention_heads=64, vocab_size=163840, max_position_embeddings=131072, rope_theta=50000.0, norm_eps=1e-6, rope_yarn=_YARN,
                    num_experts=384, moe_topk=8, moe_ffn_hidden_size=2048, moe_shared_expert_ffn=2048, moe_first_dense_layers=1, moe_score_function="sigmoid", moe_expert_bias=True, moe_routed_scaling=2.827, moe_num_groups=1, moe_group_topk=1,
                    q_lora_rank=1536, kv_lora_rank=512, qk_norm=True, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
    "kimi-k2-tiny": dict(family="kimi_k2", num_layers=3, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4, vocab_size=512, max_position_embeddings=1024, rope_theta=50000.0, norm_eps=1e-6, rope_yarn=dict(_YARN, factor=4.0, original_max_position_embeddings=256.0),
                         num_experts=6, moe_topk=2, moe_ffn_hidden_size=32, moe_shared_expert_ffn=32, moe_first_dense_layers=1, moe_score_function="sigmoid", moe_expert_bias=True, moe_routed_scaling=2.827, moe_num_groups=1, moe_group_topk=1,
                         q_lora_rank=32, kv_lora_rank=16, qk_norm=True, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
}


class KimiK2(DeepseekV3):
    """Kimi-K2 checkpoints (``model_type: kimi_k2``), trained and converted as DeepSeek-V3."""

    name = "kimi_k2"
    model_types = ("kimi_k2",)
    trained_types = ("kimi_k2",)
    presets = PRESETS
    hf_architecture = "DeepseekV3ForCausalLM"


SPEC = KimiK2()
