"""Architecture of the GR00T-N1.5-style policy: sizes only, no torch (recipes and presets resolve here).

LeRobot config of the GR00T-style policy, registered as policy type ``loongforge_groot``.

Importing ``{Cfg}`` from this module registers the type with LeRobot's config registry, after which
``lerobot.policies.factory.get_policy_class("loongforge_groot")`` and ``PreTrainedConfig.from_pretrained``
find it (LeRobot's convention: ``configuration_x`` → ``modeling_x`` in the same package). LeRobot's own GR00T
port is type ``groot``; this one is ours (random-init VLM, our weights layout).
NOTE: LeRobot's config class is made on first access (module ``__getattr__``): resolving a preset for a recipe
imports neither lerobot nor torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from loongforge_embodied.policies.arch import ArchMixin
from loongforge_embodied.policies.byte_tokens import BYTE_VOCAB, TEXT_OFFSET

# NOTE: the same byte tokenizer as tiny_vla (``byte_tokens``): 0 = pad, 1..256 = UTF-8 bytes of the task.


@dataclass(frozen=True)
class GrootArch(ArchMixin):
    """Sizes of the two halves of GR00T N1.5.

    ``vision`` + ``language`` (the Eagle-style VLM backbone): SigLIP tower → 2×2 pixel shuffle → MLP projector →
    a Qwen3 LM cut after ``lm_layers`` blocks (GR00T keeps layers up to ``select_layer`` = 12 and drops the rest).
    ``expert`` (the flow-matching action head): LayerNorm + ``vl_layers`` self-attention blocks over the VLM
    tokens, per-embodiment state / action encoders, a DiT of ``dit_layers`` AdaLN blocks alternating cross- and
    self-attention, a per-embodiment action decoder. ``state_dim``/``action_dim``/``num_cameras`` come from the
    dataset and are zero-padded to ``max_state_dim``/``max_action_dim`` (weights are shared across embodiments
    of different sizes, as in GR00T).
    """

    may_be_zero: ClassVar[tuple[str, ...]] = ("extra_vocab", "embodiment_id")

    image_size: int = 64
    patch_size: int = 8
    num_cameras: int = 1
    vision_hidden: int = 32
    vision_layers: int = 2
    vision_heads: int = 2
    vision_intermediate: int = 64
    lm_hidden: int = 64
    lm_layers: int = 2
    lm_heads: int = 2
    lm_kv_heads: int = 1
    lm_head_dim: int = 32
    lm_intermediate: int = 128
    max_text_tokens: int = 16
    extra_vocab: int = 0  # padding rows of the embedding (Qwen3's vocabulary is 151,936)
    vl_layers: int = 1
    vl_heads: int = 2
    dit_layers: int = 2
    dit_heads: int = 2
    dit_head_dim: int = 32
    hidden: int = 64  # GR00T's ``hidden_size``: DiT output, state-encoder and action-decoder hidden width
    future_tokens: int = 4  # GR00T's ``num_target_vision_tokens``: learned queries between state and actions
    num_embodiments: int = 4
    embodiment_id: int = 0  # the id this dataset trains (GR00T's ``new_embodiment`` tag is 31)
    max_state_dim: int = 8
    max_action_dim: int = 4
    state_dim: int = 2
    action_dim: int = 2
    chunk_size: int = 8  # GR00T's ``action_horizon``
    num_inference_steps: int = 4
    timestep_buckets: int = 1000
    stats: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        problems = []
        if self.state_dim > self.max_state_dim:
            problems.append(f"state_dim {self.state_dim} > max_state_dim {self.max_state_dim}")
        if self.action_dim > self.max_action_dim:
            problems.append(f"action_dim {self.action_dim} > max_action_dim {self.max_action_dim}")
        if not 0 <= self.embodiment_id < self.num_embodiments:
            problems.append(f"embodiment_id {self.embodiment_id} not in [0, num_embodiments={self.num_embodiments})")
        if (self.image_size // self.patch_size) % 2:
            problems.append(f"image_size / patch_size = {self.image_size // self.patch_size} must be even "
                            "(2x2 pixel shuffle)")
        if self.lm_hidden % self.vl_heads:
            problems.append(f"lm_hidden {self.lm_hidden} is not divisible by vl_heads {self.vl_heads}")
        if problems:
            raise ValueError("invalid groot architecture: " + "; ".join(problems))

    @property
    def vocab_size(self) -> int:
        return TEXT_OFFSET + BYTE_VOCAB + self.extra_vocab

    @property
    def image_tokens(self) -> int:
        """VLM tokens per sample from the cameras (after the 2×2 pixel shuffle)."""
        return self.num_cameras * (self.image_size // self.patch_size) ** 2 // 4

    @property
    def dit_dim(self) -> int:
        """GR00T's ``input_embedding_dim``: width of the state / future / action tokens in the DiT."""
        return self.dit_heads * self.dit_head_dim


PRESETS: dict[str, GrootArch] = {
    # Trains on CPU in seconds: ~0.42M parameters.
    "tiny": GrootArch(),
    # The shape of GR00T N1.5 (Eagle 2.5: SigLIP2 So400m/14 at 224² + Qwen3-1.7B cut at layer 12; action head:
    # 4 VL self-attention blocks, 16-block DiT at 32×48 = 1536 wide, 32 embodiments): ~2.4B parameters, of which
    # ~1.3B backbone (311M of it the 151,936-row embedding) and ~1.1B action head. For GPU benchmarks.
    "n1.5": GrootArch(
        image_size=224, patch_size=14, num_cameras=1,
        vision_hidden=1152, vision_layers=27, vision_heads=16, vision_intermediate=4304,
        lm_hidden=2048, lm_layers=12, lm_heads=16, lm_kv_heads=8, lm_head_dim=128, lm_intermediate=6144,
        max_text_tokens=64, extra_vocab=151936 - (TEXT_OFFSET + BYTE_VOCAB),
        vl_layers=4, vl_heads=32, dit_layers=16, dit_heads=32, dit_head_dim=48, hidden=1024, future_tokens=32,
        num_embodiments=32, embodiment_id=31, max_state_dim=64, max_action_dim=32, state_dim=32, action_dim=32,
        chunk_size=16,
    ),
}


def _lerobot_config() -> type:
    from dataclasses import dataclass, field

    from lerobot.configs.policies import PreTrainedConfig

    from loongforge_embodied.policies.lerobot_glue import ArchPolicyConfig, mirror_arch

    @PreTrainedConfig.register_subclass("loongforge_groot")
    @dataclass
    @mirror_arch(GrootArch)
    class GrootConfig(ArchPolicyConfig):
        """Mirror of :class:`GrootArch` (its fields, declared by ``mirror_arch`` so draccus can (de)serialise
        them) + LeRobot's keys."""

        n_action_steps: int = 8
        camera_keys: list[str] = field(default_factory=lambda: ["observation.image"])
        push_to_hub: bool = False
        optimizer_lr: float = 1e-4

    GrootConfig.__module__, GrootConfig.__qualname__ = __name__, "GrootConfig"
    return GrootConfig


def __getattr__(name: str):
    if name == "GrootConfig":
        cls = globals()[name] = _lerobot_config()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
