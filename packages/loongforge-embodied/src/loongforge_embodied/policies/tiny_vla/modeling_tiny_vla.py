"""LeRobot policy wrapper of the tiny VLA: ``TinyVLAPolicy.from_pretrained(dir)`` loads our export.

Takes LeRobot-style raw batches (``observation.*``, ``task``, ``action``); normalisation statistics live in the
model's buffers, so an exported directory is self-contained.
"""

from __future__ import annotations

from lerobot.policies.pretrained import PreTrainedPolicy

from loongforge_embodied.policies.lerobot_glue import ArchPolicyMixin
from loongforge_embodied.policies.tiny_vla.configuration_tiny_vla import TinyVLAConfig
from loongforge_embodied.policies.tiny_vla.model import STAT_KEYS, TinyVLAModel
from loongforge_embodied.policies.tiny_vla.processor_tiny_vla import prepare_batch


class TinyVLAPolicy(ArchPolicyMixin, PreTrainedPolicy):
    config_class = TinyVLAConfig
    name = "loongforge_tiny_vla"
    model_class = TinyVLAModel
    stat_keys = STAT_KEYS
    prepare_batch = staticmethod(prepare_batch)
