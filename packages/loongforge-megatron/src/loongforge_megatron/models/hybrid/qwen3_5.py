"""Qwen3.5 language models, dense (``Qwen3_5ForCausalLM``) and MoE (``Qwen3_5MoeForCausalLM``): Qwen3-Next's hybrid
layers with the DeltaNet input projections split (``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``);
the MoE blocks keep the gated shared expert."""

from __future__ import annotations

from typing import Any

from loongforge_megatron.models.hybrid.family import HybridFamily

QWEN3_5 = dict(vocab_size=248320, norm_eps=1e-6, qk_norm=True, rotary_percent=0.25, full_attention_interval=4,
               linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, head_dim=256,
               max_position_embeddings=262144, rope_theta=10000000.0)

DENSE_PRESETS: dict[str, dict[str, Any]] = {
    # Qwen/Qwen3.5-27B's text_config
    "qwen3.5-27b": dict(QWEN3_5, family="qwen3_5", num_layers=64, hidden_size=5120, ffn_hidden_size=17408, num_attention_heads=24, num_query_groups=4, linear_num_key_heads=16, linear_num_value_heads=48),
    "qwen3.5-tiny": dict(QWEN3_5, family="qwen3_5", vocab_size=512, num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2, head_dim=16,
                         linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=256, rope_theta=10000.0),
}

MOE_PRESETS: dict[str, dict[str, Any]] = {
    # Qwen/Qwen3.5-35B-A3B's and Qwen/Qwen3.5-397B-A17B's text_config
    "qwen3.5-35b-a3b": dict(QWEN3_5, family="qwen3_5_moe", num_layers=40, hidden_size=2048, ffn_hidden_size=512, num_attention_heads=16, num_query_groups=2, linear_num_key_heads=16, linear_num_value_heads=32,
                            num_experts=256, moe_topk=8, moe_ffn_hidden_size=512, moe_shared_expert_ffn=512),
    "qwen3.5-397b-a17b": dict(QWEN3_5, family="qwen3_5_moe", num_layers=60, hidden_size=4096, ffn_hidden_size=1024, num_attention_heads=32, num_query_groups=2, linear_num_key_heads=16, linear_num_value_heads=64,
                              num_experts=512, moe_topk=10, moe_ffn_hidden_size=1024, moe_shared_expert_ffn=1024),
    "qwen3.5-moe-tiny": dict(QWEN3_5, family="qwen3_5_moe", vocab_size=512, num_layers=4, hidden_size=64, ffn_hidden_size=32, num_attention_heads=4, num_query_groups=2, head_dim=16,
                             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                             num_experts=4, moe_topk=2, moe_ffn_hidden_size=32, moe_shared_expert_ffn=48, max_position_embeddings=256, rope_theta=10000.0),
}


class Qwen3_5(HybridFamily):
    """``Qwen3_5ForCausalLM``."""

    name = "qwen3_5"
    model_types = ("qwen3_5_text",)
    presets = DENSE_PRESETS
    hf_architecture = "Qwen3_5ForCausalLM"
    split_projections = True


class Qwen3_5Moe(HybridFamily):
    """``Qwen3_5MoeForCausalLM``."""

    name = "qwen3_5_moe"
    model_types = ("qwen3_5_moe_text",)
    presets = MOE_PRESETS
    hf_architecture = "Qwen3_5MoeForCausalLM"
    split_projections = True


SPEC = Qwen3_5()
SPEC_MOE = Qwen3_5Moe()
