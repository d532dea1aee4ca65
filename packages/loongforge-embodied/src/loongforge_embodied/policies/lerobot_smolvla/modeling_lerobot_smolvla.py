"""LeRobot's own SmolVLA (``VLAFlowMatching``) as a policy of our trainer.

``self.model`` is LeRobot's module, so parameter names are exactly ``SmolVLAPolicy``'s (``model.…``) and an export
loads with ``SmolVLAPolicy.from_pretrained``. The loss is ``SmolVLAPolicy.forward(batch, reduction="none")``'s,
without its ``.item()`` logging: ``VLAFlowMatching.forward`` → truncate to the dataset's action dims → chunk steps
past the episode's end masked out → per sample, the mean over the valid (step, dim) entries. Noise and flow time
come from the batch (drawn per sample by the data pipeline, SmolVLA's Beta(1.5, 1) law).

What cannot reach the loss stays frozen as LeRobot freezes it (``lm_head``s, the VLM's final norm and last layer);
``model.freeze: [vision, language]`` is LeRobot's default ``train_expert_only`` (the published recipe's).
"""

from __future__ import annotations

import torch
from torch import nn

from loongforge_embodied.policies.lerobot_smolvla.configuration_lerobot_smolvla import LeRobotSmolVLAArch

STAT_KEYS = ("state_mean", "state_std", "action_mean", "action_std")


class _Stats(nn.Module):
    """Normalisation statistics as buffers (``stats.*``): saved with checkpoints, written to the export's
    ``loongforge.json`` (not to ``model.safetensors``, whose names are LeRobot's). Sized by the padded ``max_*_dim``
    so a checkpoint of another dataset still loads."""

    def __init__(self, arch: LeRobotSmolVLAArch):
        super().__init__()
        for key in STAT_KEYS:
            dim = arch.max_state_dim if key.startswith("state") else arch.max_action_dim
            self.register_buffer(key, torch.full((dim,), 1.0 if key.endswith("std") else 0.0))


class LeRobotSmolVLAModel(nn.Module):
    """Components ``vision`` (SmolVLM's vision encoder + connector), ``language`` (its text model) and ``expert``
    (the action expert, state / action / time projections). ``wrap_units()``: the vision encoder layers (LeRobot's
    joint VLM / expert step calls the text and expert layers' submodules, never the layers: those stay in the root
    unit)."""

    def __init__(self, arch: LeRobotSmolVLAArch):
        super().__init__()
        from loongforge_embodied.policies.lerobot_smolvla.build import build_smolvla

        self.arch = arch
        self.model, self.config = build_smolvla(arch)
        self.stats = _Stats(arch)

    # ----------------------------------------------------------------- structure
    @property
    def _vlm(self):
        return self.model.vlm_with_expert.vlm.model

    def components(self) -> dict[str, list[nn.Module]]:
        """Named parameter groups (``model.freeze`` takes these names)."""
        m = self.model
        return {"vision": [self._vlm.vision_model, self._vlm.connector], "language": [self._vlm.text_model],
                "expert": [m.vlm_with_expert.lm_expert, m.state_proj, m.action_in_proj, m.action_out_proj,
                           m.action_time_mlp_in, m.action_time_mlp_out]}

    def wrap_units(self) -> list[nn.Module]:
        """FSDP2 / compile units in execution order: the vision encoder layers."""
        return list(self._vlm.vision_model.encoder.layers)

    def enable_activation_checkpointing(self) -> None:
        """Recompute in backward: per vision encoder layer (transformers') and the joint VLM / expert stack as one
        checkpoint (LeRobot's SmolVLA has no checkpointing of its own; its stack is one function)."""
        from torch.utils.checkpoint import checkpoint

        self.model.vlm_with_expert.vlm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        joint = self.model.vlm_with_expert
        forward = type(joint).forward.__get__(joint)

        def checkpointed(**kw):
            if torch.is_grad_enabled() and not kw.get("use_cache"):
                return checkpoint(forward, use_reentrant=False, **kw)
            return forward(**kw)

        joint.forward = checkpointed  # NOTE: LeRobot calls ``vlm_with_expert.forward(...)`` by name

    def set_stats(self, stats: dict[str, torch.Tensor]) -> None:
        for key in STAT_KEYS:
            if key in stats:
                value = torch.as_tensor(stats[key], dtype=torch.float32).flatten()
                getattr(self.stats, key)[: value.numel()].copy_(value)

    def stats_dict(self) -> dict[str, torch.Tensor]:
        """The dataset's statistics (unpadded)."""
        a = self.arch
        return {k: getattr(self.stats, k)[: a.state_dim if k.startswith("state") else a.action_dim] for k in STAT_KEYS}

    # ----------------------------------------------------------------- forward
    def _inputs(self, batch: dict[str, torch.Tensor]):
        images = batch["images"]  # (B, cams, 3, res, res) in [-1, 1] (the processor resized and shifted them)
        b, cams = images.shape[:2]
        ones = torch.ones(b, dtype=torch.bool, device=images.device)
        return ([images[:, i] for i in range(cams)], [ones] * cams, batch["lang_tokens"], batch["lang_mask"],
                batch["state"])

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-sample loss (B,): ``SmolVLAPolicy.forward(batch, reduction="none")`` without host syncs."""
        losses = self.model(*self._inputs(batch), batch["actions"], batch["noise"], batch["time"])
        losses = losses[:, :, : self.arch.action_dim]
        pad = batch.get("action_pad")
        if pad is None:
            return losses.mean(dim=(1, 2))
        losses = losses * (~pad).unsqueeze(-1)
        valid = ((~pad).sum(dim=1) * losses.shape[-1]).clamp_min(1)
        return losses.sum(dim=(1, 2)) / valid

    @torch.no_grad()
    def sample_actions(self, batch: dict[str, torch.Tensor], *, steps: int | None = None,
                       noise: torch.Tensor | None = None) -> torch.Tensor:
        """LeRobot's Euler sampler (KV-cached prefix); normalised actions (B, chunk, action_dim). ``noise``: the
        starting noise (B, chunk, action_dim or max_action_dim)."""
        from loongforge.accelerator.adaptation import active

        from loongforge_embodied.policies.flow_noise import pad_noise
        from loongforge_embodied.policies.lerobot_smolvla.build import adaptations

        needed = [a.name for a in adaptations() if a.name not in active()]
        if needed:
            raise RuntimeError(f"LeRobotSmolVLAModel samples with its adaptations applied ({', '.join(needed)}): use "
                               "`with loongforge_embodied.policies.lerobot_smolvla.build.adapted(): ...`")
        if noise is not None:
            noise = pad_noise(noise, self.arch.max_action_dim)
        saved = self.config.num_steps
        self.config.num_steps = steps or saved
        try:
            out = self.model.sample_actions(*self._inputs(batch), noise=noise)
        finally:
            self.config.num_steps = saved
        return out[:, :, : self.arch.action_dim]

    def unnormalize_actions(self, actions: torch.Tensor) -> torch.Tensor:
        from loongforge_embodied.policies.lerobot_smolvla.processor_lerobot_smolvla import unnormalize

        return unnormalize(actions, "action", stats=self.stats_dict())


def adaptations() -> list:
    """What a run of this policy applies through the adaptation door (``build.adaptations``)."""
    from loongforge_embodied.policies.lerobot_smolvla.build import adaptations as smolvla_adaptations

    return smolvla_adaptations()
