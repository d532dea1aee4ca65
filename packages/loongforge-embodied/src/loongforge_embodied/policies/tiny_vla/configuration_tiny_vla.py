"""Architecture of the tiny pi05-style VLA: sizes only, no torch (recipes and presets resolve here).

LeRobot config of the tiny VLA, registered as policy type ``loongforge_tiny_vla``.

Importing ``{Cfg}`` from this module registers the type with LeRobot's config registry, after which
``lerobot.policies.factory.get_policy_class("loongforge_tiny_vla")`` and ``PreTrainedConfig.from_pretrained``
find it (LeRobot's convention: ``configuration_x`` → ``modeling_x`` in the same package).
NOTE: LeRobot's config class is made on first access (module ``__getattr__``): resolving a preset for a recipe
imports neither lerobot nor torch.
"""

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
    # NOTE: "tokens": pi05's discretised state in the language prefix (``state_bins`` ids, one per dimension);
    # "linear": pi0's continuous projection, one prefix token (exact to the float: precise tasks such as PushT's
    # last few pixels, which learned bin embeddings without order resolve poorly from a few hundred episodes).
    state_input: str = "tokens"
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


def _lerobot_config() -> type:
    from dataclasses import dataclass, field

    from lerobot.configs.policies import PreTrainedConfig

    from loongforge_embodied.policies.lerobot_glue import ArchPolicyConfig, mirror_arch

    @PreTrainedConfig.register_subclass("loongforge_tiny_vla")
    @dataclass
    @mirror_arch(TinyVLAArch)
    class TinyVLAConfig(ArchPolicyConfig):
        """Mirror of :class:`TinyVLAArch` (its fields, declared by ``mirror_arch`` so draccus can (de)serialise
        them) + LeRobot's keys."""

        n_action_steps: int = 8
        camera_keys: list[str] = field(default_factory=lambda: ["observation.image"])
        push_to_hub: bool = False
        optimizer_lr: float = 3e-4

    TinyVLAConfig.__module__, TinyVLAConfig.__qualname__ = __name__, "TinyVLAConfig"
    return TinyVLAConfig


def __getattr__(name: str):
    if name == "TinyVLAConfig":
        cls = globals()[name] = _lerobot_config()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
