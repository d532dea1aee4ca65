"""The kernels the embodied backend takes from the core's kernel registry: AdamW's step, the delta-FP8
all-gather codec and ``train.fp8``'s FP8 linears, chosen by the recipe's ``kernels.provider`` under the core's one rule
(``loongforge.kernels.select``): an explicit provider that cannot serve an op here raises; ``auto`` falls back,
down to the plain torch code (torch's own AdamW step, ``fp8_allgather``'s torch codec) when no provider serves it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

OPS = ("adamw", "fp8_delta_encode", "fp8_delta_apply")


@dataclass(frozen=True)
class Choice:
    """Who serves an op (a provider name, ``accelerator:<name>``, or ``torch`` for our own torch code) and the
    implementation (None: our own torch code)."""

    op: str
    provider: str
    impl: Callable[..., Any] | None


def choose(op: str, *, provider: str, device_type: str, accelerator: Any = None) -> Choice:
    """The implementation of ``op`` under the core's rule; raises ``PluginError`` for an explicit provider that
    cannot serve it."""
    from loongforge.errors import PluginError
    from loongforge.kernels import select

    try:
        who, impl = select(op, provider=provider, device_type=device_type, accelerator=accelerator)
    except PluginError:
        if provider != "auto":
            raise
        return Choice(op, "torch", None)
    return Choice(op, who, impl)


def check(*, provider: str, device_type: str, accelerator: Any = None, ops: tuple[str, ...] = OPS) -> None:
    """Every op a run takes can be served as the recipe asks (a one-line ``RecipeError`` at ``kernels.provider``)."""
    from loongforge.errors import PluginError, RecipeError

    for op in ops:
        try:
            choose(op, provider=provider, device_type=device_type, accelerator=accelerator)
        except PluginError as exc:
            raise RecipeError(str(exc).splitlines()[0], key="kernels.provider") from None


def fp8_linear(fp8: Any, *, provider: str, device_type: str, accelerator: Any = None) -> Any:
    """``train.fp8``'s FP8 linears: the registry's ``fp8_linear`` op for its recipe (``convert(model, skip=...)``
    swaps a model's linears; ``unavailable_reason(device)``). An explicit provider that cannot serve it is a one-line
    ``RecipeError`` at ``kernels.provider``."""
    from loongforge.errors import PluginError, RecipeError
    from loongforge.kernels import select_op

    try:
        make = select_op("fp8_linear", provider=provider, device_type=device_type, accelerator=accelerator)
    except PluginError as exc:
        raise RecipeError(f"train.fp8: {str(exc).splitlines()[0]}", key="kernels.provider") from None
    return make(fp8.recipe, fp8.grad_dtype)
