"""Tiny random-init HF checkpoints saved by transformers (built once per session, no downloads)."""

from __future__ import annotations

import pytest
import torch

TINY = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2)),
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        vocab_size=100, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        vocab_size=100, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1)),
    "kimi_k2": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        vocab_size=100, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=6, n_shared_experts=1,
        num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1, routed_scaling_factor=2.827)),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        vocab_size=100, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, first_k_dense_replace=1, n_group=2, topk_group=1, attention_bias=True,
        use_qk_norm=True)),
}
# NOTE: Kimi-K2's hub checkpoints are DeepseekV3ForCausalLM models that say model_type kimi_k2
MODEL_TYPE = {"kimi_k2": "kimi_k2"}


def build_tiny(name: str, path) -> None:
    import transformers

    cfg_cls, model_cls, kwargs = TINY[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**kwargs))
    with torch.no_grad():  # non-trivial norms/biases so a swapped tensor cannot pass as equal
        for p in model.parameters():
            if p.ndim == 1:
                p.copy_(torch.randn_like(p))
        for n, b in model.named_buffers():
            if "e_score_correction_bias" in n:
                b.copy_(torch.randn_like(b))
    model.save_pretrained(path)
    if name in MODEL_TYPE:
        import json

        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, "model_type": MODEL_TYPE[name]}, indent=2))
    (path / "tokenizer_config.json").write_text('{"model_max_length": 64}')


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """name -> directory of a tiny HF checkpoint (built lazily, cached for the session)."""
    root = tmp_path_factory.mktemp("tiny_hf")
    cache: dict[str, object] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = root / name
            build_tiny(name, cache[name])
        return cache[name]

    return get
