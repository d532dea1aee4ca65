"""Shared fixtures: tiny random-init HF models saved by transformers itself, and their reference loss."""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, rms_norm_eps=1e-6)


def save_tiny(family: str, out: Path, *, seed: int = 0, **over) -> Path:
    import transformers as tf

    torch.manual_seed(seed)
    if family == "llama":
        cfg = tf.LlamaConfig(**{**COMMON, **over})
        model = tf.LlamaForCausalLM(cfg)
    elif family == "qwen3":
        cfg = tf.Qwen3Config(**{**COMMON, "head_dim": 16, **over})
        model = tf.Qwen3ForCausalLM(cfg)
    elif family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**{**COMMON, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                                  "moe_intermediate_size": 32, "decoder_sparse_step": 1, "norm_topk_prob": True, **over})
        model = tf.Qwen3MoeForCausalLM(cfg)
    elif family == "deepseek_v3":
        cfg = tf.DeepseekV3Config(**{**COMMON, "num_key_value_heads": 4, "num_hidden_layers": 3, "n_routed_experts": 4,
                                     "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
                                     "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "q_lora_rank": 32,
                                     "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
                                     "routed_scaling_factor": 2.5, **over})
        model = tf.DeepseekV3ForCausalLM(cfg)
    else:
        raise ValueError(family)
    with torch.no_grad():  # make every tensor non-trivial (HF inits some to ones/zeros)
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.01 * torch.randn_like(b))
    model.save_pretrained(out)
    return out


def hf_loss(hf_dir: Path, batches: list[dict]) -> float:
    """Token-weighted mean next-token loss of the HF model over megatron-style batches (labels pre-shifted)."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    model.eval()
    total, count = 0.0, 0.0
    with torch.no_grad():
        for b in batches:
            logits = model(input_ids=b["tokens"]).logits.float()
            losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), reduction="none")
            mask = b["loss_mask"].flatten()
            total += float((losses * mask).sum())
            count += float(mask.sum())
    return total / count


import pytest  # noqa: E402


@pytest.fixture
def tiny_hf():
    """``tiny_hf(family, dir, **config_overrides) -> dir``: a random-init model saved with save_pretrained."""
    return save_tiny


@pytest.fixture
def reference_loss():
    """``reference_loss(hf_dir, batches) -> float``: transformers' token-weighted loss on megatron batches."""
    return hf_loss
