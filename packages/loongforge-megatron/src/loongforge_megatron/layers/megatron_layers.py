"""Transformer layer specs: which megatron-core modules make up one layer.

``local`` is megatron-core's own (non-TransformerEngine) spec with its norms replaced by :class:`TorchNorm`,
which supports sequence parallelism; ``te`` is megatron's TransformerEngine spec (CUDA only).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

LAYER_SPECS = ("local", "te")


class TorchNorm:
    """``torch.nn.RMSNorm`` / ``LayerNorm`` built the way megatron builds a norm, sequence-parallel aware.

    NOTE: without Apex, megatron's local spec uses ``WrappedTorchNorm``, which asserts
    ``not config.sequence_parallel``. Under sequence parallelism a norm sees only its rank's slice of the
    sequence, so its weight gradient is partial; marking the weights ``sequence_parallel`` makes megatron's
    ``finalize_model_grads`` all-reduce them over the tensor-parallel group (what FusedLayerNorm does).
    """

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> torch.nn.Module:
        if config.layernorm_zero_centered_gamma:
            raise ValueError("TorchNorm does not support layernorm_zero_centered_gamma")
        if config.normalization == "RMSNorm":
            norm: torch.nn.Module = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        else:
            raise ValueError(f"TorchNorm supports RMSNorm and LayerNorm, not {config.normalization!r}")
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm


@functools.cache
def row_parallel_linear():
    """megatron's ``RowParallelLinear`` handing its own TP group to the linear function (a class, built lazily).

    NOTE: megatron 0.19's ``RowParallelLinear.forward`` passes ``tp_group=None`` there (unused: no input-grad
    all-reduce), so every call looks up the default group and issues a DeprecationWarning: host time on every
    forward, and a graph break under torch.compile.
    """
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    class OwnGroupRowParallelLinear(RowParallelLinear):
        def _forward_impl(self, input, weight, *args, **kwargs):
            if kwargs.get("tp_group", self.tp_group) is None:
                kwargs["tp_group"] = self.tp_group
            return super()._forward_impl(input, weight, *args, **kwargs)

    return OwnGroupRowParallelLinear


def get_submodules(spec: Any) -> Any:
    """Submodules of a ModuleSpec or of a ``functools.partial(cls, submodules=...)`` spec (megatron uses both)."""
    if isinstance(spec, functools.partial):
        return spec.keywords.get("submodules")
    return getattr(spec, "submodules", None)


def set_submodules(spec: Any, sub: Any) -> Any:
    """``spec`` (a ModuleSpec or a ``functools.partial``) with ``sub`` as its submodules."""
    if isinstance(spec, functools.partial):
        return functools.partial(spec.func, *spec.args, **{**spec.keywords, "submodules": sub})
    return dataclasses.replace(spec, submodules=sub)


def with_own_group_row_linears(spec: Any) -> Any:
    """``spec`` with every megatron ``RowParallelLinear`` in its (nested) submodules replaced by
    :func:`row_parallel_linear`'s class; parameter names and checkpoints are unchanged."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    if spec is RowParallelLinear:
        return row_parallel_linear()
    if isinstance(spec, functools.partial):
        sub = get_submodules(spec)
        new = with_own_group_row_linears(sub)
        return spec if new is sub else set_submodules(spec, new)
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {}
        for f in dataclasses.fields(spec):
            value = getattr(spec, f.name)
            new = with_own_group_row_linears(value)
            if new is not value:
                changes[f.name] = new
        return dataclasses.replace(spec, **changes) if changes else spec
    return spec


def local_layer_spec(
    *,
    num_experts: int | None = None,
    qk_layernorm: bool = False,
    multi_latent_attention: bool = False,
    normalization: str = "RMSNorm",
):
    """megatron-core's local GPT layer spec (``SequentialMLP`` experts: ``layers.grouped_experts`` swaps in grouped
    GEMMs), with :class:`TorchNorm` norms."""
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    spec = get_gpt_layer_local_spec(
        num_experts=num_experts,
        moe_grouped_gemm=False,
        qk_layernorm=qk_layernorm,
        multi_latent_attention=multi_latent_attention,
        normalization=normalization,
    )
    sub = spec.submodules
    sub = dataclasses.replace(
        sub,
        input_layernorm=_swap(sub.input_layernorm, (WrappedTorchNorm, FusedLayerNorm)),
        pre_mlp_layernorm=_swap(sub.pre_mlp_layernorm, (WrappedTorchNorm, FusedLayerNorm)),
    )
    attn = sub.self_attention
    if attn.submodules is not None:
        fields = {f.name for f in dataclasses.fields(attn.submodules)}
        changes = {
            name: _swap(getattr(attn.submodules, name), (WrappedTorchNorm, FusedLayerNorm))
            for name in ("q_layernorm", "k_layernorm", "kv_layernorm")
            if name in fields
        }
        attn = dataclasses.replace(attn, submodules=dataclasses.replace(attn.submodules, **changes))
        sub = dataclasses.replace(sub, self_attention=attn)
    return dataclasses.replace(spec, submodules=sub)


def _swap(module: Any, megatron_norms: tuple[type, ...]) -> Any:
    """TorchNorm where the spec has megatron's torch/Apex norm; anything else (IdentityOp, L2Norm) is kept."""
    return TorchNorm if module in megatron_norms else module


def te_layer_spec(
    *,
    num_experts: int | None = None,
    qk_layernorm: bool = False,
    multi_latent_attention: bool = False,
    moe_grouped_gemm: bool = False,
):
    """megatron-core's TransformerEngine GPT layer spec (needs TransformerEngine; CUDA)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    return get_gpt_layer_with_transformer_engine_spec(
        num_experts=num_experts,
        moe_grouped_gemm=moe_grouped_gemm,
        qk_layernorm=qk_layernorm,
        multi_latent_attention=multi_latent_attention,
    )


def layer_spec(name: str, **kwargs: Any):
    """The layer spec called ``name`` (one of :data:`LAYER_SPECS`)."""
    if name == "local":
        return local_layer_spec(**kwargs)
    if name == "te":
        kwargs.pop("normalization", None)
        return te_layer_spec(**kwargs)
    raise ValueError(f"layer spec {name!r}; allowed: {', '.join(LAYER_SPECS)}")
