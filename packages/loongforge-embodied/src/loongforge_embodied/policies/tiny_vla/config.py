"""Architecture of the tiny pi05-style VLA: sizes only, no torch (recipes and presets resolve here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from loongforge_embodied.policies.arch import ArchMixin
from loongforge_embodied.policies.byte_tokens import BYTE_VOCAB, TEXT_OFFSET

# NOTE: token ids: 0 = pad, 1..256 = UTF-8 bytes of the task (``byte_tokens``), then ``state_bins`` ids for the
# discretised state (pi05 puts the proprioceptive state into the language prefix as tokens instead of a
# continuous projection).


@dataclass(frozen=True)
class TinyVLAArch(ArchMixin):
    """Sizes of the three components: ``vision`` (SigLIP), ``language`` (Gemma prefix), ``expert`` (Gemma
    flow-matching action expert). ``state_dim``/``action_dim``/``num_cameras`` come from the dataset."""

    may_be_zero: ClassVar[tuple[str, ...]] = ("extra_vocab",)

    image_size: int = 64
    patch_size: int = 16
    num_cameras: int = 1
    vision_hidden: int = 64
    vision_layers: int = 2
    vision_heads: int = 2
    vision_intermediate: int = 128
    lm_hidden: int = 64
    lm_layers: int = 2
    lm_heads: int = 2
    lm_kv_heads: int = 1
    lm_head_dim: int = 32
    lm_intermediate: int = 128
    expert_hidden: int = 64
    expert_layers: int = 2
    expert_heads: int = 2
    expert_kv_heads: int = 1
    expert_head_dim: int = 32
    expert_intermediate: int = 128
    max_text_tokens: int = 16
    state_bins: int = 64
    state_dim: int = 2
    action_dim: int = 2
    chunk_size: int = 8
    num_inference_steps: int = 10
    extra_vocab: int = 0  # padding rows of the embedding (pi05's Gemma vocabulary is 257,152)
    stats: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def vocab_size(self) -> int:
        return TEXT_OFFSET + BYTE_VOCAB + self.state_bins + self.extra_vocab

    @property
    def image_tokens(self) -> int:
        return self.num_cameras * (self.image_size // self.patch_size) ** 2


PRESETS: dict[str, TinyVLAArch] = {
    # Trains on CPU in seconds: ~0.4M parameters.
    "tiny": TinyVLAArch(),
    # The shape of pi05 (PaliGemma 2B + Gemma 300M expert, SigLIP So400m/14 at 224²): for GPU benchmarks.
    "pi05": TinyVLAArch(
        image_size=224, patch_size=14, num_cameras=2,
        vision_hidden=1152, vision_layers=27, vision_heads=16, vision_intermediate=4304,
        lm_hidden=2048, lm_layers=18, lm_heads=8, lm_kv_heads=1, lm_head_dim=256, lm_intermediate=16384,
        expert_hidden=1024, expert_layers=18, expert_heads=8, expert_kv_heads=1, expert_head_dim=256,
        expert_intermediate=4096, max_text_tokens=200, state_bins=256, state_dim=32, action_dim=32,
        chunk_size=50, extra_vocab=257152 - (TEXT_OFFSET + BYTE_VOCAB + 256),
    ),
}
