"""The GR00T-N1.5-style policy: Eagle-style VLM backbone + flow-matching DiT action head (no LeRobot import).

Flow matching (pi0's convention, shared with tiny_vla and the data pipeline): x_τ = τ·noise + (1-τ)·action,
target velocity u = noise - action, τ = 0.001 + 0.999·s with s ~ Beta(1.5, 1) drawn per sample by the data
pipeline. GR00T writes the same path with t = 1 - τ (t = 0 is noise) and regresses action - noise; its
t = (0.999 - s)/0.999 is our τ up to the 0.001 margin at the ends. The DiT sees GR00T's discretised time
⌊t·1000⌋. The loss is the mean squared error over valid (chunk step, action dim) entries of each sample.
Inference integrates from τ = 1 to 0 with ``num_inference_steps`` (4) Euler steps.

LeRobot policy wrapper of the GR00T-style policy: ``GrootPolicy.from_pretrained(dir)`` loads our export.

Takes LeRobot-style raw batches (``observation.*``, ``task``, ``action``, optional ``embodiment_id``);
normalisation statistics live in the model's buffers, so an exported directory is self-contained.
NOTE: LeRobot's policy class is made on first access (module ``__getattr__``): training imports no lerobot here.
"""

from __future__ import annotations

import torch
from torch import nn

from loongforge_embodied.policies import siglip_names
from loongforge_embodied.policies.groot.action_head import FlowMatchingActionHead
from loongforge_embodied.policies.groot.backbone import EagleBackbone
from loongforge_embodied.policies.groot.configuration_groot import GrootArch

STAT_KEYS = ("state_mean", "state_std", "action_mean", "action_std")


class GrootModel(nn.Module):
    """Components ``vision``, ``language`` (the backbone) and ``expert`` (the action head); ``wrap_units()``
    lists the transformer blocks in execution order. Batches arrive normalised and padded (see ``processor``)."""

    def __init__(self, arch: GrootArch):
        super().__init__()
        self.arch = a = arch
        self.backbone = EagleBackbone(a)
        self.action_head = FlowMatchingActionHead(a)
        for key, dim in zip(STAT_KEYS, (a.state_dim, a.state_dim, a.action_dim, a.action_dim), strict=True):
            self.register_buffer(key, torch.ones(dim) if key.endswith("std") else torch.zeros(dim))

    # ----------------------------------------------------------------- structure
    def components(self) -> dict[str, list[nn.Module]]:
        """Named parameter groups (``model.freeze`` takes these names; GR00T N1.5 freezes vision + language)."""
        return {"vision": [self.backbone.vision], "language": [self.backbone.language], "expert": [self.action_head]}

    def wrap_units(self) -> list[nn.Module]:
        """Transformer blocks in execution order: FSDP2 shards and activation checkpointing apply per block."""
        return [*siglip_names.encoder_layers(self.backbone.vision.tower), *self.backbone.language.layers,
                *self.action_head.blocks()]

    def enable_activation_checkpointing(self) -> None:
        for m in (self.backbone.vision.tower, self.backbone.language):
            m.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        self.action_head.set_checkpointing(True)

    def set_stats(self, stats: dict[str, torch.Tensor]) -> None:
        """Normalisation statistics, kept as buffers so an exported checkpoint can un-normalise actions."""
        for key in STAT_KEYS:
            if key in stats:
                getattr(self, key).copy_(torch.as_tensor(stats[key], dtype=torch.float32))

    # ----------------------------------------------------------------- forward
    def encode(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """VLM tokens after the head's LayerNorm + self-attention, and their key mask."""
        vl, mask = self.backbone(batch["images"], batch["lang_tokens"], batch["lang_mask"])
        return self.action_head.encode_context(vl, mask), mask

    def _timesteps(self, tau: torch.Tensor) -> torch.Tensor:
        buckets = self.arch.timestep_buckets
        return ((1.0 - tau) * buckets).long().clamp(0, buckets - 1)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-sample flow-matching loss (B,) over the valid chunk steps and action dims.

        ``noise``/``time`` come from the batch when present (the data pipeline draws them per sample so losses
        do not depend on how the global batch is split over ranks), else they are sampled here."""
        actions, valid = batch["actions"], batch["action_mask"].float()
        noise = batch.get("noise")
        if noise is None:
            noise = torch.randn_like(actions) * valid
        tau = batch.get("time")
        if tau is None:
            tau = torch.distributions.Beta(1.5, 1.0).sample((actions.shape[0],)).to(actions.device) * 0.999 + 0.001
        x_t = tau[:, None, None] * noise + (1 - tau[:, None, None]) * actions
        context, mask = self.encode(batch)
        v = self.action_head(context, mask, batch["state"], x_t, self._timesteps(tau), batch["embodiment"]).float()
        err = (v - (noise - actions)).pow(2) * valid
        return err.sum((1, 2)) / valid.sum((1, 2)).clamp_min(1.0)

    @torch.no_grad()
    def sample_actions(self, batch: dict[str, torch.Tensor], *, steps: int | None = None,
                       noise: torch.Tensor | None = None) -> torch.Tensor:
        """Integrate the flow from noise (τ=1) to actions (τ=0) with Euler steps; returns normalised actions
        (B, chunk_size, action_dim). Padded action dims are held at zero, as in training."""
        a = self.arch
        steps = steps or a.num_inference_steps
        b, dev = batch["state"].shape[0], batch["state"].device
        dims = (torch.arange(a.max_action_dim, device=dev) < a.action_dim).float()
        x = (torch.randn(b, a.chunk_size, a.max_action_dim, device=dev) if noise is None else noise) * dims
        context, mask = self.encode(batch)
        for i in range(steps):
            tau = torch.full((b,), 1.0 - i / steps, device=dev)
            v = self.action_head(context, mask, batch["state"], x, self._timesteps(tau), batch["embodiment"])
            x = (x - v.float() / steps) * dims
        return x[..., : a.action_dim]

    def unnormalize_actions(self, actions: torch.Tensor) -> torch.Tensor:
        return actions * self.action_std + self.action_mean


def _lerobot_policy() -> type:
    from lerobot.policies.pretrained import PreTrainedPolicy

    from loongforge_embodied.policies.groot.configuration_groot import GrootConfig
    from loongforge_embodied.policies.groot.processor_groot import prepare_batch as prepare
    from loongforge_embodied.policies.lerobot_glue import ArchPolicyMixin

    class GrootPolicy(ArchPolicyMixin, PreTrainedPolicy):
        config_class = GrootConfig
        name = "loongforge_groot"
        model_class = GrootModel
        stat_keys = STAT_KEYS
        prepare_batch = staticmethod(prepare)

        def _raw(self, batch: dict) -> dict:
            return {**super()._raw(batch), "embodiment_id": batch.get("embodiment_id")}

    GrootPolicy.__module__, GrootPolicy.__qualname__ = __name__, "GrootPolicy"
    return GrootPolicy


def __getattr__(name: str):
    if name == "GrootPolicy":
        cls = globals()[name] = _lerobot_policy()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
