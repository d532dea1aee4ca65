"""Importing this module registers LoongForge's policy types with LeRobot's config registry (draccus choices), after
which ``PreTrainedConfig.from_pretrained``, ``get_policy_class`` and ``make_policy`` resolve them. LeRobot imports
it through ``register_third_party_plugins()``, found by this distribution's ``lerobot_policy_`` name."""

from __future__ import annotations

from loongforge_embodied.policies.groot.configuration_groot import GrootConfig
from loongforge_embodied.policies.tiny_vla.configuration_tiny_vla import TinyVLAConfig

__all__ = ["GrootConfig", "TinyVLAConfig"]
