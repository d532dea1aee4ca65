"""LeRobot policy wrapper of the GR00T-style policy: ``GrootPolicy.from_pretrained(dir)`` loads our export.

Takes LeRobot-style raw batches (``observation.*``, ``task``, ``action``, optional ``embodiment_id``);
normalisation statistics live in the model's buffers, so an exported directory is self-contained.
"""

from __future__ import annotations

from lerobot.policies.pretrained import PreTrainedPolicy

from loongforge_embodied.policies.groot.configuration_groot import GrootConfig
from loongforge_embodied.policies.groot.model import STAT_KEYS, GrootModel
from loongforge_embodied.policies.groot.processor_groot import prepare_batch
from loongforge_embodied.policies.lerobot_glue import ArchPolicyMixin


class GrootPolicy(ArchPolicyMixin, PreTrainedPolicy):
    config_class = GrootConfig
    name = "loongforge_groot"
    model_class = GrootModel
    stat_keys = STAT_KEYS
    prepare_batch = staticmethod(prepare_batch)

    def _raw(self, batch: dict) -> dict:
        return {**super()._raw(batch), "embodiment_id": batch.get("embodiment_id")}
