"""megatron's ``TopKRouter`` with its top-k routing (score function, expert bias, group-limited selection,
renormalisation, scaling) done by the fused ``moe_router_topk`` kernel from core's kernel registry; token dropping,
the aux / sequence-aux / z-losses and the expert-bias update stay megatron's own, unchanged.

NOTE: megatron's own fused path (``moe_router_fusion``) needs TransformerEngine; this is the same routing without
it. Sinkhorn / quantile balancing and router replay keep megatron's torch path.
"""

from __future__ import annotations

from typing import Any

import torch


def _topk_router():
    from megatron.core.transformer.moe.router import TopKRouter

    return TopKRouter


class FusedTopKRouter(_topk_router()):
    """``TopKRouter`` whose top-k routing runs one fused kernel (same parameters, same outputs)."""

    def __init__(self, *args: Any, provider: str = "auto", accelerator: Any = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.provider, self.accelerator = provider, accelerator
        self._topk = None

    def _fused_topk(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(dense probs [T, E], routing map [T, E]) as megatron's ``topk_routing_with_score_function``."""
        if self._topk is None:
            from loongforge_megatron.layers.modules import kernel

            self._topk = kernel("moe_router_topk", provider=self.provider, device_type=logits.device.type,
                                accelerator=self.accelerator)
        c = self.config
        probs_k, idx = self._topk(logits, topk=self.topk, score_function=self.score_function,
                                  pre_softmax=c.moe_router_pre_softmax, num_groups=c.moe_router_num_groups,
                                  group_topk=c.moe_router_group_topk, scaling_factor=c.moe_router_topk_scaling_factor,
                                  expert_bias=self.expert_bias)
        probs = torch.zeros_like(logits).scatter(1, idx, probs_k)
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, idx, True)
        return probs, routing_map

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
        """megatron 0.19's ``TopKRouter.routing`` with the fused top-k in place of its torch top-k."""
        if self.routing_type in ("sinkhorn", "quantile_balancing") or self.router_replay is not None:
            return super().routing(logits, padding_mask=padding_mask)
        from megatron.core.transformer.moe.moe_utils import (
            apply_router_token_dropping,
            compute_routing_scores_for_aux_loss,
        )

        seq_length, bsz = logits.shape[:2]
        logits = logits.view(-1, self.config.num_moe_experts)
        if padding_mask is not None:
            padding_mask = padding_mask.reshape(-1)
        logits = self.apply_z_loss(logits, padding_mask=padding_mask)
        probs, routing_map = self._fused_topk(logits)
        if self.config.moe_expert_capacity_factor is not None:
            probs, routing_map = apply_router_token_dropping(
                probs, routing_map, router_topk=self.topk, capacity_factor=self.config.moe_expert_capacity_factor,
                drop_policy=self.config.moe_token_drop_policy,
                pad_to_capacity=self.config.moe_pad_expert_input_to_capacity)
        if self.training and torch.is_grad_enabled() and self.is_aux_loss_enabled():
            aux_map, aux_scores = compute_routing_scores_for_aux_loss(
                logits, self.topk, self.score_function, fused=False, padding_mask=padding_mask)
            masked = padding_mask is not None
            probs = self._apply_aux_loss(probs, aux_scores, aux_map, with_padding_mask=masked)
            probs = self._apply_seq_aux_loss(probs, aux_scores, aux_map, seq_length, bsz, with_padding_mask=masked)
            probs = self._apply_global_aux_loss(probs, aux_scores, aux_map, with_padding_mask=masked)
        self._apply_expert_bias(routing_map, padding_mask=padding_mask)
        return probs, routing_map


def with_fused_router(layer_spec: Any, *, provider: str = "auto", accelerator: Any = None) -> Any:
    """``layer_spec`` with its MoE router replaced by :class:`FusedTopKRouter` (a dense spec is unchanged)."""
    import dataclasses
    import functools

    from megatron.core.transformer.moe.router import TopKRouter

    from loongforge_megatron.layers.megatron_layers import get_submodules, set_submodules

    mlp = layer_spec.submodules.mlp
    moe = get_submodules(mlp)
    if getattr(moe, "router", None) is not TopKRouter:
        return layer_spec
    router = functools.partial(FusedTopKRouter, provider=provider, accelerator=accelerator)
    mlp = set_submodules(mlp, dataclasses.replace(moe, router=router))
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(layer_spec.submodules, mlp=mlp))
