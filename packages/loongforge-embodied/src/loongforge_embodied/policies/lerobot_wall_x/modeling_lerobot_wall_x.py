"""LeRobot's own Wall-X (``Qwen2_5_VLMoEForAction``) as a policy of our trainer.

``self.model`` is LeRobot's module, so parameter names are exactly ``WallXPolicy``'s (``model.…``) and an export
loads with ``WallXPolicy.from_pretrained``. The loss is ``train_step_forward``'s flow-matching loss (diffusion mode:
no text labels, so no cross-entropy term), with the noise and flow time taken from the batch (drawn per sample by
the data pipeline: Wall-X's ``t = 0.999 (1 - s)``, ``s ~ Beta(1.5, 1)``, is ``1 - time`` of our pipeline's draw,
which has the same law) instead of the action head's own draws; every module it runs is LeRobot's. Per sample, the
mean over its (step, dim) entries of the DOF-masked squared error (LeRobot's mean over the batch is the mean of
those). Like LeRobot, chunk steps past the episode's end are not masked (only NaN actions are).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loongforge_embodied.policies.lerobot_wall_x.configuration_lerobot_wall_x import (
    NUM_STEPS,
    LeRobotWallXArch,
)

STAT_KEYS = ("state_mean", "state_std", "action_mean", "action_std")


def adaptations() -> list:
    """What a run of this policy applies through the adaptation door (``adaptations.adaptations``)."""
    from loongforge_embodied.policies.lerobot_wall_x.adaptations import adaptations as wall_x_adaptations

    return wall_x_adaptations()


class _Stats(nn.Module):
    """Normalisation statistics as buffers (``stats.*``): saved with checkpoints, written to the export's
    ``loongforge.json`` (not to ``model.safetensors``, whose names are LeRobot's). Sized by the padded ``max_*_dim``
    so a checkpoint of another dataset still loads."""

    def __init__(self, arch: LeRobotWallXArch):
        super().__init__()
        for key in STAT_KEYS:
            dim = arch.max_state_dim if key.startswith("state") else arch.max_action_dim
            self.register_buffer(key, torch.full((dim,), 1.0 if key.endswith("std") else 0.0))


class LeRobotWallXModel(nn.Module):
    """Components ``vision`` (Qwen2.5-VL's vision tower and merger), ``language`` (the text model: embeddings,
    attention, norms and the prompt tokens' expert MLPs) and ``expert`` (the action tokens' expert MLPs and the
    action head). ``wrap_units()``: the vision blocks and the decoder layers, in execution order."""

    def __init__(self, arch: LeRobotWallXArch):
        super().__init__()
        from loongforge_embodied.policies.lerobot_wall_x.build import build_wall_x

        self.arch = arch
        self.model, self.processor = build_wall_x(arch)
        self.stats = _Stats(arch)
        # NOTE: tokens are routed by type (0: prompt, 1: action): further experts, and an LM head not tied to the
        # embeddings (diffusion mode has no text loss), cannot reach the loss (parameters without a gradient,
        # which DDP refuses): they stay frozen
        for layer in self.model.model.layers:
            if layer.mlp is None:
                for expert in layer.moe.experts[2:]:
                    expert.requires_grad_(False)
        if self.model.lm_head.weight is not self.model.model.embed_tokens.weight:
            self.model.lm_head.requires_grad_(False)

    # ----------------------------------------------------------------- structure
    def _experts(self, *, action: bool) -> list[nn.Module]:
        out = []
        for layer in self.model.model.layers:
            if layer.mlp is not None:  # NOTE: a dense layer's MLP serves every token: the language model's
                out += [] if action else [layer.mlp]
            else:
                out += list(layer.moe.experts[1:]) if action else [layer.moe.experts[0]]
        return out

    def components(self) -> dict[str, list[nn.Module]]:
        """Named parameter groups (``model.freeze`` takes these names)."""
        text = self.model.model
        shared = [text.embed_tokens, text.norm, self.model.lm_head]
        for layer in text.layers:
            shared += [layer.self_attn, layer.input_layernorm, layer.post_attention_layernorm]
        return {"vision": [self.model.visual], "language": shared + self._experts(action=False),
                "expert": self._experts(action=True) + [self.model.action_preprocessor]}

    def wrap_units(self) -> list[nn.Module]:
        """FSDP2 / recompute units in execution order: vision blocks, decoder layers."""
        return [*self.model.visual.blocks, *self.model.model.layers]

    def enable_activation_checkpointing(self) -> None:
        """Recompute in backward: transformers' per-layer checkpointing (vision blocks and decoder layers)."""
        self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

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
    def _embeds(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The prompt's embeddings with the images' and the proprioception's features in their tokens, as
        ``train_step_forward`` / ``predict`` place them."""
        m = self.model
        ids = batch["input_ids"]
        embeds = m.model.embed_tokens(ids)
        image = m.visual(batch["pixel_values"].type(m.visual.dtype), grid_thw=batch["image_grid_thw"]).pooler_output
        mask = (ids == m.config.image_token_id).unsqueeze(-1).expand_as(embeds)
        embeds = embeds.masked_scatter(mask, image.to(embeds.device, embeds.dtype))
        propri = m.action_preprocessor.proprioception_proj(batch["proprioception"].to(embeds.dtype),
                                                           batch["agent_pos_mask"].to(embeds.dtype))
        mask = (ids == m.action_token_id_set["propri_token_id"]).unsqueeze(-1).expand_as(embeds)
        return embeds.masked_scatter(mask, propri.to(embeds.dtype))

    def _velocity(self, batch: dict[str, torch.Tensor], embeds: torch.Tensor, noisy: torch.Tensor,
                  time: torch.Tensor) -> torch.Tensor:
        """The action head's velocity (B, chunk, max_action_dim) for the noisy chunk at flow time ``time`` (B,)."""
        m = self.model
        head = m.action_preprocessor
        action = batch["input_ids"] == m.action_token_id_set["action_token_id"]
        emb = head.step(timestep=time, noisy_action=noisy, dof_mask=batch["dof_mask"].to(noisy.dtype))
        embeds = embeds.masked_scatter(action.unsqueeze(-1).expand_as(embeds), emb.to(embeds.dtype))
        hidden = m.model(input_ids=None, position_ids=batch["position_ids"], attention_mask=batch["attention_mask"],
                         inputs_embeds=embeds, moe_token_types=batch["moe_token_types"], use_cache=False,
                         return_dict=True).last_hidden_state
        pred = head.action_proj_back(hidden[action].to(torch.float32))
        return pred.reshape(noisy.shape)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-sample loss (B,): ``train_step_forward``'s DOF-masked flow MSE, per sample."""
        actions, noise = batch["actions"].to(torch.float32), batch["noise"].to(torch.float32)
        time = (1 - batch["time"]).to(torch.float32)  # NOTE: Wall-X's t = 1 is the data, ours the noise
        t = time[:, None, None]
        pred = self._velocity(batch, self._embeds(batch), (1 - t) * noise + t * actions, time)
        losses = F.mse_loss(pred, actions - noise, reduction="none") * batch["dof_mask"].to(torch.float32)
        return losses.mean(dim=(1, 2))

    @torch.no_grad()
    def sample_actions(self, batch: dict[str, torch.Tensor], *, steps: int | None = None,
                       noise: torch.Tensor | None = None) -> torch.Tensor:
        """``predict``'s diffusion sampler (Euler over ``linspace(0, 1, steps + 1)``, as torchdiffeq's ``euler``
        steps it); normalised actions (B, chunk, action_dim). ``noise``: the starting noise (B, chunk, action_dim or
        max_action_dim)."""
        from loongforge_embodied.policies.flow_noise import pad_noise

        a = self.arch
        embeds = self._embeds(batch)
        b, dev = embeds.shape[0], embeds.device
        x = torch.randn(b, a.chunk_size, a.max_action_dim, device=dev) if noise is None \
            else pad_noise(noise.to(dev, torch.float32), a.max_action_dim)
        times = torch.linspace(0, 1, (steps or NUM_STEPS) + 1, device=dev, dtype=torch.float32)
        for t0, t1 in zip(times[:-1], times[1:], strict=True):
            x = x + (t1 - t0) * self._velocity(batch, embeds, x, t0.unsqueeze(0).repeat(b))
        return x[:, :, : a.action_dim]

    def unnormalize_actions(self, actions: torch.Tensor) -> torch.Tensor:
        from loongforge_embodied.policies.lerobot_wall_x.processor_lerobot_wall_x import unnormalize

        return unnormalize(actions, "action", stats=self.stats_dict())
