"""LeRobot policy wrapper of the GR00T-style policy: ``GrootPolicy.from_pretrained(dir)`` loads our export.

Takes LeRobot-style raw batches (``observation.*``, ``task``, ``action``, optional ``embodiment_id``);
normalisation statistics live in the model's buffers, so an exported directory is self-contained.
"""

from __future__ import annotations

from collections import deque

import torch
from lerobot.policies.pretrained import PreTrainedPolicy

from loongforge_embodied.policies.groot.configuration_groot import GrootConfig
from loongforge_embodied.policies.groot.model import STAT_KEYS, GrootModel
from loongforge_embodied.policies.groot.processor_groot import prepare_batch


class GrootPolicy(PreTrainedPolicy):
    config_class = GrootConfig
    name = "loongforge_groot"

    def __init__(self, config: GrootConfig, **kwargs):
        super().__init__(config)
        self.model = GrootModel(config.arch())
        self._queue: deque[torch.Tensor] = deque(maxlen=config.n_action_steps)

    def get_optim_params(self):
        return self.parameters()

    def reset(self) -> None:
        self._queue.clear()

    def _inputs(self, batch: dict) -> dict[str, torch.Tensor]:
        state = batch["observation.state"]
        raw = {"images": torch.stack([batch[k] for k in self.config.camera_keys], dim=1), "state": state,
               "task": batch.get("task") or [""] * len(state), "embodiment_id": batch.get("embodiment_id")}
        if "action" in batch:
            raw["actions"] = batch["action"]
            raw["action_pad"] = batch.get("action_is_pad", torch.zeros(batch["action"].shape[:2], dtype=torch.bool,
                                                                        device=batch["action"].device))
        stats = {k: getattr(self.model, k) for k in STAT_KEYS}
        dev = stats["state_mean"].device
        raw = {k: (v.to(dev) if torch.is_tensor(v) else v) for k, v in raw.items()}
        return {k: v.to(dev) for k, v in prepare_batch(raw, arch=self.model.arch, stats=stats).items()}

    def forward(self, batch: dict) -> tuple[torch.Tensor, dict]:
        loss = self.model(self._inputs(batch)).mean()
        return loss, {"loss": float(loss.detach())}

    @torch.no_grad()
    def predict_action_chunk(self, batch: dict, **kwargs) -> torch.Tensor:
        return self.model.unnormalize_actions(self.model.sample_actions(self._inputs(batch)))

    @torch.no_grad()
    def select_action(self, batch: dict, **kwargs) -> torch.Tensor:
        if not self._queue:
            chunk = self.predict_action_chunk(batch)[:, : self.config.n_action_steps]
            self._queue.extend(chunk.transpose(0, 1))
        return self._queue.popleft()
