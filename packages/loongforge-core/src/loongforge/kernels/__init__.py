"""Kernel providers: the contract between kernel packages, hardware plugins and backends.

A provider (registered under the ``loongforge.kernels`` entry-point group) maps op names (:data:`OPS`) to
callables: one implementation record per op. Backends run kernels only through :func:`select` /
:func:`select_op` with the recipe's ``kernels.provider``, never by importing a kernel package; an accelerator
plugin may override any op through ``Accelerator.kernel_overrides()``. The record format and how to add an op:
``packages/loongforge-kernels/README.md``.

Selection rule (as in Liger-Kernel), the only one: an explicitly requested provider that cannot serve an op
raises; ``auto`` walks the preference order and falls back to the next provider.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Protocol

from loongforge.errors import PluginError

OPS: dict[str, str] = {
    "rms_norm": "rms_norm(x, weight, eps) -> y",
    "swiglu": "swiglu(x [..., 2F]) -> silu(x[..., :F]) * x[..., F:]",
    "rope": "rope(x, freqs, *, cu_seqlens=None) -> x rotated (megatron's rotate-half layout)",
    "fused_linear_cross_entropy": "fused_linear_cross_entropy(hidden, weight, labels, ...) -> loss without logits",
    "moe_permute": "moe_permute(tokens, indices, *, num_experts) -> (permuted, row_id_map, tokens_per_expert)",
    "moe_unpermute": "moe_unpermute(permuted, row_id_map, probs=None) -> tokens",
    "moe_router_topk": "moe_router_topk(logits, ...) -> the router's fused top-k",
    "sparse_mla_attention": "sparse_mla_attention(q, kv, indices, sm_scale, d_v) -> o (DSA attention)",
    "fp8_quantize": "fp8_quantize(x, granularity, dtype, *, layout) -> FP8 tensors and decode scales",
    "fp8_linear": ("fp8_linear(recipe, grad_dtype) -> FP8 linears: device_type, recipe, grad_dtype, "
                   "unavailable_reason(device), shape_ok(*dims), forward / backward (a TP linear's GEMMs), "
                   "linear(x, w, b, gemms), convert(model, skip=...), gemms(x, w, dy) (the profile's), "
                   "optional weight_cache (enabled, invalidate())"),
    "fp8_grouped_linear": ("fp8_grouped_linear() -> FP8 grouped expert GEMMs: device_type, unavailable_reason(device), "
                           "shape_ok(n, k), linear(x, w, offs, gemms), gemms(x, w, dy, offs)"),
    "adamw": "adamw(params, grads, exp_avgs, exp_avg_sqs, steps, *, lr, beta1, beta2, eps, weight_decay, grad_scale)",
    "adamw_plan": ("adamw_plan(params, exp_avgs, exp_avg_sqs, steps, row_sparse=None) -> the fused AdamW step kept "
                   "between steps: check(grads), launch(checked, ...), grad_sumsq(checked), check_scale, mark_rows"),
    "fp8_delta_encode": "fp8_delta_encode(x, ref) -> uint8 payload (the delta-FP8 all-gather codec)",
    "fp8_delta_apply": "fp8_delta_apply(recon, gathered, *, out=None) (decodes the gathered payloads in place)",
}
"""Every op a backend may ask the registry for, with its call contract (a provider may serve some of them)."""

AUTO_ORDER = ("triton", "tilelang", "torch")
JIT_PROVIDERS = ("triton", "tilelang")  # need the accelerator's ``capabilities().triton``


class KernelProvider(Protocol):
    """What a ``loongforge.kernels`` entry point must load to (a class; instantiated with no arguments)."""

    name: ClassVar[str]

    def unavailable_reason(self, device_type: str) -> str | None:
        """None when usable for tensors on ``device_type``, else why not (one line)."""

    def ops(self) -> Mapping[str, Callable[..., Any]]:
        """Op name -> implementation."""


def _provider(name: str) -> KernelProvider:
    from loongforge import registry

    cls = registry.kernels.get(name)
    return cls()


def select(op: str, *, provider: str = "auto", device_type: str = "cpu", accelerator: Any = None
           ) -> tuple[str, Callable[..., Any]]:
    """``(who serves it, implementation)`` of ``op`` for ``device_type``: the one selection rule.

    ``provider`` is ``auto`` or a provider name (the recipe's ``kernels.provider``). An explicit provider that
    cannot serve ``op`` here raises :class:`PluginError` (it never becomes another); ``auto`` takes the first of
    :data:`AUTO_ORDER` that can, and raises only when none can. Accelerator overrides win over providers
    (who: ``accelerator:<name>``).
    """
    if accelerator is not None:
        override = accelerator.kernel_overrides().get(op)
        if override is not None:
            return f"accelerator:{accelerator.name}", override
    from loongforge import registry

    no_jit = accelerator is not None and not accelerator.capabilities().triton
    if provider != "auto" and no_jit and provider in JIT_PROVIDERS:
        raise PluginError(f"kernel provider '{provider}' needs Triton, which accelerator '{accelerator.name}' lacks")
    if provider != "auto":
        prov = _provider(provider)
        reason = prov.unavailable_reason(device_type)
        if reason:
            raise PluginError(f"kernel provider '{provider}' cannot run on {device_type}: {reason}")
        impl = prov.ops().get(op)
        if impl is None:
            raise PluginError(f"kernel provider '{provider}' has no op '{op}'")
        return provider, impl
    reasons = []
    for name in AUTO_ORDER:
        if name not in registry.kernels or (no_jit and name in JIT_PROVIDERS):
            continue
        try:
            prov = _provider(name)
        except PluginError as exc:
            reasons.append(str(exc))
            continue
        if prov.unavailable_reason(device_type) is None and op in prov.ops():
            return name, prov.ops()[op]
    raise PluginError(f"no kernel provider serves op '{op}' on {device_type} ({'; '.join(reasons) or 'none installed'})")


def select_op(op: str, *, provider: str = "auto", device_type: str = "cpu", accelerator: Any = None) -> Callable[..., Any]:
    """The implementation of ``op`` for ``device_type`` under :func:`select`'s rule."""
    return select(op, provider=provider, device_type=device_type, accelerator=accelerator)[1]
