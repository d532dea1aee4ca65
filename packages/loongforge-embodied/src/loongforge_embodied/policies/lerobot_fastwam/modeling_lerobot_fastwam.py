"""LeRobot's own FastWAM (``FastWAM``: the Wan2.2 video DiT and the action DiT in one mixture of transformers) as a
policy of our trainer.

``self.model`` is LeRobot's module, so parameter names are exactly ``FastWAMPolicy``'s (``model.mot.…``,
``model.proprio_encoder.…``) and an export loads with ``FastWAMPolicy.from_pretrained``; the frozen VAE and text
encoder are held outside the state dict, as LeRobot holds them. The loss is ``FastWAM.training_loss``'s: the clip
encoded by the VAE, the prompt by the text encoder (the state appended as one context token), video and actions
noised at shifted flow times and denoised jointly through ``MoT`` (``_run_training_mot``), then the time-weighted
video MSE (past the conditioning first frame) and the time-weighted action MSE (over unpadded steps). LeRobot's
terms are batch means, so per sample we take the same terms over that sample alone: their batch mean is LeRobot's
loss. The flow draws come from the batch (per sample, from the data pipeline).
"""

from __future__ import annotations

import torch
from torch import nn

from loongforge_embodied.policies.lerobot_fastwam.configuration_lerobot_fastwam import LeRobotFastWAMArch

STAT_KEYS = ("state_mean", "state_std", "action_mean", "action_std")


class _Stats(nn.Module):
    """Normalisation statistics as buffers (``stats.*``): saved with checkpoints, written to the export's
    ``loongforge.json`` (not to ``model.safetensors``, whose names are LeRobot's)."""

    def __init__(self, arch: LeRobotFastWAMArch):
        super().__init__()
        for key in STAT_KEYS:
            dim = arch.state_dim if key.startswith("state") else arch.action_dim
            self.register_buffer(key, torch.full((dim,), 1.0 if key.endswith("std") else 0.0))


class LeRobotFastWAMModel(nn.Module):
    """Components ``video`` (the Wan video DiT: what LeRobot's ``freeze_video_expert`` freezes) and ``action`` (the
    action DiT and the state's context encoder). ``wrap_units()``: the ``MoTLayer`` of each layer (LeRobot's own
    FSDP unit: one block of each expert, joined by their mixed attention)."""

    def __init__(self, arch: LeRobotFastWAMArch):
        super().__init__()
        from loongforge_embodied.policies.lerobot_fastwam.build import build_fastwam

        self.arch = arch
        self.model, self.config = build_fastwam(arch)
        self.stats = _Stats(arch)

    def _apply(self, fn, *args, **kwargs):
        # NOTE: FastWAM moves its inputs to ``self.model.device`` (fixed when LeRobot builds it for one device):
        # follow the weights wherever the trainer moves them
        super()._apply(fn, *args, **kwargs)
        weight = next(self.model.parameters(), None)
        if weight is not None and weight.device.type != "meta":
            self.model.device = weight.device
        return self

    # ----------------------------------------------------------------- structure
    def components(self) -> dict[str, list[nn.Module]]:
        """Named parameter groups (``model.freeze`` takes these names)."""
        mot = self.model.mot
        video = [mot.mixtures["video"], *(layer.blocks["video"] for layer in mot.layers)]
        action = [mot.mixtures["action"], *(layer.blocks["action"] for layer in mot.layers)]
        if self.model.proprio_encoder is not None:
            action.append(self.model.proprio_encoder)
        return {"video": video, "action": action}

    def wrap_units(self) -> list[nn.Module]:
        """FSDP2 / recompute units in execution order."""
        return list(self.model.mot.layers)

    def enable_activation_checkpointing(self) -> None:
        """Recompute in backward, per unit of :meth:`wrap_units`."""
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        units = set(map(id, self.wrap_units()))
        apply_activation_checkpointing(self.model, check_fn=lambda m: id(m) in units)

    def set_stats(self, stats: dict[str, torch.Tensor]) -> None:
        for key in STAT_KEYS:
            if key in stats:
                value = torch.as_tensor(stats[key], dtype=torch.float32).flatten()
                getattr(self.stats, key)[: value.numel()].copy_(value)

    def stats_dict(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self.stats, k) for k in STAT_KEYS}

    # ----------------------------------------------------------------- forward
    @torch.no_grad()
    def _encode_prompt(self, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``FastWAM.encode_prompt`` after its tokenizer: padding embeddings zeroed, a full-length mask."""
        m = self.model
        emb = m.text_encoder(ids.to(m.device), mask.to(m.device)).to(m.torch_dtype)
        emb = emb * mask.to(emb.device).unsqueeze(-1)
        return emb, torch.ones_like(mask, dtype=torch.bool, device=emb.device)

    def _context(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt's context, with the state's token appended where the arch uses it (``proprio``)."""
        context, mask = self._encode_prompt(batch["input_ids"], batch["attention_mask"])
        if self.arch.proprio:
            context, mask = self.model._append_proprio_to_context(context, mask, batch["state"])
        return context, mask

    @staticmethod
    def _timestep(scheduler, u: torch.Tensor) -> torch.Tensor:
        """``WanContinuousFlowMatchScheduler.sample_training_t`` of the uniform draw ``u``."""
        return scheduler._phi(u.float(), scheduler.shift) * float(scheduler.num_train_timesteps)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-sample loss (B,); its mean is ``FastWAMPolicy.forward``'s loss for the same draws."""
        m = self.model
        video_s, action_s = m.train_video_scheduler, m.train_action_scheduler
        latents = m._encode_video_latents(batch["video"])
        context, context_mask = self._context(batch)
        actions = batch["actions"]
        t_video = self._timestep(video_s, batch["video_time"]).to(latents.dtype)
        t_action = self._timestep(action_s, batch["time"]).to(actions.dtype)
        noisy = video_s.add_noise(latents, batch["video_noise"], t_video)
        noisy[:, :, 0:1] = latents[:, :, 0:1]  # NOTE: the first frame conditions (Wan2.2 TI2V's fused latents)
        inputs = {"context": context, "context_mask": context_mask, "input_latents": latents,
                  "first_frame_latents": latents[:, :, 0:1], "fuse_vae_embedding_in_latents": True,
                  "action": actions, "action_is_pad": batch.get("action_pad"), "image_is_pad": None}
        targets = {"latents": noisy, "noisy_action": action_s.add_noise(actions, batch["noise"], t_action),
                   "timestep_video": t_video, "timestep_action": t_action}
        pred_video, pred_action = m._run_training_mot(inputs=inputs, targets=targets)
        video = m._compute_video_loss_per_sample(
            pred_video=pred_video[:, :, 1:], target_video=(batch["video_noise"] - latents)[:, :, 1:],
            image_is_pad=None, include_initial_video_step=False) * video_s.training_weight(t_video).reshape(-1)
        per_step = nn.functional.mse_loss(pred_action.float(), (batch["noise"] - actions).float(),
                                          reduction="none").mean(dim=2)
        if "action_pad" in batch:
            valid = (~batch["action_pad"]).to(per_step.dtype)
            action = (per_step * valid).sum(dim=1) / valid.sum(dim=1).clamp(min=1.0)
        else:
            action = per_step.mean(dim=1)
        action = action * action_s.training_weight(t_action).reshape(-1)
        return m.loss_lambda_video * video + m.loss_lambda_action * action

    @torch.no_grad()
    def sample_actions(self, batch: dict[str, torch.Tensor], *, steps: int | None = None,
                       noise: torch.Tensor | None = None) -> torch.Tensor:
        """``FastWAM.infer_action`` for a batch: the first frame's video K/V computed once, then the action DiT
        denoises ``noise`` (B, chunk, action_dim; default: drawn) through the cached layers. Normalised actions."""
        m = self.model
        video = batch["video"]
        b = video.shape[0]
        first = m.vae.encode(video[:, :, :1] * 2.0 - 1.0).to(m.torch_dtype)
        context, context_mask = self._context(batch)
        if noise is None:
            noise = torch.randn(b, self.arch.chunk_size, self.arch.action_dim)
        x = noise.to(device=m.device, dtype=m.torch_dtype)
        zeros = torch.zeros(b, dtype=first.dtype, device=m.device)
        pre = m.video_expert.pre_dit(x=first, timestep=zeros, context=context, context_mask=context_mask,
                                     action=None, fuse_vae_embedding_in_latents=True)
        seq = int(pre["tokens"].shape[1])
        mask = m._build_mot_attention_mask(video_seq_len=seq, action_seq_len=x.shape[1],
                                           video_tokens_per_frame=int(pre["meta"]["tokens_per_frame"]),
                                           device=pre["tokens"].device)
        cache = m.mot.prefill_video_cache(video_tokens=pre["tokens"], video_freqs=pre["freqs"],
                                          video_t_mod=pre["t_mod"],
                                          video_context_payload={"context": pre["context"],
                                                                 "mask": pre["context_mask"]},
                                          video_attention_mask=mask[:seq, :seq])
        times, deltas = m.infer_action_scheduler.build_inference_schedule(
            num_inference_steps=int(steps or self.arch.num_steps), device=m.device, dtype=x.dtype)
        for t, delta in zip(times, deltas, strict=True):
            pred = m._predict_action_noise_with_cache(latents_action=x, timestep_action=t.expand(b),
                                                      context=context, context_mask=context_mask,
                                                      video_kv_cache=cache, attention_mask=mask, video_seq_len=seq)
            x = m.infer_action_scheduler.step(pred, delta, x)
        return x.float()

    def unnormalize_actions(self, actions: torch.Tensor) -> torch.Tensor:
        from loongforge_embodied.policies.lerobot_fastwam.processor_lerobot_fastwam import unnormalize

        return unnormalize(actions, arch=self.arch, stats=self.stats_dict())
