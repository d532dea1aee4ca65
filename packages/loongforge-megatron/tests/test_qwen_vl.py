"""Qwen2.5-VL on megatron-core: HF -> megatron -> HF is bit-exact at tp 1 and tp 2 / pp 2; the first step of
``loongforge train`` on two image-text records (images of different sizes) gives the loss transformers computes on
what its own ``AutoProcessor`` makes of the same records; ``train.freeze [vision]`` keeps the tower bit-identical.

NOTE: every megatron job here runs in a rank (``ranks``) or a subprocess, never in pytest's own process."""

from __future__ import annotations

import json
from pathlib import Path

import loongforge
import pytest
import torch

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "vlm" / "qwen2_5_vl_tiny.yaml"
SPECIAL = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def save_qwen_vl(out: Path, *, vocab: int = 320, ids: dict[str, int] | None = None, tie: bool = False) -> Path:
    """A tiny Qwen2_5_VLForConditionalGeneration with every weight perturbed (no norm at 1, no bias at 0)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = ids or {"image_token_id": 300, "video_token_id": 301, "vision_start_token_id": 302, "vision_end_token_id": 303}
    cfg = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                         tie_word_embeddings=tie, bos_token_id=None, eos_token_id=None),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=64,
                           patch_size=4, spatial_merge_size=2, temporal_patch_size=2, window_size=16,
                           fullatt_block_indexes=[2]),
        tie_word_embeddings=tie, **ids)
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm = name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight"))
            p.copy_((1.0 if norm else 0.0) + 0.1 * torch.randn(p.shape, generator=g))
    model.save_pretrained(out)
    return out


def save_processor(out: Path, texts: list[str]) -> tuple[dict[str, int], int]:
    """A byte-level BPE tokenizer with Qwen-VL's special tokens, Qwen2-VL's image processor (4-pixel patches, a
    small pixel budget) and chat template, saved as the model directory's processor; returns (the special token
    ids, the vocabulary size)."""
    from loongforge_megatron.data.tokenizer import train_bpe
    from loongforge_megatron.models.qwen_vl.data import QWEN_VL_CHAT_TEMPLATE
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    tok = train_bpe(texts, vocab_size=290, out_dir=out)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    tok.eos_token, tok.pad_token = "<|im_end|>", "<|im_end|>"
    images = Qwen2VLImageProcessor(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=8 * 8,
                                   max_pixels=32 * 32)
    video = Qwen2VLVideoProcessor(patch_size=4, merge_size=2, temporal_patch_size=2)
    processor = Qwen2_5_VLProcessor(image_processor=images, tokenizer=tok, video_processor=video,
                                    chat_template=QWEN_VL_CHAT_TEMPLATE)
    processor.save_pretrained(out)
    t = tok.convert_tokens_to_ids
    return {"image_token_id": t("<|image_pad|>"), "video_token_id": t("<|video_pad|>"),
            "vision_start_token_id": t("<|vision_start|>"), "vision_end_token_id": t("<|vision_end|>")}, len(tok)
