"""LeRobot config of the tiny VLA, registered as policy type ``loongforge_tiny_vla``.

Importing this module registers the type with LeRobot's config registry, after which
``lerobot.policies.factory.get_policy_class("loongforge_tiny_vla")`` and ``PreTrainedConfig.from_pretrained``
find it (LeRobot's convention: ``configuration_x`` → ``modeling_x`` in the same package).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lerobot.configs.policies import PreTrainedConfig

from loongforge_embodied.policies.lerobot_glue import ArchPolicyConfig, mirror_arch
from loongforge_embodied.policies.tiny_vla.config import TinyVLAArch


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
