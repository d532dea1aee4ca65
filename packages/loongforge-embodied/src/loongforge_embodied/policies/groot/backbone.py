"""The Eagle-style VLM backbone of GR00T N1.5, from transformers building blocks.

Images → SigLIP patch features → 2×2 pixel shuffle (4× fewer tokens, 4× wider) → MLP projector into the LM
width; the image tokens of every camera are followed by the task tokens and run through a causal Qwen3 LM that
is *cut* after ``lm_layers`` blocks. GR00T reads Eagle's hidden state at ``select_layer=12`` and drops the later
layers; with the layers dropped, that state is the LM's (final-normed) output, which is what we return.
"""

from __future__ import annotations

import torch
from torch import nn

from loongforge_embodied.policies.groot.configuration_groot import GrootArch


def pixel_shuffle(x: torch.Tensor) -> torch.Tensor:
    """(B, h·w, C) patch grid → (B, h·w/4, 4C): each 2×2 neighbourhood becomes one token (Eagle's downsample 0.5)."""
    b, n, c = x.shape
    h = w = int(n**0.5)
    x = x.reshape(b, h // 2, 2, w // 2, 2, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(b, n // 4, 4 * c)


class VisionEncoder(nn.Module):
    """SigLIP tower + pixel shuffle + Eagle's ``mlp1`` projector (LayerNorm, Linear, GELU, Linear)."""

    def __init__(self, a: GrootArch):
        super().__init__()
        from transformers import SiglipVisionConfig, SiglipVisionModel

        cfg = SiglipVisionConfig(
            hidden_size=a.vision_hidden, intermediate_size=a.vision_intermediate, num_hidden_layers=a.vision_layers,
            num_attention_heads=a.vision_heads, image_size=a.image_size, patch_size=a.patch_size, vision_use_head=False,
        )
        cfg._attn_implementation = "sdpa"
        self.tower = SiglipVisionModel(cfg)
        self.projector = nn.Sequential(nn.LayerNorm(4 * a.vision_hidden), nn.Linear(4 * a.vision_hidden, a.lm_hidden),
                                       nn.GELU(), nn.Linear(a.lm_hidden, a.lm_hidden))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """(B, cams, 3, H, W) in [0, 1] → (B, cams·tokens, lm_hidden)."""
        b = images.shape[0]
        # NOTE: all cameras go through the tower as one batch: one pass per block (one FSDP all-gather each).
        pix = images.flatten(0, 1) * 2.0 - 1.0
        patches = self.tower(pixel_values=pix.to(self.projector[1].weight.dtype)).last_hidden_state
        return self.projector(pixel_shuffle(patches)).reshape(b, -1, self.projector[-1].out_features)


def language_model(a: GrootArch):
    """A Qwen3 decoder with ``lm_layers`` blocks (GR00T's ``select_layer``), causal, no LM head."""
    from transformers import Qwen3Config, Qwen3Model

    cfg = Qwen3Config(
        vocab_size=a.vocab_size, hidden_size=a.lm_hidden, intermediate_size=a.lm_intermediate,
        num_hidden_layers=a.lm_layers, num_attention_heads=a.lm_heads, num_key_value_heads=a.lm_kv_heads,
        head_dim=a.lm_head_dim, max_position_embeddings=4096, use_cache=False, pad_token_id=0, attention_dropout=0.0,
    )
    cfg._attn_implementation = "sdpa"
    return Qwen3Model(cfg)


class EagleBackbone(nn.Module):
    """Images + task tokens → VLM token features (B, L, lm_hidden) and their mask (B, L)."""

    def __init__(self, a: GrootArch):
        super().__init__()
        self.vision = VisionEncoder(a)
        self.language = language_model(a)

    def forward(self, images: torch.Tensor, tokens: torch.Tensor, token_mask: torch.Tensor):
        img = self.vision(images)
        text = self.language.embed_tokens(tokens).to(img.dtype)
        mask = torch.cat([torch.ones(img.shape[:2], dtype=torch.long, device=img.device), token_mask.long()], dim=1)
        out = self.language(inputs_embeds=torch.cat([img, text], dim=1), attention_mask=mask).last_hidden_state
        return out, mask.bool()
