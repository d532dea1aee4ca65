"""Kernel providers registered under the ``loongforge.kernels`` entry-point group.

``select_op`` in loongforge core asks them what they can run; each op is pinned to its implementation,
so an explicitly selected provider never silently becomes another.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, ClassVar

from loongforge_kernels import _dispatch

OPS = (
    "rms_norm",
    "swiglu",
    "rope",
    "fused_linear_cross_entropy",
    "moe_permute",
    "moe_unpermute",
    "sparse_mla_attention",
    "moe_router_topk",
    "fp8_quantize",
    "adamw",
    "fp8_delta_encode",
    "fp8_delta_apply",
    "fp8_linear",
    "fp8_grouped_linear",
)
"""The ops the ``torch`` and ``triton`` providers serve (one record each: op name -> callable). ``fp8_linear``
and ``fp8_grouped_linear`` are factories: ``fp8_linear(recipe, grad_dtype)`` -> ``fp8_linear.Fp8Linears``,
``fp8_grouped_linear()`` -> ``fp8_grouped.Fp8GroupedLinears`` (the FP8 GEMMs run on CUDA whichever provider
serves them; the provider picks the quantization kernels)."""

TRITON_OPS = ("adamw_plan",)
"""Ops only the ``triton`` provider serves: ``adamw_plan`` -> ``adamw.AdamWPlan`` (the fused AdamW step over
tables kept between steps, as ``loongforge_embodied``'s ``KernelAdamW`` runs it)."""


def _ops(impl: str) -> dict[str, Callable[..., Any]]:
    from loongforge_kernels import (
        apply_fp8_deltas,
        apply_rope,
        encode_fp8_delta,
        fp8_quantize,
        fused_linear_cross_entropy,
        moe_permute,
        moe_router_topk,
        moe_unpermute,
        rms_norm,
        sparse_mla_attention,
        swiglu,
    )
    from loongforge_kernels.adamw import adamw_step_
    from loongforge_kernels.fp8_grouped import Fp8GroupedLinears
    from loongforge_kernels.fp8_linear import Fp8Linears

    fns = (
        rms_norm,
        swiglu,
        apply_rope,
        fused_linear_cross_entropy,
        moe_permute,
        moe_unpermute,
        sparse_mla_attention,
        moe_router_topk,
        fp8_quantize,
        adamw_step_,
        encode_fp8_delta,
        apply_fp8_deltas,
        Fp8Linears,
        Fp8GroupedLinears,
    )
    return {name: partial(fn, impl=impl) for name, fn in zip(OPS, fns, strict=True)}


class TorchProvider:
    """The plain-torch references: run anywhere torch runs."""

    name: ClassVar[str] = "torch"

    def unavailable_reason(self, device_type: str) -> str | None:
        return None

    def ops(self) -> Mapping[str, Callable[..., Any]]:
        return _ops("torch")


class TritonProvider:
    """The Triton kernels: CUDA tensors, or CPU tensors under Triton's interpreter."""

    name: ClassVar[str] = "triton"

    def unavailable_reason(self, device_type: str) -> str | None:
        return _dispatch.triton_unavailable_reason(device_type)

    def ops(self) -> Mapping[str, Callable[..., Any]]:
        from loongforge_kernels.adamw import AdamWPlan

        return {**_ops("triton"), "adamw_plan": AdamWPlan}


class TileLangProvider:
    """The TileLang kernels (optional ``tilelang`` package, CUDA SM >= 9.0): sparse MLA attention only.

    ``select_op`` treats a missing op as "not served": an explicit ``tilelang`` raises for the others, ``auto``
    walks on to the next provider.
    """

    name: ClassVar[str] = "tilelang"

    def unavailable_reason(self, device_type: str) -> str | None:
        from loongforge_kernels.tilelang_sparse_mla import tilelang_unavailable_reason

        return tilelang_unavailable_reason(device_type)

    def ops(self) -> Mapping[str, Callable[..., Any]]:
        from loongforge_kernels import sparse_mla_attention

        return {"sparse_mla_attention": partial(sparse_mla_attention, impl="tilelang")}
