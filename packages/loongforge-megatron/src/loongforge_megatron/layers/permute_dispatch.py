"""Token dispatch for MoE layers whose experts all live on this rank (ep = 1, expert-TP = 1): the fused
``moe_permute`` kernel sorts the tokens by expert, and ``moe_unpermute`` combines the experts' outputs weighted by
the routing probabilities (folded into the combine, so the experts never scale their activations). Tokens over
an expert's capacity (``moe_capacity_factor``) are dropped without padding: their slots get no row.

No host synchronisation: the token counts stay on the device (the grouped experts take them there), where
megatron's all-to-all dispatcher copies them to the host once per layer even without expert parallelism.

NOTE: ``fc2(act(h) * p) == p * fc2(act(h))`` for bias-free experts, so folding ``p`` into the combine gives the
same result as megatron's experts (up to rounding).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch


def _megatron_bases():
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

    return MoELayer, MoETokenDispatcher


_MoELayer, _MoETokenDispatcher = _megatron_bases()


class PermuteDispatcher(_MoETokenDispatcher):
    """Local expert-sorted dispatch through the ``moe_permute`` / ``moe_unpermute`` kernels (see module doc)."""

    def __init__(self, config: Any, pg_collection: Any, *, provider: str = "auto", accelerator: Any = None):
        super().__init__(config, pg_collection)
        if self.ep_size != 1 or self.tp_size != 1:
            raise ValueError(f"the permute dispatcher runs all experts on one rank (ep {self.ep_size}, expert tp "
                             f"{self.tp_size}); use moe_token_dispatcher alltoall")
        if config.moe_pad_expert_input_to_capacity:
            raise ValueError("the permute dispatcher does not pad experts to capacity; with moe_pad_to_capacity "
                             "use alltoall")
        self.may_drop = config.moe_expert_capacity_factor is not None
        self.num_experts, self.topk = config.num_moe_experts, config.moe_router_topk
        self.provider, self.accelerator = provider, accelerator
        self._permute = self._unpermute = None

    def _kernels(self, device_type: str) -> None:
        from loongforge_megatron.layers.modules import kernel

        kw = dict(provider=self.provider, device_type=device_type, accelerator=self.accelerator)
        self._permute, self._unpermute = kernel("moe_permute", **kw), kernel("moe_unpermute", **kw)

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        if self._permute is None:
            self._kernels(hidden_states.device.type)
        self.hidden_shape = hidden_states.shape
        self.routing_map = routing_map
        tokens = hidden_states.reshape(-1, self.hidden_shape[-1])
        # NOTE: routing marks at most top-k experts per token (fewer where capacity dropped some); their
        # probabilities are the top-k of the masked scores (differentiable: the router's gradient flows through
        # the gather). A slot of a dropped expert gets index -1: no row, no weight.
        probs_k, indices = probs.masked_fill(~routing_map, float("-inf")).topk(self.topk, dim=-1)
        if self.may_drop:
            kept = routing_map.gather(1, indices)
            indices = indices.masked_fill(~kept, -1)
            probs_k = torch.where(kept, probs_k, torch.zeros_like(probs_k))
        self.probs_k = probs_k
        permuted, self.row_id_map, _ = self._permute(tokens, indices, num_experts=self.num_experts)
        self.tokens_per_expert = routing_map.sum(dim=0)
        return permuted, None

    def token_dispatch(self, hidden_states: torch.Tensor, probs: Any):
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: Any):
        return hidden_states, self.tokens_per_expert, None

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = self._unpermute(hidden_states, self.row_id_map, self.probs_k)
        self.row_id_map = self.probs_k = None
        return out.view(self.hidden_shape)


class PermuteMoELayer(_MoELayer):
    """megatron's ``MoELayer`` with :class:`PermuteDispatcher` as its token dispatcher (same parameters)."""

    def __init__(self, *args: Any, provider: str = "auto", accelerator: Any = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        old = self.token_dispatcher
        groups = SimpleNamespace(ep=old.ep_group, expt_tp=old.tp_group, tp_ep=old.tp_ep_group)
        self.token_dispatcher = PermuteDispatcher(self.config, groups, provider=provider, accelerator=accelerator)
        if self.shared_expert_overlap:
            raise ValueError("moe_shared_expert_overlap overlaps an all-to-all; the permute dispatcher has none")


def with_permute_dispatch(layer_spec: Any, *, provider: str = "auto", accelerator: Any = None) -> Any:
    """``layer_spec`` with its ``MoELayer`` replaced by :class:`PermuteMoELayer` (a dense spec is unchanged)."""
    import dataclasses
    import functools

    mlp = layer_spec.submodules.mlp
    if not isinstance(mlp, functools.partial) or mlp.func is not _MoELayer:
        return layer_spec
    mlp = functools.partial(PermuteMoELayer, *mlp.args, **mlp.keywords, provider=provider, accelerator=accelerator)
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(layer_spec.submodules, mlp=mlp))
