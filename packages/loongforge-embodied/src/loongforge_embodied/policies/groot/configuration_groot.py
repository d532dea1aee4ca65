"""LeRobot config of the GR00T-style policy, registered as policy type ``loongforge_groot``.

Importing this module registers the type with LeRobot's config registry, after which
``lerobot.policies.factory.get_policy_class("loongforge_groot")`` and ``PreTrainedConfig.from_pretrained``
find it (LeRobot's convention: ``configuration_x`` → ``modeling_x`` in the same package). LeRobot's own GR00T
port is type ``groot``; this one is ours (random-init VLM, our weights layout).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from lerobot.configs.policies import PreTrainedConfig
from lerobot.optim.optimizers import AdamWConfig

from loongforge_embodied.policies.groot.config import GrootArch


@PreTrainedConfig.register_subclass("loongforge_groot")
@dataclass
class GrootConfig(PreTrainedConfig):
    """Mirror of :class:`GrootArch` (explicit fields so draccus can (de)serialise it) + LeRobot's keys."""

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
    extra_vocab: int = 0
    vl_layers: int = 1
    vl_heads: int = 2
    dit_layers: int = 2
    dit_heads: int = 2
    dit_head_dim: int = 32
    hidden: int = 64
    future_tokens: int = 4
    num_embodiments: int = 4
    embodiment_id: int = 0
    max_state_dim: int = 8
    max_action_dim: int = 4
    state_dim: int = 2
    action_dim: int = 2
    chunk_size: int = 8
    num_inference_steps: int = 4
    timestep_buckets: int = 1000
    n_action_steps: int = 8
    camera_keys: list[str] = field(default_factory=lambda: ["observation.image"])
    push_to_hub: bool = False
    optimizer_lr: float = 1e-4

    def arch(self) -> GrootArch:
        return GrootArch(**{f.name: getattr(self, f.name) for f in fields(GrootArch) if f.name != "stats"})

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
