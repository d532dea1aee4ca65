"""LeRobot's own GR00T N1.7 (``GR00TN17``) as a policy of our trainer.

``self._groot_model`` is LeRobot's module, so parameter names are exactly ``GrootPolicy``'s (``_groot_model.…``) and
an export loads with ``GrootPolicy.from_pretrained``. The loss is ``GR00TN17.forward``'s flow-matching velocity MSE,
with the noise and flow time taken from the batch (drawn per sample by the data pipeline: N1.7's
``t = 0.999 (1 - s)``, ``s ~ Beta(1.5, 1)``, is ``1 - time`` of our pipeline's draw, which has the same law) instead
of the action head's own ``torch.randn`` / ``Beta`` draws; every module it runs is LeRobot's. Per sample, the mean
over the valid (step, dim) entries of LeRobot's ``action_mask`` (LeRobot averages over the whole batch's valid
entries: the same number whenever the samples have as many valid steps).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loongforge_embodied.policies.lerobot_groot.configuration_lerobot_groot import LeRobotGrootArch

STAT_KEYS = ("state_min", "state_max", "action_min", "action_max")
BACKBONE_KEYS = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids")


class _Stats(nn.Module):
    """Min-max normalisation statistics as buffers (``stats.*``): saved with checkpoints, written to the export's
    ``loongforge.json`` (not to ``model.safetensors``, whose names are LeRobot's). Sized by the padded ``max_*_dim``
    so a checkpoint of another dataset still loads."""

    def __init__(self, arch: LeRobotGrootArch):
        super().__init__()
        for key in STAT_KEYS:
            dim = arch.max_state_dim if key.startswith("state") else arch.max_action_dim
            self.register_buffer(key, torch.full((dim,), 1.0 if key.endswith("max") else -1.0))


class LeRobotGrootModel(nn.Module):
    """Components ``vision`` (Qwen3-VL's vision tower and merger), ``language`` (its text layers kept) and
    ``expert`` (the action head: VL layer norm + self-attention, DiT, state / action encoders, decoder). ``wrap_units()``: the
    vision blocks, the text layers and the DiT blocks, in execution order."""

    def __init__(self, arch: LeRobotGrootArch):
        super().__init__()
        from loongforge_embodied.policies.lerobot_groot.build import build_groot

        self.arch = arch
        self._groot_model, self.config = build_groot(arch)
        self.stats = _Stats(arch)

    # ----------------------------------------------------------------- structure
    @property
    def _backbone(self):
        return self._groot_model.backbone

    def components(self) -> dict[str, list[nn.Module]]:
        """Named parameter groups (``model.freeze`` takes these names)."""
        qwen = self._backbone.model
        return {"vision": [self._backbone.visual], "language": [self._backbone.language_model, qwen.lm_head],
                "expert": [self._groot_model.action_head]}

    def wrap_units(self) -> list[nn.Module]:
        """FSDP2 / recompute units in execution order: vision blocks, text layers, DiT blocks."""
        return [*self._backbone.visual.blocks, *self._backbone.language_model.layers,
                *self._groot_model.action_head.model.transformer_blocks]

    def enable_activation_checkpointing(self) -> None:
        """Recompute in backward: transformers' per-layer checkpointing of the backbone and LeRobot's DiT's own
        ``gradient_checkpointing`` flag."""
        self._backbone.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self._groot_model.action_head.model.gradient_checkpointing = True

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
    def _features(self, batch: dict[str, torch.Tensor]):
        """The backbone's output through the action head's VL layers, and the state features."""
        from transformers.feature_extraction_utils import BatchFeature

        head = self._groot_model.action_head
        backbone_out = self._backbone(BatchFeature(data={k: batch[k] for k in BACKBONE_KEYS if k in batch}))
        backbone_out = head.process_backbone_output(backbone_out)
        state_features = head.state_encoder(batch["state"], batch["embodiment_id"])
        return backbone_out, state_features

    def _velocity(self, backbone_out, state_features, noisy: torch.Tensor, t_discretized: torch.Tensor,
                  embodiment_id: torch.Tensor) -> torch.Tensor:
        """``GR00TN17ActionHead``'s velocity for the noisy chunk at the discretised flow time (B,)."""
        head = self._groot_model.action_head
        action_features = head.action_encoder(noisy, t_discretized, embodiment_id)
        if head.config.add_pos_embed:
            pos_ids = torch.arange(action_features.shape[1], dtype=torch.long, device=noisy.device)
            action_features = action_features + head.position_embedding(pos_ids).unsqueeze(0)
        sa_embs = torch.cat((state_features, action_features), dim=1)
        mask = backbone_out.backbone_attention_mask
        extra = {"image_mask": backbone_out.image_mask, "backbone_attention_mask": mask} \
            if head.config.use_alternate_vl_dit else {}
        out, _ = head.model(hidden_states=sa_embs, encoder_hidden_states=backbone_out.backbone_features,
                            encoder_attention_mask=mask, timestep=t_discretized, return_all_hidden_states=True,
                            **extra)
        return head.action_decoder(out, embodiment_id)[:, -noisy.shape[1]:]

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-sample loss (B,): ``GR00TN17.forward``'s masked velocity MSE, per sample."""
        head = self._groot_model.action_head
        head.set_frozen_modules_to_eval_mode()
        backbone_out, state_features = self._features(batch)
        if self.training and head.state_dropout_prob > 0:
            drop = torch.rand(state_features.shape[0], device=state_features.device) < head.state_dropout_prob
            state_features = state_features * (1 - drop[:, None, None].to(dtype=state_features.dtype))
        actions, noise = batch["actions"], batch["noise"]
        t = (1 - batch["time"]).to(actions.dtype)[:, None, None]  # NOTE: N1.7's t = 1 is the data, ours the noise
        t_discretized = (t[:, 0, 0] * self._groot_model.action_head.num_timestep_buckets).long()
        pred = self._velocity(backbone_out, state_features, (1 - t) * noise + t * actions, t_discretized,
                              batch["embodiment_id"])
        mask = batch["action_mask"]
        losses = F.mse_loss(pred, actions - noise, reduction="none") * mask
        return losses.sum(dim=(1, 2)) / mask.sum(dim=(1, 2)).clamp_min(1)

    @torch.no_grad()
    def sample_actions(self, batch: dict[str, torch.Tensor], *, steps: int | None = None,
                       noise: torch.Tensor | None = None) -> torch.Tensor:
        """``GR00TN17ActionHead.get_action``'s Euler sampler (features once, ``num_steps`` velocity steps from
        t = 0); normalised actions (B, chunk, action_dim). ``noise``: the starting noise (B, chunk, action_dim or
        max_action_dim)."""
        from loongforge_embodied.policies.flow_noise import pad_noise

        a = self.arch
        backbone_out, state_features = self._features(batch)
        b = state_features.shape[0]
        x = torch.randn(b, a.chunk_size, a.max_action_dim, device=state_features.device) if noise is None \
            else pad_noise(noise.to(state_features.device, state_features.dtype), a.max_action_dim)
        n = steps or a.num_steps
        buckets = self._groot_model.action_head.num_timestep_buckets
        for i in range(n):
            t_discretized = torch.full((b,), int(i / float(n) * buckets), device=x.device)
            x = x + (1.0 / n) * self._velocity(backbone_out, state_features, x, t_discretized, batch["embodiment_id"])
        return x[:, :, : a.action_dim]

    def unnormalize_actions(self, actions: torch.Tensor) -> torch.Tensor:
        from loongforge_embodied.policies.lerobot_groot.processor_lerobot_groot import unnormalize

        return unnormalize(actions, "action", stats=self.stats_dict())
