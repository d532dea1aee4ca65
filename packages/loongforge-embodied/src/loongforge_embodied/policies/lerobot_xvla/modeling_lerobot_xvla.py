"""LeRobot's own X-VLA (``XVLAModel``) as a policy of our trainer.

``self.model`` is LeRobot's module, so parameter names are exactly ``XVLAPolicy``'s (``model.…``) and an export
loads with ``XVLAPolicy.from_pretrained``. The loss is ``XVLAModel.forward``'s: Florence-2 encodes the primary
view with the prompt (``forward_vlm``), the noisy chunk ``noise * t + actions * (1 - t)`` goes through the action
space's ``preprocess`` and the soft-prompted transformer, and the action space's ``compute_loss`` (MSE, plus BCE on
gripper channels for ``ee6d`` / ``joint``) is summed over its terms. LeRobot's terms are means over the batch, so
per sample we take the same terms over that sample alone: their batch mean is LeRobot's loss. Noise and flow time
come from the batch (drawn per sample by the data pipeline: X-VLA's law is uniform time, no episode-end masking).
"""

from __future__ import annotations

import torch
from torch import nn

from loongforge_embodied.policies.lerobot_xvla.configuration_lerobot_xvla import LeRobotXVLAArch

STAT_KEYS = ("state_mean", "state_std", "action_mean", "action_std")


class _Stats(nn.Module):
    """Normalisation statistics as buffers (``stats.*``): saved with checkpoints, written to the export's
    ``loongforge.json`` (not to ``model.safetensors``, whose names are LeRobot's)."""

    def __init__(self, arch: LeRobotXVLAArch):
        super().__init__()
        for key in STAT_KEYS:
            dim = arch.max_state_dim if key.startswith("state") else arch.action_width
            self.register_buffer(key, torch.full((dim,), 1.0 if key.endswith("std") else 0.0))


class LeRobotXVLAModel(nn.Module):
    """Components ``vision`` (Florence-2's DaViT tower + its projector), ``language`` (the BART encoder and the
    shared token embedding) and ``expert`` (the soft-prompted transformer: what LeRobot's X-VLA fine-tunes at full
    rate). ``wrap_units()``: the DaViT blocks, the BART encoder layers and the transformer blocks."""

    def __init__(self, arch: LeRobotXVLAArch, *, florence: dict | None = None):
        super().__init__()
        from loongforge_embodied.policies.lerobot_xvla.build import build_xvla

        self.arch = arch
        self.model, self.config = build_xvla(arch, florence=florence)
        self.stats = _Stats(arch)

    # ----------------------------------------------------------------- structure
    def components(self) -> dict[str, list[nn.Module]]:
        """Named parameter groups (``model.freeze`` takes these names)."""
        vlm = self.model.vlm
        return {"vision": [vlm.vision_tower, vlm.multi_modal_projector], "language": [vlm.language_model],
                "expert": [self.model.transformer]}

    def wrap_units(self) -> list[nn.Module]:
        """FSDP2 / recompute units in execution order."""
        vlm = self.model.vlm
        davit = [block for stage in vlm.vision_tower.blocks for block in stage]  # NOTE: a ModuleList per stage
        return [*davit, *vlm.language_model.encoder.layers, *self.model.transformer.blocks]

    def enable_activation_checkpointing(self) -> None:
        """Recompute in backward, per unit of :meth:`wrap_units` (LeRobot's X-VLA has no checkpointing of its own)."""
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        units = set(map(id, self.wrap_units()))
        apply_activation_checkpointing(self.model, check_fn=lambda m: id(m) in units)

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
    def _encode(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.model.forward_vlm(batch["input_ids"], batch["images"], batch["image_mask"])

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-sample loss (B,); its mean is ``XVLAPolicy.forward``'s loss for the same noise and time."""
        m = self.model
        enc = self._encode(batch)
        actions, t = batch["actions"], batch["time"]
        noisy = batch["noise"] * t.view(-1, 1, 1) + actions * (1 - t).view(-1, 1, 1)
        proprio, noisy = m.action_space.preprocess(batch["state"], noisy)
        pred = m.transformer(domain_id=batch["domain_id"], action_with_noise=noisy, t=t, proprio=proprio, **enc)
        return torch.stack([sum(m.action_space.compute_loss(pred[i: i + 1], actions[i: i + 1]).values())
                            for i in range(pred.shape[0])])

    @torch.no_grad()
    def sample_actions(self, batch: dict[str, torch.Tensor], *, steps: int | None = None,
                       noise: torch.Tensor | None = None) -> torch.Tensor:
        """``XVLAModel.generate_actions`` from ``noise`` (B, chunk, ≤ the action width; default: drawn as LeRobot
        draws it); normalised actions (B, chunk, action_dim)."""
        from loongforge_embodied.policies.flow_noise import pad_noise

        m = self.model
        enc = self._encode(batch)
        b, width = batch["input_ids"].shape[0], m.dim_action
        if noise is None:
            noise = torch.randn(b, self.arch.chunk_size, width, device=batch["state"].device)
        x1 = pad_noise(noise.float(), width)[..., :width].to(batch["state"])
        action = torch.zeros_like(x1)
        steps = max(1, int(steps or self.arch.num_steps))
        for i in range(steps, 0, -1):
            t = torch.full((b,), i / steps, device=x1.device, dtype=x1.dtype)
            x_t = x1 * t.view(-1, 1, 1) + action * (1 - t).view(-1, 1, 1)
            proprio, x_t = m.action_space.preprocess(batch["state"], x_t)
            action = m.transformer(domain_id=batch["domain_id"], action_with_noise=x_t, proprio=proprio, t=t, **enc)
        return m.action_space.postprocess(action)[..., : self.arch.action_dim]

    def unnormalize_actions(self, actions: torch.Tensor) -> torch.Tensor:
        from loongforge_embodied.policies.lerobot_xvla.processor_lerobot_xvla import unnormalize

        return unnormalize(actions, arch=self.arch, stats=self.stats_dict())
