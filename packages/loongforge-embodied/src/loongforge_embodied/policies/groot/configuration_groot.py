"""LeRobot config of the GR00T-style policy, registered as policy type ``loongforge_groot``.

Importing this module registers the type with LeRobot's config registry, after which
``lerobot.policies.factory.get_policy_class("loongforge_groot")`` and ``PreTrainedConfig.from_pretrained``
find it (LeRobot's convention: ``configuration_x`` → ``modeling_x`` in the same package). LeRobot's own GR00T
port is type ``groot``; this one is ours (random-init VLM, our weights layout).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lerobot.configs.policies import PreTrainedConfig

from loongforge_embodied.policies.groot.config import GrootArch
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
