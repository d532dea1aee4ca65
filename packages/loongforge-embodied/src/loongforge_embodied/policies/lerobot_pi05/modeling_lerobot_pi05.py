"""LeRobot's own ``PI05Pytorch`` as a policy of our trainer.

``self.model`` is LeRobot's module, so parameter names are exactly ``PI05Policy``'s (``model.…``) and an export
loads with ``PI05Policy.from_pretrained``. The loss is ``PI05Policy.forward``'s, built here without its
``.item()`` / ``.cpu()`` logging: ``PI05Pytorch.forward`` → truncate to the dataset's action dims → mean over
chunk steps and dims per sample (LeRobot's ``reduction="none"``; like LeRobot, padded chunk steps count).
Noise and flow time come from the batch (drawn per sample by the data pipeline, same Beta(1.5, 1) law).

Parameters that cannot reach the training loss are frozen (no gradient, no optimizer state, no DDP bucket):
both 257,152-row ``lm_head``s, the last prefix layer's query/output projections, MLP and post-attention norm,
and the prefix final norm (``PI05Pytorch.forward`` reads only the action tokens of the last layer).
"""

from __future__ import annotations

import torch
from torch import nn

from loongforge_embodied.policies import siglip_names
from loongforge_embodied.policies.lerobot_pi05.configuration_lerobot_pi05 import LeRobotPI05Arch

STAT_KEYS = ("state_mean", "state_std", "state_q01", "state_q99", "action_mean", "action_std", "action_q01",
             "action_q99")


class _Stats(nn.Module):
    """Normalisation statistics as buffers (``stats.*``): saved with checkpoints, written to the export's
    ``loongforge.json`` (not to ``model.safetensors``, whose names are LeRobot's). Sized by the padded
    ``max_*_dim`` so a checkpoint of another dataset (another state/action size) still loads."""

    def __init__(self, arch: LeRobotPI05Arch):
        super().__init__()
        for key in STAT_KEYS:
            dim = arch.max_state_dim if key.startswith("state") else arch.max_action_dim
            fill = {"std": 1.0, "q01": -1.0, "q99": 1.0}.get(key.rsplit("_", 1)[1], 0.0)
            self.register_buffer(key, torch.full((dim,), fill))


class LeRobotPI05Model(nn.Module):
    """Components ``vision`` (SigLIP + projector), ``language`` (PaliGemma's Gemma) and ``expert`` (Gemma
    expert + action/time projections). ``wrap_units()``: the vision encoder layers, then each (prefix layer,
    expert layer) pair of the joint steps, in execution order."""

    def __init__(self, arch: LeRobotPI05Arch):
        super().__init__()
        from loongforge_embodied.policies.lerobot_pi05.attention import fuse_siglip_qkv, mark_layers
        from loongforge_embodied.policies.lerobot_pi05.build import build_pi05

        self.arch = arch
        self.model, self.config = build_pi05(arch)
        self.stats = _Stats(arch)
        mark_layers(self._prefix_layers(), sdpa=bool(arch.sdpa))
        fuse_siglip_qkv(siglip_names.encoder_layers(self._pwe.paligemma.model.vision_tower))
        for p in self._unused_in_training():
            p.requires_grad_(False)

    # ----------------------------------------------------------------- structure
    @property
    def _pwe(self):
        return self.model.paligemma_with_expert

    def _prefix_layers(self) -> nn.ModuleList:
        return self._pwe.paligemma.model.language_model.layers

    def _expert_layers(self) -> nn.ModuleList:
        return self._pwe.gemma_expert.model.layers

    def _unused_in_training(self) -> list[nn.Parameter]:
        last = self._prefix_layers()[-1]
        mods = [self._pwe.paligemma.lm_head, self._pwe.gemma_expert.lm_head, last.self_attn.q_proj,
                last.self_attn.o_proj, last.mlp, last.post_attention_layernorm, self._pwe.paligemma.model.language_model.norm]
        return [p for m in mods for p in m.parameters()]

    def components(self) -> dict[str, list[nn.Module]]:
        """Named parameter groups (``model.freeze`` takes these names)."""
        pg = self._pwe.paligemma.model
        m = self.model
        return {"vision": [pg.vision_tower, pg.multi_modal_projector], "language": [pg.language_model],
                "expert": [self._pwe.gemma_expert, m.action_in_proj, m.action_out_proj, m.time_mlp_in, m.time_mlp_out]}

    def wrap_units(self) -> list[nn.Module]:
        """FSDP2 / compile units in execution order. The joint step enters a pair's two units itself
        (``attention._entered``): LeRobot calls the layers' submodules, never the layers."""
        vision = siglip_names.encoder_layers(self._pwe.paligemma.model.vision_tower)
        pairs = [u for pair in zip(self._prefix_layers(), self._expert_layers(), strict=True) for u in pair]
        return [*vision, *pairs]

    def _token_table(self) -> nn.Parameter:
        return self._pwe.paligemma.model.language_model.embed_tokens.weight

    def row_sparse_params(self) -> list[nn.Parameter]:
        """Trainable tables whose gradient is zero outside the rows a batch looks up (``row_sparse_rows``):
        PaliGemma's 257,152-row token table, of which a batch reads a few dozen rows."""
        table = self._token_table()
        return [table] if table.requires_grad else []

    def row_sparse_rows(self, batch: dict[str, torch.Tensor]) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(table, rows this batch looks up): the prompt tokens, padding included (``embed_language_tokens``)."""
        table = self._token_table()
        return [(table, batch["lang_tokens"])] if table.requires_grad else []

    def enable_activation_checkpointing(self) -> None:
        """LeRobot's ``gradient_checkpointing_enable`` (every joint layer is a checkpoint), minus its nesting.

        NOTE: LeRobot's flag also wraps the whole joint stack in one more checkpoint (``PI05Pytorch.forward``'s
        ``forward_func``) around the per-layer ones, so backward recomputes every joint layer twice (counted:
        2 forward calls, 4 recomputes for 2 layers). We keep the per-layer checkpoints only, and checkpoint the
        vision tower per encoder layer (HF's) instead of LeRobot's whole tower per camera."""
        self.model.gradient_checkpointing_enable()
        self.model.gradient_checkpointing_enabled = False
        self._pwe.paligemma.model.vision_tower.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})

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
        return [images[:, i] for i in range(cams)], [ones] * cams, batch["lang_tokens"], batch["lang_mask"]

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-sample loss (B,): ``PI05Policy.forward(batch, reduction="none")`` without host syncs."""
        _require_adapted()
        images, img_masks, tokens, masks = self._inputs(batch)
        losses = self.model(images, img_masks, tokens, masks, batch["actions"], batch["noise"], batch["time"])
        return losses[:, :, : self.arch.action_dim].mean(dim=(1, 2))

    @torch.no_grad()
    def sample_actions(self, batch: dict[str, torch.Tensor], *, steps: int | None = None,
                       noise: torch.Tensor | None = None) -> torch.Tensor:
        """LeRobot's Euler sampler (KV-cached prefix); returns normalised actions (B, chunk, action_dim).

        NOTE: LeRobot 0.6.1's prefix pass (``PiGemmaModel.forward``) calls ``create_causal_mask(cache_position=…)``,
        which transformers 5.24 (our lock; LeRobot's ``pi`` extra pins <5.6) rejects; the ``pi-gemma-mask-kwargs``
        adaptation (``attention.mask_kwargs_adaptation``) translates the call."""
        _require_adapted()
        images, img_masks, tokens, masks = self._inputs(batch)
        out = self.model.sample_actions(images, img_masks, tokens, masks, noise=noise, num_steps=steps)
        return out[:, :, : self.arch.action_dim]

    def unnormalize_actions(self, actions: torch.Tensor) -> torch.Tensor:
        from loongforge_embodied.policies.lerobot_pi05.processor_lerobot_pi05 import unnormalize

        return unnormalize(actions, "action", stats=self.stats_dict(), quantiles=bool(self.arch.quantile_norm))


def adaptations() -> list:
    """What a run of this policy applies through the adaptation door (``attention.adaptations``)."""
    from loongforge_embodied.policies.lerobot_pi05.attention import adaptations as pi05_adaptations

    return pi05_adaptations()


def _require_adapted() -> None:
    from loongforge_embodied.policies.lerobot_pi05.attention import NAME, is_adapted

    if not torch.compiler.is_compiling() and not is_adapted():
        raise RuntimeError(f"LeRobotPI05Model runs with its adaptations applied ('{NAME}', ...): a job applies them "
                           "for its run; elsewhere use `with loongforge_embodied.policies.lerobot_pi05.attention"
                           ".adapted(): ...`")
