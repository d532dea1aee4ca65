"""Named model sizes: the published architectures, plus ``tiny`` variants that CI trains on CPU. ``family``
selects the architecture class (``dit``: models.dit.DiTArch, the rest: models.arch.Arch)."""

from __future__ import annotations

from typing import Any

_LLAMA3 = dict(family="llama", vocab_size=128256, rope_theta=500000.0, norm_eps=1e-5)
_QWEN25 = dict(family="qwen2", vocab_size=151936, rope_theta=1000000.0, norm_eps=1e-6, qkv_bias=True, max_position_embeddings=32768)
_QWEN3 = dict(family="qwen3", vocab_size=151936, rope_theta=1000000.0, norm_eps=1e-6, qk_norm=True, head_dim=128, max_position_embeddings=40960)

PRESETS: dict[str, dict[str, Any]] = {
    # Llama 2
    "llama2-7b": dict(family="llama", num_layers=32, hidden_size=4096, ffn_hidden_size=11008, num_attention_heads=32, vocab_size=32000, max_position_embeddings=4096),
    "llama2-13b": dict(family="llama", num_layers=40, hidden_size=5120, ffn_hidden_size=13824, num_attention_heads=40, vocab_size=32000, max_position_embeddings=4096),
    "llama2-70b": dict(family="llama", num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64, num_query_groups=8, vocab_size=32000, max_position_embeddings=4096),
    # Llama 3 / 3.1 / 3.2
    "llama3-8b": dict(_LLAMA3, num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32, num_query_groups=8, max_position_embeddings=8192),
    "llama3-70b": dict(_LLAMA3, num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64, num_query_groups=8, max_position_embeddings=8192),
    "llama3.1-8b": dict(_LLAMA3, num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32, num_query_groups=8, max_position_embeddings=131072, rope_scaling_factor=8.0, rope_original_max_position=8192),
    "llama3.1-70b": dict(_LLAMA3, num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64, num_query_groups=8, max_position_embeddings=131072, rope_scaling_factor=8.0, rope_original_max_position=8192),
    "llama3.1-405b": dict(_LLAMA3, num_layers=126, hidden_size=16384, ffn_hidden_size=53248, num_attention_heads=128, num_query_groups=8, max_position_embeddings=131072, rope_scaling_factor=8.0, rope_original_max_position=8192),
    "llama3.2-1b": dict(_LLAMA3, num_layers=16, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=32, num_query_groups=8, head_dim=64, tie_embeddings=True, max_position_embeddings=131072, rope_scaling_factor=32.0, rope_original_max_position=8192),
    "llama3.2-3b": dict(_LLAMA3, num_layers=28, hidden_size=3072, ffn_hidden_size=8192, num_attention_heads=24, num_query_groups=8, head_dim=128, tie_embeddings=True, max_position_embeddings=131072, rope_scaling_factor=32.0, rope_original_max_position=8192),
    "llama-tiny": dict(family="llama", num_layers=4, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4, num_query_groups=2, vocab_size=512, max_position_embeddings=256),
    # Qwen2 / 2.5
    "qwen2-7b": dict(_QWEN25, vocab_size=152064, num_layers=28, hidden_size=3584, ffn_hidden_size=18944, num_attention_heads=28, num_query_groups=4),
    "qwen2.5-0.5b": dict(_QWEN25, num_layers=24, hidden_size=896, ffn_hidden_size=4864, num_attention_heads=14, num_query_groups=2, tie_embeddings=True),
    "qwen2.5-1.5b": dict(_QWEN25, num_layers=28, hidden_size=1536, ffn_hidden_size=8960, num_attention_heads=12, num_query_groups=2, tie_embeddings=True),
    "qwen2.5-7b": dict(_QWEN25, vocab_size=152064, num_layers=28, hidden_size=3584, ffn_hidden_size=18944, num_attention_heads=28, num_query_groups=4),
    "qwen2.5-14b": dict(_QWEN25, vocab_size=152064, num_layers=48, hidden_size=5120, ffn_hidden_size=13824, num_attention_heads=40, num_query_groups=8),
    "qwen2.5-32b": dict(_QWEN25, vocab_size=152064, num_layers=64, hidden_size=5120, ffn_hidden_size=27648, num_attention_heads=40, num_query_groups=8),
    "qwen2.5-72b": dict(_QWEN25, vocab_size=152064, num_layers=80, hidden_size=8192, ffn_hidden_size=29568, num_attention_heads=64, num_query_groups=8),
    "qwen2-tiny": dict(_QWEN25, vocab_size=512, num_layers=4, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4, num_query_groups=2, max_position_embeddings=256),
    # Qwen3 dense
    "qwen3-0.6b": dict(_QWEN3, num_layers=28, hidden_size=1024, ffn_hidden_size=3072, num_attention_heads=16, num_query_groups=8, tie_embeddings=True),
    "qwen3-1.7b": dict(_QWEN3, num_layers=28, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=16, num_query_groups=8, tie_embeddings=True),
    "qwen3-4b": dict(_QWEN3, num_layers=36, hidden_size=2560, ffn_hidden_size=9728, num_attention_heads=32, num_query_groups=8, tie_embeddings=True),
    "qwen3-8b": dict(_QWEN3, num_layers=36, hidden_size=4096, ffn_hidden_size=12288, num_attention_heads=32, num_query_groups=8),
    "qwen3-14b": dict(_QWEN3, num_layers=40, hidden_size=5120, ffn_hidden_size=17408, num_attention_heads=40, num_query_groups=8),
    "qwen3-32b": dict(_QWEN3, num_layers=64, hidden_size=5120, ffn_hidden_size=25600, num_attention_heads=64, num_query_groups=8),
    "qwen3-tiny": dict(_QWEN3, vocab_size=512, num_layers=4, hidden_size=64, head_dim=16, ffn_hidden_size=176, num_attention_heads=4, num_query_groups=2, max_position_embeddings=256),
    # Qwen3 MoE
    "qwen3-30b-a3b": dict(_QWEN3, family="qwen3_moe", num_layers=48, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=32, num_query_groups=4, num_experts=128, moe_topk=8, moe_ffn_hidden_size=768),
    "qwen3-235b-a22b": dict(_QWEN3, family="qwen3_moe", num_layers=94, hidden_size=4096, ffn_hidden_size=12288, num_attention_heads=64, num_query_groups=4, num_experts=128, moe_topk=8, moe_ffn_hidden_size=1536),
    "qwen3-moe-tiny": dict(_QWEN3, family="qwen3_moe", vocab_size=512, num_layers=4, hidden_size=64, head_dim=16, ffn_hidden_size=176, num_attention_heads=4, num_query_groups=2, num_experts=4, moe_topk=2, moe_ffn_hidden_size=48, max_position_embeddings=256),
    # DeepSeek-V3 style: MLA + MoE with a shared expert, sigmoid routing with expert bias, grouped top-k
    "deepseek-v3": dict(family="deepseek_v3", num_layers=61, hidden_size=7168, ffn_hidden_size=18432, num_attention_heads=128, vocab_size=129280, max_position_embeddings=163840, rope_theta=10000.0, norm_eps=1e-6,
                        num_experts=256, moe_topk=8, moe_ffn_hidden_size=2048, moe_shared_expert_ffn=2048, moe_first_dense_layers=3, moe_score_function="sigmoid", moe_expert_bias=True, moe_routed_scaling=2.5, moe_num_groups=8, moe_group_topk=4,
                        q_lora_rank=1536, kv_lora_rank=512, qk_norm=True, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
    "deepseek-v3-tiny": dict(family="deepseek_v3", num_layers=3, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4, vocab_size=512, max_position_embeddings=256, norm_eps=1e-6,
                             num_experts=4, moe_topk=2, moe_ffn_hidden_size=32, moe_shared_expert_ffn=32, moe_first_dense_layers=1, moe_score_function="sigmoid", moe_expert_bias=True, moe_routed_scaling=2.5, moe_num_groups=2, moe_group_topk=1,
                             q_lora_rank=32, kv_lora_rank=16, qk_norm=True, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
    # LLaVA (VLM): a Llama language model + CLIP vision tower + MLP projector (Arch.vision: HF LlavaConfig fields)
    "llava-1.5-7b": dict(family="llama", num_layers=32, hidden_size=4096, ffn_hidden_size=11008, num_attention_heads=32, vocab_size=32064, max_position_embeddings=4096,
                         vision=dict(vision_config=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16, image_size=336, patch_size=14, hidden_act="quick_gelu", layer_norm_eps=1e-5),
                                     projector_hidden_act="gelu", vision_feature_layer=-2, vision_feature_select_strategy="default", image_token_index=32000, image_seq_length=576)),
    "llava-tiny": dict(family="llama", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2, vocab_size=256, max_position_embeddings=256,
                       vision=dict(vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=32, patch_size=8, hidden_act="quick_gelu", layer_norm_eps=1e-5),
                                   projector_hidden_act="gelu", vision_feature_layer=-2, vision_feature_select_strategy="default", image_token_index=255, image_seq_length=16)),
    # DiT (class-conditional latent diffusion transformer, models.dit.DiTArch): DiT-XL/2 as facebook/DiT-XL-2-256
    "dit-xl-2-256": dict(family="dit", num_layers=28, hidden_size=1152, num_attention_heads=16, patch_size=2, sample_size=32, in_channels=4, learn_sigma=True, num_classes=1000),
    "dit-tiny": dict(family="dit", num_layers=2, hidden_size=64, num_attention_heads=4, patch_size=2, sample_size=8, in_channels=4, learn_sigma=True, num_classes=10),
}

