"""LeRobot's own LingBot-VA (``LingBotVAPolicy``'s dual-stream Wan2.2 transformer, ``WanTransformer3DModel``) as a
policy of our trainer.

``self.transformer`` is LeRobot's module, so parameter names are exactly ``LingBotVAPolicy``'s (``transformer.…``)
and an export loads with ``LingBotVAPolicy.from_pretrained``; the frozen VAE and text encoder are held outside the
state dict, as LeRobot holds them. The loss is ``LingBotVAPolicy.forward``'s: the clip encoded by the VAE, the prompt
by the text encoder, video latents and actions noised per latent frame, one sequence of [noisy video, clean video,
noisy actions, clean actions] through the transformer (``forward_train``'s), then the time-weighted flow-matching
MSE of each stream. LeRobot runs that sequence through flex attention under its block-causal mask, in bf16; we run
the transformer's own blocks with the same mask as a dense boolean mask of plain attention, per sample, in the
recipe's precision. LeRobot's terms are means over (sample, frame) rows, so per sample we take the mean over that
sample's rows: their batch mean is LeRobot's loss. The flow draws come from the batch (per sample).

Sampling is ``LingBotVAPolicy``'s first chunk (``_infer`` at ``frame_st_id`` 0, its KV cache and classifier-free
guidance) for a batch of requests: the first frame conditions, and the actions of the frames after it are returned.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from loongforge_embodied.policies.lerobot_lingbot_va.configuration_lerobot_lingbot_va import (
    LATENT_CHANNELS,
    PATCH,
    LeRobotLingBotVAArch,
)

STAT_KEYS = ("state_mean", "state_std", "action_mean", "action_std")


class _Stats(nn.Module):
    """Normalisation statistics as buffers (``stats.*``): saved with checkpoints, written to the export's
    ``loongforge.json`` (not to ``model.safetensors``, whose names are LeRobot's)."""

    def __init__(self, arch: LeRobotLingBotVAArch):
        super().__init__()
        for key in STAT_KEYS:
            dim = arch.state_dim if key.startswith("state") else arch.action_dim
            self.register_buffer(key, torch.full((dim,), 1.0 if key.endswith("std") else 0.0))


class _SelfAttention:
    """The self-attention op of every block: plain attention under ``mask`` (B, 1, L, L) where one is set (our
    training sequence), else LeRobot's own op (sampling, with its KV cache)."""

    def __init__(self):
        self.mask: torch.Tensor | None = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from lerobot.policies.lingbot_va.utils import custom_sdpa

        if self.mask is None:
            return custom_sdpa(q, k, v)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=self.mask)
        return out.transpose(1, 2)


def attention_mask(arch: LeRobotLingBotVAArch, chunk: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """``FlexAttnFunc._get_mask_mod`` of one sample's sequence [noisy video, clean video, noisy actions, clean
    actions] as a boolean (B, 1, L, L): clean tokens see clean ones of their own and earlier frame blocks, noisy
    tokens the clean ones of earlier blocks and the noisy ones of their own, within ``window`` blocks (a block:
    ``chunk`` latent frames, video and actions apart)."""
    f = arch.frame_chunk_size
    per_frame = (arch.latent_shape[2] // PATCH) * (arch.latent_shape[3] // PATCH)
    video = torch.arange(f).repeat_interleave(per_frame)
    action = torch.arange(f).repeat_interleave(arch.action_per_frame)
    chunk = chunk.reshape(-1, 1).to(torch.int64)
    frames = torch.cat([video // chunk * 2, video // chunk * 2, action // chunk * 2 + 1, action // chunk * 2 + 1],
                       dim=1)  # (B, L)
    noisy = torch.cat([torch.zeros_like(video), torch.ones_like(video), torch.zeros_like(action),
                       torch.ones_like(action)]).bool()
    q, kv = frames[:, :, None], frames[:, None, :]
    nq, nkv = noisy[:, None], noisy[None, :]
    mask = ((nq & nkv) & (kv <= q)) | ((~nq & nkv) & (kv < q)) | ((~nq & ~nkv) & (kv == q))
    mask = mask & ((q - kv).abs() <= window.reshape(-1, 1, 1))
    return mask[:, None]


class LeRobotLingBotVAModel(nn.Module):
    """Components ``video`` (the video stream's input, time embedding and output layers), ``action`` (the action
    stream's) and ``expert`` (the transformer blocks both streams share). ``wrap_units()``: the transformer blocks.
    The transformer's output modulation table (``scale_shift_table``) belongs to none and always trains; the action
    stream's copy of the text projection, which no path uses (the streams share the video stream's), is frozen."""

    def __init__(self, arch: LeRobotLingBotVAArch):
        super().__init__()
        from lerobot.policies.lingbot_va.utils import FlowMatchScheduler

        from loongforge_embodied.policies.lerobot_lingbot_va.build import build_transformer, load_frozen

        self.arch = arch
        self.transformer = build_transformer(arch)
        self.transformer.condition_embedder_action.text_embedder.requires_grad_(False)
        self._attention = _SelfAttention()
        for block in self.transformer.blocks:
            block.attn1.attn_op = self._attention
        # NOTE: outside the module registry (not in the state dict, not trained), as LeRobot holds them
        self._frozen = dict(zip(("vae", "text_encoder"), load_frozen(arch), strict=True))
        self.stats = _Stats(arch)
        self._schedulers = []
        for shift in (float(arch.video_shift), arch.action_shift_percent / 100):
            s = FlowMatchScheduler(shift=shift, sigma_min=0.0, extra_one_step=True)
            s.set_timesteps(1000, training=True)
            self._schedulers.append(s)

    def _apply(self, fn, *args, **kwargs):
        # NOTE: the frozen VAE and text encoder follow the weights to their device (their dtype stays)
        super()._apply(fn, *args, **kwargs)
        weight = next(self.transformer.parameters(), None)
        if weight is not None and weight.device.type != "meta":
            for m in self._frozen.values():
                m.to(weight.device)
        return self

    # ----------------------------------------------------------------- structure
    def components(self) -> dict[str, list[nn.Module]]:
        """Named parameter groups (``model.freeze`` takes these names)."""
        t = self.transformer
        return {"video": [t.patch_embedding_mlp, t.condition_embedder, t.proj_out],
                "action": [t.action_embedder, t.condition_embedder_action, t.action_proj_out],
                "expert": list(t.blocks)}

    def wrap_units(self) -> list[nn.Module]:
        """FSDP2 / recompute units in execution order."""
        return list(self.transformer.blocks)

    def enable_activation_checkpointing(self) -> None:
        """Recompute in backward, per unit of :meth:`wrap_units`."""
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        units = set(map(id, self.wrap_units()))
        apply_activation_checkpointing(self.transformer, check_fn=lambda m: id(m) in units)

    def set_stats(self, stats: dict[str, torch.Tensor]) -> None:
        for key in STAT_KEYS:
            if key in stats:
                value = torch.as_tensor(stats[key], dtype=torch.float32).flatten()
                getattr(self.stats, key)[: value.numel()].copy_(value)

    def stats_dict(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self.stats, k) for k in STAT_KEYS}

    # ----------------------------------------------------------------- encoders
    @property
    def _dtype(self) -> torch.dtype:
        return self.transformer.proj_out.weight.dtype

    @torch.no_grad()
    def _encode_video(self, video: torch.Tensor) -> torch.Tensor:
        """(B, cams, 3, T, h, w) in [0, 1] → normalised latents (B, 48, F, h / 16, cams x w / 16):
        ``_encode_training_latents``'s, the cameras side by side."""
        vae = self._frozen["vae"]
        b, cams = video.shape[:2]
        x = (video.flatten(0, 1).float() * 2.0 - 1.0).to(device=next(vae.parameters()).device, dtype=vae.dtype)
        mu = vae.encode(x).latent_dist.mode()
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1).to(mu.device)
        inv_std = (1.0 / torch.tensor(vae.config.latents_std)).view(1, -1, 1, 1, 1).to(mu.device)
        mu = ((mu.float() - mean) * inv_std).to(mu)
        return torch.cat(mu.unflatten(0, (b, cams)).unbind(1), dim=-1).to(self._dtype)

    @torch.no_grad()
    def _encode_prompt(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``_get_t5_prompt_embeds`` after its tokenizer: the padding positions zeroed."""
        te = self._frozen["text_encoder"]
        device = next(te.parameters()).device
        emb = te(ids.to(device), mask.to(device)).last_hidden_state.to(self._dtype)
        return emb * mask.to(emb.device).unsqueeze(-1).to(emb.dtype)

    def _actions(self, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, chunk, action_dim) → LeRobot's action stream (B, action_channels, F, action_per_frame, 1) and its
        mask (the dataset's channels)."""
        a = self.arch
        b = actions.shape[0]
        act = actions[:, : a.chunk_size].reshape(b, a.frame_chunk_size, a.action_per_frame, a.action_dim)
        full = act.new_zeros(b, a.action_channels, a.frame_chunk_size, a.action_per_frame)
        full[:, : a.action_dim] = act.permute(0, 3, 1, 2)
        mask = torch.zeros(a.action_channels, device=act.device, dtype=act.dtype)
        mask[: a.action_dim] = 1.0
        full = full.unsqueeze(-1).to(self._dtype)
        return full, mask.view(1, -1, 1, 1, 1).expand_as(full).to(full.dtype)

    # ----------------------------------------------------------------- forward
    @staticmethod
    def _noise(scheduler, x: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """``FlowMatchScheduler.add_noise`` with per-sample, per-frame timesteps ``t`` (B, F)."""
        ids = torch.argmin((scheduler.timesteps[:, None] - t.cpu().flatten()[None]).abs(), dim=0)
        sigma = scheduler.sigmas[ids].to(x).view(t.shape[0], 1, t.shape[1], 1, 1)
        return (1 - sigma) * x + sigma * noise

    def _grid(self, frames: int, h: int, w: int) -> torch.Tensor:
        """The rotary grid of one sample's training sequence (``forward_train``'s ``full_grid_id``)."""
        from lerobot.policies.lingbot_va.utils import get_mesh_id

        a = self.arch
        video = get_mesh_id(frames, h // PATCH, w // PATCH, t=0)
        action = get_mesh_id(frames, a.action_per_frame, 1, t=1, action=True)
        return torch.cat([video, video, action, action], dim=1)[None]

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-sample loss (B,); its mean is ``LingBotVAPolicy.forward``'s loss for the same draws."""
        from einops import rearrange
        from lerobot.policies.lingbot_va.utils import data_seq_to_patch

        t, a = self.transformer, self.arch
        video_s, action_s = self._schedulers
        latents = self._encode_video(batch["video"])
        device = latents.device
        text = self._encode_prompt(batch["input_ids"], batch["attention_mask"])
        actions, action_mask = self._actions(batch["actions"])
        b, _, f, h, w = latents.shape
        # the video stream (``_add_noise_stream``): noisy copy, target, the clean copy noised for some samples
        t_video = video_s.timesteps[batch["latent_ids"].cpu()].to(device)
        noisy_video = self._noise(video_s, latents, batch["latent_noise"].to(latents), t_video)
        video_target = batch["latent_noise"].to(latents) - latents
        t_cond = video_s.timesteps[batch["cond_ids"].cpu()].to(device)
        cond = batch["noisy_cond"].to(device).bool()
        clean_video = torch.where(cond.view(-1, 1, 1, 1, 1),
                                  self._noise(video_s, latents, batch["cond_noise"].to(latents), t_cond), latents)
        t_cond = torch.where(cond.view(-1, 1), t_cond, torch.zeros_like(t_cond))
        # the action stream: never noised as a condition, masked to the dataset's channels
        t_action = action_s.timesteps[batch["action_ids"].cpu()].to(device)
        action_noise = batch["action_noise"].to(actions)
        noisy_action = self._noise(action_s, actions, action_noise, t_action) * action_mask
        action_target = (action_noise - actions) * action_mask
        clean_action = actions * action_mask
        # one sequence per sample, as ``WanTransformer3DModel.forward_train`` (without its batch flattening)
        hidden = torch.cat([t._input_embed(noisy_video, "latent"), t._input_embed(clean_video, "latent"),
                            t._input_embed(noisy_action, "action"), t._input_embed(clean_action, "action")], dim=1)
        context = t._input_embed(text, "text")
        rotary = t.rope(self._grid(f, h, w).to(device))[:, :, None]
        video_temb, video_proj = t._time_embed(torch.cat([t_video, t_cond], dim=1), h, w, dtype=hidden.dtype)
        action_temb, action_proj = t._time_embed(torch.cat([t_action, torch.zeros_like(t_action)], dim=1),
                                                 a.action_per_frame, 1, dtype=hidden.dtype, action_mode=True)
        temb = torch.cat([video_temb, action_temb], dim=1)
        proj = torch.cat([video_proj, action_proj], dim=1)
        self._attention.mask = attention_mask(a, batch["mask_chunk"], batch["mask_window"]).to(device)
        for block in t.blocks:
            hidden = block(hidden, context, proj, rotary, update_cache=0)
        shift, scale = rearrange(t.scale_shift_table[None] + temb[:, :, None, ...], "b l n c -> b n l c").chunk(2, 1)
        hidden = (t.norm_out(hidden.float()) * (1.0 + scale.squeeze(1)) + shift.squeeze(1)).type_as(hidden)
        n_video = noisy_video.shape[2] * (h // PATCH) * (w // PATCH)
        n_action = f * a.action_per_frame
        video_pred = rearrange(t.proj_out(hidden[:, :n_video]), "b l (n c) -> b (l n) c", n=PATCH * PATCH)
        action_pred = t.action_proj_out(hidden[:, 2 * n_video: 2 * n_video + n_action])
        # ``_flow_matching_loss``, each (sample, frame) row's mean, then the mean of a sample's rows
        video_pred = data_seq_to_patch((1, PATCH, PATCH), video_pred, f, h, w, batch_size=b)
        action_pred = rearrange(action_pred, "b (f n) c -> b c f n 1", f=f)
        w_video = video_s.training_weight(t_video.flatten()).reshape(b, f)
        w_action = action_s.training_weight(t_action.flatten()).reshape(b, f)
        video = F.mse_loss(video_pred.float(), video_target.float(), reduction="none") * w_video[:, None, :, None, None]
        video = video.permute(0, 2, 3, 4, 1).flatten(2)
        video = video.sum(dim=2) / (torch.ones_like(video).sum(dim=2) + 1e-6)
        action = F.mse_loss(action_pred.float(), action_target.float(), reduction="none")
        action = (action * w_action[:, None, :, None, None] * action_mask).permute(0, 2, 3, 4, 1).flatten(2)
        count = action_mask.float().permute(0, 2, 3, 4, 1).flatten(2).sum(dim=2)
        action = action.sum(dim=2) / (count + 1e-6)
        return video.mean(dim=1) + action.mean(dim=1)

    # ----------------------------------------------------------------- sampling
    def start_noise(self, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each request's starting video latents and actions (``_infer``'s draws), from a generator seeded by its
        ``noise`` (B, chunk, action_dim)."""
        a = self.arch
        shape = (LATENT_CHANNELS, a.frame_chunk_size, *a.latent_shape[2:])
        video, actions = [], []
        for sample in noise:
            seed = int(sample.float().cpu().flatten().view(torch.int32).to(torch.int64).sum()) & 0x7FFF_FFFF
            g = torch.Generator().manual_seed(seed)
            video.append(torch.randn(*shape, generator=g))
            actions.append(torch.randn(*a.action_shape, generator=g))
        return torch.stack(video), torch.stack(actions)

    def _stream(self, x, t_, prompt, negative, grid, *, action_mode: bool, last: bool):
        """One transformer call of ``_infer`` (both guidance halves), LeRobot's ``_prepare_latent_input`` and
        ``_repeat_input_for_cfg`` for a batch: the prediction in the stream's layout, or None on the last step
        (which only writes the cache)."""
        from einops import rearrange
        from lerobot.policies.lingbot_va.utils import data_seq_to_patch

        a = self.arch
        b, f = x.shape[0], x.shape[2]
        timesteps = torch.ones(f, dtype=torch.float32, device=x.device) * t_
        timesteps[0:1] *= 0
        cfg = negative is not None
        inp = {"noisy_latents": torch.cat([x, x]) if cfg else x,
               "text_emb": torch.cat([prompt, negative]) if cfg else prompt,
               "grid_id": grid[None].expand(2 * b if cfg else b, -1, -1),
               "timesteps": timesteps[None].expand(2 * b if cfg else b, -1)}
        pred = self.transformer(inp, update_cache=1 if last else 0, cache_name="pos", action_mode=action_mode)
        if last:
            return None
        if action_mode:
            pred = rearrange(pred, "b (f n) c -> b c f n 1", f=f)
            scale = a.action_guidance
        else:
            pred = data_seq_to_patch((1, PATCH, PATCH), pred, f, x.shape[3], x.shape[4], batch_size=pred.shape[0])
            scale = a.guidance
        if not cfg:
            return pred
        return pred[b:] + scale * (pred[:b] - pred[b:]) if scale > 1 else pred[:b]

    @torch.no_grad()
    def sample_actions(self, batch: dict[str, torch.Tensor], *, steps: int | None = None,
                       noise: torch.Tensor | None = None,
                       start: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``LingBotVAPolicy``'s first chunk for a batch: the clip's first frame conditions, the video latents then
        the actions are denoised through the KV cache (classifier-free guidance against the empty prompt where
        ``guidance`` / ``action_guidance`` > 1). ``start``: the starting latents and actions (default: drawn
        from ``noise``, see :meth:`start_noise`). Normalised actions (B, served_steps, action_dim)."""
        import torch.nn.functional as F  # noqa: N812
        from lerobot.policies.lingbot_va.utils import FlowMatchScheduler, get_mesh_id

        t, a = self.transformer, self.arch
        self._attention.mask = None
        init = self._encode_video(batch["video"][:, :, :, :1])  # (B, 48, 1, h, w)
        device, dtype = init.device, self._dtype
        b, h, w = init.shape[0], init.shape[3], init.shape[4]
        prompt = self._encode_prompt(batch["input_ids"], batch["attention_mask"])
        cfg = a.guidance > 1 or a.action_guidance > 1
        negative = self._encode_prompt(batch["negative_ids"], batch["negative_mask"]) if cfg else None
        if start is None:
            if noise is None:
                noise = torch.randn(b, a.chunk_size, a.action_dim)
            start = self.start_noise(noise)
        latents, actions = (s.to(device=device, dtype=dtype).clone() for s in start)
        f = a.frame_chunk_size
        t.create_empty_cache("pos", a.attn_window, f * (h // PATCH) * (w // PATCH), f * a.action_per_frame,
                             device=device, dtype=dtype, batch_size=2 * b if cfg else b)
        try:
            video_s = FlowMatchScheduler(shift=float(a.video_shift), sigma_min=0.0, extra_one_step=True)
            action_s = FlowMatchScheduler(shift=a.action_shift_percent / 100, sigma_min=0.0, extra_one_step=True)
            video_s.set_timesteps(int(steps or a.num_steps))
            action_s.set_timesteps(a.action_steps)
            grid = get_mesh_id(f, h // PATCH, w // PATCH, 0, 1, 0).to(device)
            times = F.pad(video_s.timesteps, (0, 1), mode="constant", value=0)
            for i, t_ in enumerate(times):
                latents[:, :, 0:1] = init
                pred = self._stream(latents, t_, prompt, negative, grid, action_mode=False, last=i == len(times) - 1)
                if pred is not None:
                    latents = video_s.step(pred, t_, latents)
                latents[:, :, 0:1] = init
            grid = get_mesh_id(f, a.action_per_frame, 1, 1, 1, 0, action=True).to(device)
            times = F.pad(action_s.timesteps, (0, 1), mode="constant", value=0)
            for i, t_ in enumerate(times):
                actions[:, :, 0:1] = 0
                actions[:, a.action_dim:] = 0
                pred = self._stream(actions, t_, prompt, negative, grid, action_mode=True, last=i == len(times) - 1)
                if pred is not None:
                    actions = action_s.step(pred, t_, actions)
                actions[:, :, 0:1] = 0
        finally:
            t.clear_cache("pos")
        out = actions[:, : a.action_dim, 1:].squeeze(-1).flatten(2)  # (B, action_dim, served_steps)
        return out.transpose(1, 2).float()

    def unnormalize_actions(self, actions: torch.Tensor) -> torch.Tensor:
        from loongforge_embodied.policies.lerobot_lingbot_va.processor_lerobot_lingbot_va import unnormalize

        return unnormalize(actions, arch=self.arch, stats=self.stats_dict())
