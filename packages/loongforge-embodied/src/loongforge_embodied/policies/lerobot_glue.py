"""Our policies as LeRobot policies: the shared body of every ``configuration_<name>.py`` (a ``PreTrainedConfig``
that mirrors the policy's size dataclass) and ``modeling_<name>.py`` (a ``PreTrainedPolicy`` over our model).

Imports LeRobot: only those LeRobot-facing modules import this one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import MISSING, field
from typing import ClassVar

import torch
from lerobot.configs.policies import PreTrainedConfig
from lerobot.optim.optimizers import AdamWConfig

from loongforge_embodied.policies.arch import ArchMixin


def state_key(input_features: dict) -> str:
    """The key of a config's STATE input feature (``observation.state`` unless the run read another:
    ``data.state_key``)."""
    from lerobot.configs.types import FeatureType

    return next((k for k, f in input_features.items() if f.type is FeatureType.STATE), "observation.state")


def mirror_arch(arch_class: type[ArchMixin]) -> Callable[[type], type]:
    """Class decorator, placed below ``@dataclass``: declare every size field of ``arch_class`` (name, type,
    default) ahead of the class's own LeRobot keys.

    The sizes become explicit dataclass fields, so draccus (de)serialises them and ``config.json`` lists them
    first, as a hand-written mirror would; a field added to the arch reaches the config and the export by itself.
    """

    def wrap(cls: type) -> type:
        own = cls.__dict__.get("__annotations__", {})
        sizes = arch_class.size_fields()
        clash = sorted({f.name for f in sizes} & set(own))
        if clash:
            raise TypeError(f"{cls.__name__} redeclares {clash}: they come from {arch_class.__name__}")
        for f in sizes:
            if f.default_factory is not MISSING:
                setattr(cls, f.name, field(default_factory=f.default_factory))
            elif f.default is not MISSING:
                setattr(cls, f.name, f.default)
        cls.__annotations__ = {**{f.name: f.type for f in sizes}, **own}
        cls.arch_class = arch_class
        return cls

    return wrap


class ArchPolicyConfig(PreTrainedConfig):
    """LeRobot's hooks for a config made with :func:`mirror_arch` (which also sets ``arch_class``): chunked
    actions, no observation or reward history, AdamW at ``optimizer_lr``, no scheduler. A subclass declares
    ``n_action_steps``, ``camera_keys`` and ``optimizer_lr``."""

    arch_class: ClassVar[type[ArchMixin]]

    def arch(self) -> ArchMixin:
        """The size dataclass these fields mirror."""
        return self.arch_class(**{f.name: getattr(self, f.name) for f in self.arch_class.size_fields()})

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


class ArchPolicyMixin:
    """Our model (``self.model``: the export's ``model.`` prefix) behind LeRobot's policy interface, taking
    LeRobot-style raw batches (``observation.*``, ``task``, ``action``). Normalisation statistics live in the
    model's buffers, so an exported directory is self-contained.

    Use as ``class XPolicy(ArchPolicyMixin, PreTrainedPolicy)`` (a mixin: LeRobot requires ``config_class`` and
    ``name`` on every ``PreTrainedPolicy`` subclass), setting those two and ``model_class``, ``stat_keys`` (the
    model's statistics buffers) and ``prepare_batch`` (the policy's processor, as a ``staticmethod``).
    """

    model_class: ClassVar[type[torch.nn.Module]]
    stat_keys: ClassVar[tuple[str, ...]]
    prepare_batch: ClassVar[Callable[..., dict[str, torch.Tensor]]]

    def __init__(self, config: ArchPolicyConfig, **kwargs):
        super().__init__(config)
        self.model = self.model_class(config.arch())
        self._queue: deque[torch.Tensor] = deque(maxlen=config.n_action_steps)

    @classmethod
    def _load_as_safetensor(cls, model, model_file: str, map_location: str, strict: bool):
        """LeRobot's loader, with SigLIP's names mapped to the installed transformers' layout (``siglip_names``)."""
        from lerobot.policies.utils import log_model_loading_keys
        from lerobot.utils.device_utils import resolve_safetensors_device
        from safetensors.torch import load_file

        from loongforge_embodied.policies import siglip_names

        sd = load_file(model_file, device=resolve_safetensors_device(map_location))
        missing, unexpected = model.load_state_dict(siglip_names.match(sd, model.state_dict().keys()), strict=strict)
        log_model_loading_keys(missing, unexpected)
        return model

    def get_optim_params(self):
        return self.parameters()

    def reset(self) -> None:
        self._queue.clear()

    def _raw(self, batch: dict) -> dict:
        """LeRobot's batch keys → the processor's raw keys (``images`` stacked over ``camera_keys``)."""
        state = batch[state_key(self.config.input_features)]
        raw = {"images": torch.stack([batch[k] for k in self.config.camera_keys], dim=1), "state": state,
               "task": batch.get("task") or [""] * len(state)}
        if "action" in batch:
            raw["actions"] = batch["action"]
            raw["action_pad"] = batch.get("action_is_pad", torch.zeros(batch["action"].shape[:2], dtype=torch.bool,
                                                                        device=batch["action"].device))
        return raw

    def _inputs(self, batch: dict) -> dict[str, torch.Tensor]:
        stats = {k: getattr(self.model, k) for k in self.stat_keys}
        dev = stats["state_mean"].device
        raw = {k: (v.to(dev) if torch.is_tensor(v) else v) for k, v in self._raw(batch).items()}
        return {k: v.to(dev) for k, v in self.prepare_batch(raw, arch=self.model.arch, stats=stats).items()}

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
