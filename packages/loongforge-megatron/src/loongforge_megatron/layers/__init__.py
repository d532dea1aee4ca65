"""The ``loongforge`` layer spec: megatron-core's local layer with SDPA flash attention and fused kernels
(RMSNorm, SwiGLU, RoPE) — a fast path that needs no TransformerEngine. Parameter names are identical to the
local spec, so checkpoints and the HF name maps are shared."""

from __future__ import annotations

import dataclasses
from typing import Any

from loongforge_megatron.layers.attention import SDPAttention
from loongforge_megatron.layers.megatron_layers import get_submodules, set_submodules
from loongforge_megatron.layers.modules import KernelRMSNorm, KernelSwiGLU

__all__ = ["KernelRMSNorm", "KernelSwiGLU", "SDPAttention", "loongforge_layer_spec", "prepare_config"]


def prepare_config(config: Any) -> Any:
    """Config switches the spec relies on: the MLP calls our activation module on the whole fc1 output."""
    config.use_te_activation_func = True
    return config


def _replace_norms(sub: Any, norm: Any) -> Any:
    from loongforge_megatron.layers.megatron_layers import TorchNorm

    changes = {}
    for f in dataclasses.fields(sub):
        value = getattr(sub, f.name)
        if value is TorchNorm:
            changes[f.name] = norm
    return dataclasses.replace(sub, **changes) if changes else sub


def _with_activation(mlp_spec: Any, act: Any) -> Any:
    """Set ``activation_func`` on an MLP spec, or on the expert / shared-expert MLPs of a MoE spec."""
    sub = get_submodules(mlp_spec)
    if sub is None or not dataclasses.is_dataclass(sub):
        return mlp_spec
    names = {f.name for f in dataclasses.fields(sub)}
    changes = {}
    if "activation_func" in names:
        changes["activation_func"] = act
    for name in ("experts", "shared_experts"):
        if name in names and getattr(sub, name) is not None:
            changes[name] = _with_activation(getattr(sub, name), act)
    return set_submodules(mlp_spec, dataclasses.replace(sub, **changes)) if changes else mlp_spec


def loongforge_layer_spec(*, num_experts: int | None = None, qk_layernorm: bool = False,
                          multi_latent_attention: bool = False, provider: str = "auto", accelerator: Any = None,
                          moe_grouped_gemm: bool = False, moe_permute_dispatch: bool = False,
                          moe_router_fusion: bool = False, moe_replica_slots: int = 0,
                          moe_overlap_a2a: bool = False):
    """megatron's local GPT layer spec with SDPA core attention, kernel RoPE (not MLA), kernel RMSNorm,
    kernel SwiGLU, and row-parallel linears that pass their own TP group (:func:`row_parallel_linear`)."""
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.spec_utils import ModuleSpec

    from loongforge_megatron.layers.megatron_layers import local_layer_spec, with_own_group_row_linears
    from loongforge_megatron.layers.rope import KernelRoPESelfAttention

    spec = local_layer_spec(num_experts=num_experts, qk_layernorm=qk_layernorm,
                            multi_latent_attention=multi_latent_attention)
    if moe_grouped_gemm and num_experts:
        from loongforge_megatron.layers.grouped_experts import with_grouped_experts

        spec = with_grouped_experts(spec)
    params = {"provider": provider, "accelerator": accelerator}
    norm = ModuleSpec(module=KernelRMSNorm, params=params)
    act = ModuleSpec(module=KernelSwiGLU, params=params)
    sub = _replace_norms(spec.submodules, norm)
    attn = sub.self_attention
    attn_sub = _replace_norms(attn.submodules, norm)
    attn_sub = dataclasses.replace(attn_sub, core_attention=SDPAttention)
    attn = dataclasses.replace(attn, submodules=attn_sub)
    if attn.module is SelfAttention:  # MLA keeps megatron's MLASelfAttention and its rope
        attn = dataclasses.replace(attn, module=KernelRoPESelfAttention, params={**attn.params, **params})
    sub = dataclasses.replace(sub, self_attention=attn,
                              mlp=_with_activation(sub.mlp, act))
    spec = with_own_group_row_linears(dataclasses.replace(spec, submodules=sub))
    if moe_router_fusion:
        from loongforge_megatron.layers.fused_router import with_fused_router

        spec = with_fused_router(spec, provider=provider, accelerator=accelerator)
    if moe_permute_dispatch:
        from loongforge_megatron.layers.permute_dispatch import with_permute_dispatch

        spec = with_permute_dispatch(spec, provider=provider, accelerator=accelerator)
    if moe_replica_slots or moe_overlap_a2a:
        from loongforge_megatron.layers.ep_moe_layer import with_ep_moe_layer

        spec = with_ep_moe_layer(spec, replica_slots=moe_replica_slots, overlap_a2a=moe_overlap_a2a)
    return spec
