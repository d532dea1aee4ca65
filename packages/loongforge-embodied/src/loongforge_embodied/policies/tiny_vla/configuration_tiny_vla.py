"""LeRobot config of the tiny VLA, registered as policy type ``loongforge_tiny_vla``.

Importing this module registers the type with LeRobot's config registry, after which
``lerobot.policies.factory.get_policy_class("loongforge_tiny_vla")`` and ``PreTrainedConfig.from_pretrained``
find it (LeRobot's convention: ``configuration_x`` → ``modeling_x`` in the same package).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from lerobot.configs.policies import PreTrainedConfig
from lerobot.optim.optimizers import AdamWConfig

from loongforge_embodied.policies.tiny_vla.config import TinyVLAArch


@PreTrainedConfig.register_subclass("loongforge_tiny_vla")
@dataclass
class TinyVLAConfig(PreTrainedConfig):
    """Mirror of :class:`TinyVLAArch` (explicit fields so draccus can (de)serialise it) + LeRobot's keys."""

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
    extra_vocab: int = 0
    n_action_steps: int = 8
    camera_keys: list[str] = field(default_factory=lambda: ["observation.image"])
    push_to_hub: bool = False
    optimizer_lr: float = 3e-4

    def arch(self) -> TinyVLAArch:
        return TinyVLAArch(**{f.name: getattr(self, f.name) for f in fields(TinyVLAArch) if f.name != "stats"})

    @property
    def observation_delta_indices(self) -> None:
        return None

    @property
    def action_delta_indices(self) -> list[int]:
        return list(range(self.chunk_size))

    @property
    def reward_delta_indices(self) -> None:
        return None

    def get_optimizer_preset(self) -> AdamWConfig:
        return AdamWConfig(lr=self.optimizer_lr)

    def get_scheduler_preset(self) -> None:
        return None

    def validate_features(self) -> None:
        if self.n_action_steps > self.chunk_size:
            raise ValueError(f"n_action_steps ({self.n_action_steps}) exceeds chunk_size ({self.chunk_size})")
