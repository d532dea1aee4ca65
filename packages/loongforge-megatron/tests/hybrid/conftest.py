"""Tiny hybrid checkpoints saved by transformers (GQA, an odd vocabulary, both layer kinds, value heads twice the
key heads of another size, MoE with a gated shared expert), built once per module that asks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

COMMON = dict(vocab_size=101, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
              linear_value_head_dim=6, linear_conv_kernel_dim=4, max_position_embeddings=128,
              layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"])
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)

CLASSES = {
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(COMMON, intermediate_size=48, **MOE)),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(COMMON, intermediate_size=48)),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(COMMON, **MOE)),
    # NOTE: a vocabulary tp 2 divides: a padded vocabulary row would join the softmax (the output layer does not
    # mask it), so layouts that pad compare against one process only for such vocabularies
    "qwen3_5_moe_even": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(COMMON, **MOE, vocab_size=102)),
}


def save_tiny(family: str, out: Path) -> Path:
    import transformers as tf

    cfg_cls, model_cls, kwargs = CLASSES[family]
    torch.manual_seed(0)
    model = getattr(tf, model_cls)(getattr(tf, cfg_cls)(**kwargs))
    with torch.no_grad():  # non-trivial norms / biases so a swapped tensor cannot pass as equal
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_((0.1 if "A_log" not in name else 1.0) * torch.randn_like(p))
            else:  # NOTE: weights 10x transformers' init: logits far from uniform, so the loss sees every layer
                p.mul_(10.0)
    model.save_pretrained(out)
    (out / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    return out


@pytest.fixture(scope="module")
def hybrid_hf(tmp_path_factory):
    """family -> directory of its tiny transformers checkpoint (built on first use in the module)."""
    root = tmp_path_factory.mktemp("hybrid_hf")
    cache: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in cache:
            cache[family] = save_tiny(family, root / family)
        return cache[family]

    return get
