"""The tiny pi05-style VLA in plain torch + transformers building blocks (no LeRobot import).

Prefix: SigLIP patch tokens of every camera + task bytes + discretised state tokens, through a bidirectional
Gemma. Suffix: a Gemma action expert over [projected prefix, noisy action chunk ⊕ flow time], trained with
flow matching (pi0 convention: x_t = t·noise + (1-t)·action, target u = noise - action).

NOTE: pi05 lets each expert layer attend to the same layer's prefix keys/values and conditions time with
adaRMSNorm; here the expert attends to a projection of the prefix's last hidden states and time enters through
an MLP on the action tokens. The compute split (vision / 2B-class prefix / 300M-class expert) is the same.

LeRobot policy wrapper of the tiny VLA: ``TinyVLAPolicy.from_pretrained(dir)`` loads our export.

Takes LeRobot-style raw batches (``observation.*``, ``task``, ``action``); normalisation statistics live in the
model's buffers, so an exported directory is self-contained.
NOTE: LeRobot's policy class is made on first access (module ``__getattr__``): training imports no lerobot here.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from loongforge_embodied.policies import siglip_names
from loongforge_embodied.policies.tiny_vla.configuration_tiny_vla import TinyVLAArch

STAT_KEYS = ("state_mean", "state_std", "action_mean", "action_std")
STATE_INPUTS = ("tokens", "linear")


def _gemma(*, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, vocab: int):
    from transformers import GemmaConfig, GemmaModel

    cfg = GemmaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=4096,
        use_bidirectional_attention=True, use_cache=False, pad_token_id=0, attention_dropout=0.0,
    )
    cfg._attn_implementation = "sdpa"
    return GemmaModel(cfg)


def sinusoidal(t: torch.Tensor, dim: int, *, min_period: float = 4e-3, max_period: float = 4.0) -> torch.Tensor:
    """pi0's sine-cosine embedding of the flow time ``t`` in [0, 1]."""
    frac = torch.linspace(0.0, 1.0, dim // 2, dtype=torch.float32, device=t.device)
    period = min_period * (max_period / min_period) ** frac
    x = t.float()[:, None] * (2 * math.pi / period)[None]
    return torch.cat([torch.sin(x), torch.cos(x)], dim=-1)


class TinyVLAModel(nn.Module):
    """Components ``vision``, ``language``, ``expert``; ``wrap_units()`` lists the transformer blocks in
    execution order (FSDP2 units, activation-checkpoint units). Batches arrive normalised (see ``processor``)."""

    def __init__(self, arch: TinyVLAArch):
        super().__init__()
        from transformers import SiglipVisionConfig, SiglipVisionModel

        self.arch = a = arch
        vcfg = SiglipVisionConfig(
            hidden_size=a.vision_hidden, intermediate_size=a.vision_intermediate, num_hidden_layers=a.vision_layers,
            num_attention_heads=a.vision_heads, image_size=a.image_size, patch_size=a.patch_size, vision_use_head=False,
        )
        vcfg._attn_implementation = "sdpa"
        if a.state_input not in STATE_INPUTS:
            raise ValueError(f"architecture field 'state_input' must be one of {STATE_INPUTS}, got {a.state_input!r}")
        self.vision = SiglipVisionModel(vcfg)
        self.img_proj = nn.Linear(a.vision_hidden, a.lm_hidden)
        self.language = _gemma(hidden=a.lm_hidden, layers=a.lm_layers, heads=a.lm_heads, kv_heads=a.lm_kv_heads,
                               head_dim=a.lm_head_dim, intermediate=a.lm_intermediate, vocab=a.vocab_size)
        self.expert = _gemma(hidden=a.expert_hidden, layers=a.expert_layers, heads=a.expert_heads,
                             kv_heads=a.expert_kv_heads, head_dim=a.expert_head_dim,
                             intermediate=a.expert_intermediate, vocab=1)
        # NOTE: the expert reads embeddings only; drop its token table so no parameter goes unused (DDP).
        self.expert.embed_tokens = None
        # NOTE: state_input "linear": the normalised state as one continuous prefix token (pi0) instead of bins
        self.state_proj = nn.Linear(a.state_dim, a.lm_hidden) if a.state_input == "linear" else None
        self.context_proj = nn.Linear(a.lm_hidden, a.expert_hidden)
        self.action_in = nn.Linear(a.action_dim, a.expert_hidden)
        self.time_mlp_in = nn.Linear(2 * a.expert_hidden, a.expert_hidden)
        self.time_mlp_out = nn.Linear(a.expert_hidden, a.expert_hidden)
        self.action_out = nn.Linear(a.expert_hidden, a.action_dim)
        for key, dim in zip(STAT_KEYS, (a.state_dim, a.state_dim, a.action_dim, a.action_dim), strict=True):
            init = torch.ones(dim) if key.endswith("std") else torch.zeros(dim)
            self.register_buffer(key, init)

    # ----------------------------------------------------------------- structure
    def components(self) -> dict[str, list[nn.Module]]:
        """Named parameter groups (``model.freeze`` takes these names)."""
        language = [self.language] + ([self.state_proj] if self.state_proj is not None else [])
        return {"vision": [self.vision, self.img_proj], "language": language,
                "expert": [self.expert, self.context_proj, self.action_in, self.time_mlp_in, self.time_mlp_out,
                           self.action_out]}

    def wrap_units(self) -> list[nn.Module]:
        """Transformer blocks in execution order: FSDP2 shards and activation checkpointing apply per block."""
        return [*siglip_names.encoder_layers(self.vision), *self.language.layers, *self.expert.layers]

    def enable_activation_checkpointing(self) -> None:
        for m in (self.vision, self.language, self.expert):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def set_stats(self, stats: dict[str, torch.Tensor]) -> None:
        """Normalisation statistics, kept as buffers so an exported checkpoint can un-normalise actions."""
        for key in STAT_KEYS:
            if key in stats:
                getattr(self, key).copy_(torch.as_tensor(stats[key], dtype=torch.float32))

    # ----------------------------------------------------------------- forward
    def embed_prefix(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        images = batch["images"]  # (B, cams, 3, H, W) in [0, 1]
        b, cams = images.shape[:2]
        # NOTE: all cameras go through the tower as one batch: one pass per block (one FSDP all-gather each).
        pix = images.flatten(0, 1) * 2.0 - 1.0
        patches = self.vision(pixel_values=pix.to(self.img_proj.weight.dtype)).last_hidden_state
        img = self.img_proj(patches).reshape(b, -1, self.arch.lm_hidden)
        tokens = self.language.embed_tokens(batch["lang_tokens"])
        if self.state_proj is not None:  # NOTE: the processor counted this token in lang_mask
            tokens = torch.cat([tokens, self.state_proj(batch["state"].to(self.state_proj.weight.dtype))[:, None]
                                .to(tokens.dtype)], dim=1)
        x = torch.cat([img, tokens.to(img.dtype)], dim=1)
        mask = torch.cat([torch.ones(img.shape[:2], dtype=torch.long, device=x.device),
                          batch["lang_mask"].long()], dim=1)
        return self.language(inputs_embeds=x, attention_mask=mask).last_hidden_state

    def velocity(self, prefix: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The expert's velocity field v(x_t, t | prefix) over the action chunk."""
        act = self.action_in(x_t.to(self.action_in.weight.dtype))
        temb = sinusoidal(t, self.arch.expert_hidden).to(act.dtype)[:, None].expand_as(act)
        act = self.time_mlp_out(F.silu(self.time_mlp_in(torch.cat([act, temb], dim=-1))))
        ctx = self.context_proj(prefix)
        x = torch.cat([ctx, act.to(ctx.dtype)], dim=1)
        full = torch.cat([mask, torch.ones(act.shape[:2], dtype=torch.long, device=x.device)], dim=1)
        h = self.expert(inputs_embeds=x, attention_mask=full).last_hidden_state
        return self.action_out(h[:, -x_t.shape[1]:]).float()

    def _prefix_mask(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        n_img = self.arch.image_tokens
        b = batch["lang_mask"].shape[0]
        ones = torch.ones(b, n_img, dtype=torch.long, device=batch["lang_mask"].device)
        return torch.cat([ones, batch["lang_mask"].long()], dim=1)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-sample flow-matching loss (B,): mean squared velocity error over the non-padded chunk steps.

        ``noise``/``time`` come from the batch when present (the data pipeline draws them per sample so losses
        do not depend on how the global batch is split over ranks), else they are sampled here."""
        actions = batch["actions"]
        noise = batch.get("noise")
        if noise is None:
            noise = torch.randn_like(actions)
        t = batch.get("time")
        if t is None:
            t = torch.distributions.Beta(1.5, 1.0).sample((actions.shape[0],)).to(actions.device) * 0.999 + 0.001
        x_t = t[:, None, None] * noise + (1 - t[:, None, None]) * actions
        prefix = self.embed_prefix(batch)
        v = self.velocity(prefix, x_t, t, self._prefix_mask(batch))
        err = (v - (noise - actions)).pow(2).mean(-1)
        valid = (~batch["action_pad"]).float() if "action_pad" in batch else torch.ones_like(err)
        return (err * valid).sum(-1) / valid.sum(-1).clamp_min(1.0)

    @torch.no_grad()
    def sample_actions(self, batch: dict[str, torch.Tensor], *, steps: int | None = None,
                       noise: torch.Tensor | None = None) -> torch.Tensor:
        """Integrate the flow from noise (t=1) to actions (t=0) with Euler steps; returns normalised actions.
        ``noise`` (B, chunk_size, action_dim): the starting point (default: drawn here)."""
        steps = steps or self.arch.num_inference_steps
        b = batch["lang_tokens"].shape[0]
        shape = (b, self.arch.chunk_size, self.arch.action_dim)
        x = torch.randn(shape, device=batch["lang_tokens"].device) if noise is None else noise.to(
            batch["lang_tokens"].device, torch.float32)
        prefix = self.embed_prefix(batch)
        mask = self._prefix_mask(batch)
        dt = -1.0 / steps
        for i in range(steps):
            t = torch.full((b,), 1.0 + i * dt, device=x.device)
            x = x + dt * self.velocity(prefix, x, t, mask)
        return x

    def unnormalize_actions(self, actions: torch.Tensor) -> torch.Tensor:
        return actions * self.action_std + self.action_mean


def _lerobot_policy() -> type:
    from lerobot.policies.pretrained import PreTrainedPolicy

    from loongforge_embodied.policies.lerobot_glue import ArchPolicyMixin
    from loongforge_embodied.policies.tiny_vla.configuration_tiny_vla import TinyVLAConfig
    from loongforge_embodied.policies.tiny_vla.processor_tiny_vla import prepare_batch as prepare

    class TinyVLAPolicy(ArchPolicyMixin, PreTrainedPolicy):
        config_class = TinyVLAConfig
        name = "loongforge_tiny_vla"
        model_class = TinyVLAModel
        stat_keys = STAT_KEYS
        prepare_batch = staticmethod(prepare)

    TinyVLAPolicy.__module__, TinyVLAPolicy.__qualname__ = __name__, "TinyVLAPolicy"
    return TinyVLAPolicy


def __getattr__(name: str):
    if name == "TinyVLAPolicy":
        cls = globals()[name] = _lerobot_policy()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
