"""Qwen3-Next (``Qwen3NextForCausalLM``): gated DeltaNet layers with three in four layers, gated full attention in
the fourth, every layer a MoE block with a gated shared expert; the DeltaNet input projections fused per key head
(``in_proj_qkvz`` / ``in_proj_ba``)."""

from __future__ import annotations

from typing import Any

from loongforge_megatron.models.hybrid.family import HybridFamily

QWEN3_NEXT = dict(family="qwen3_next", vocab_size=151936, norm_eps=1e-6, qk_norm=True, rotary_percent=0.25,
                  full_attention_interval=4, linear_conv_kernel_dim=4, linear_key_head_dim=128,
                  linear_value_head_dim=128, head_dim=256)

PRESETS: dict[str, dict[str, Any]] = {
    # Qwen/Qwen3-Next-80B-A3B config.json
    "qwen3-next-80b-a3b": dict(QWEN3_NEXT, num_layers=48, hidden_size=2048, ffn_hidden_size=5120, num_attention_heads=16, num_query_groups=2, linear_num_key_heads=16, linear_num_value_heads=32,
                               num_experts=512, moe_topk=10, moe_ffn_hidden_size=512, moe_shared_expert_ffn=512, max_position_embeddings=262144, rope_theta=10000000.0),
    "qwen3-next-tiny": dict(QWEN3_NEXT, vocab_size=512, num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2, head_dim=16,
                            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                            num_experts=4, moe_topk=2, moe_ffn_hidden_size=32, moe_shared_expert_ffn=48, max_position_embeddings=256, rope_theta=10000.0),
}


class Qwen3Next(HybridFamily):
    """``Qwen3NextForCausalLM``."""

    name = "qwen3_next"
    model_types = ("qwen3_next",)
    presets = PRESETS
    hf_architecture = "Qwen3NextForCausalLM"
    split_projections = False


SPEC = Qwen3Next()
