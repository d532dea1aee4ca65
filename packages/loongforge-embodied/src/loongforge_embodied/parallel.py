"""Apply the recipe's data-parallel strategy to a policy: ddp, zero1, fsdp2 (per-block ``fully_shard``) or
hsdp (FSDP2 on a 2-D replicate × shard DeviceMesh), optionally with delta-FP8 parameter all-gathers. Frozen
components stay unsharded and out of the optimizer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from loongforge_embodied.fp8_allgather import AllGatherHook


@dataclass
class Parallelized:
    """The model as the step loop uses it: ``module`` to call, ``raw`` for names and state."""

    module: nn.Module
    raw: nn.Module
    strategy: str
    mesh: object | None = None
    units: list[nn.Module] = field(default_factory=list)
    allgather: AllGatherHook | None = None  # delta-FP8 all-gathers (call ``allgather.step()`` per optimizer step)
    notes: list[str] = field(default_factory=list)  # what wrapping changed, for the run log

    @contextlib.contextmanager
    def no_sync(self, skip: bool) -> Iterator[None]:
        """Within it, backward accumulates gradients locally (no all-reduce / reduce-scatter)."""
        if not skip:
            yield
            return
        if isinstance(self.module, nn.parallel.DistributedDataParallel):
            with self.module.no_sync():
                yield
            return
        if self.strategy in ("fsdp2", "hsdp"):
            self.module.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self.module.set_requires_gradient_sync(True)
            return
        yield


def resolve_strategy(strategy: str, world_size: int) -> str:
    """``auto``: ddp (the policies we ship fit one device; pick fsdp2 explicitly for large ones)."""
    return "ddp" if strategy == "auto" else strategy


def parallelize(
    model: nn.Module, *, strategy: str, world_size: int, device: torch.device, precision: str,
    comm_hook: str = "none", shard_size: int | None = None, reshard_after_forward: bool = True, prefetch: int = 1,
    fp8_allgather: bool = False, reprime_every: int = 0, kernels: str = "auto", accelerator: Any = None,
) -> Parallelized:
    """Wrap ``model`` (already on ``device``, frozen params already ``requires_grad=False``)."""
    strategy = resolve_strategy(strategy, world_size)
    if fp8_allgather:
        from loongforge.errors import RecipeError

        from loongforge_embodied.fp8_allgather import fp8_unsupported_reason

        reason = (f"is an FSDP2 hook: needs parallel.strategy fsdp2 or hsdp (got '{strategy}')"
                  if strategy not in ("fsdp2", "hsdp") else fp8_unsupported_reason(device))
        if reason:
            raise RecipeError(f"delta-FP8 all-gather {reason}", key="model.fp8_allgather.enabled")
    if strategy in ("ddp", "zero1"):
        if world_size == 1:
            return Parallelized(model, model, strategy)
        ddp = nn.parallel.DistributedDataParallel(
            model, device_ids=[device] if device.type != "cpu" else None, broadcast_buffers=False,
            gradient_as_bucket_view=True,
        )
        if comm_hook == "bf16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        return Parallelized(ddp, model, strategy)
    par = _fully_shard(model, strategy=strategy, world_size=world_size, device=device, precision=precision,
                       shard_size=shard_size, reshard_after_forward=reshard_after_forward, prefetch=prefetch)
    if fp8_allgather:
        from loongforge_embodied.fp8_allgather import enable_delta_fp8_allgather

        par.allgather = enable_delta_fp8_allgather(model, reprime_every=reprime_every, kernels=kernels,
                                                   accelerator=accelerator)
    return par


def _fully_shard(model, *, strategy, world_size, device, precision, shard_size, reshard_after_forward, prefetch):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if strategy == "hsdp":
        shard = shard_size or world_size
        mesh = init_device_mesh(device.type, (world_size // shard, shard), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",))
    # NOTE: params are gathered in bf16 but gradients are reduced in fp32 (master weights stay fp32).
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if precision == "bf16" \
        else MixedPrecisionPolicy()
    notes = []
    trainable_dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
    if len(trainable_dtypes) > 1:
        # NOTE: FSDP2 shards one dtype per unit, and a policy may keep some weights in bf16 and others in fp32
        # (LeRobot's PI05 "bfloat16": vision tower, projector and norms fp32). Sharded master weights become fp32;
        # with precision bf16 the mixed-precision policy still gathers and computes in bf16.
        for p in model.parameters():
            if p.requires_grad and p.dtype != torch.float32:
                p.data = p.data.float()
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in trainable_dtypes))
        notes.append(f"{strategy}: trainable weights were {names}; sharded master weights are float32")
    frozen = {p for p in model.parameters() if not p.requires_grad}
    units = [u for u in model.wrap_units() if any(p.requires_grad for p in u.parameters())]
    for u in units:
        fully_shard(u, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward,
                    ignored_params={p for p in u.parameters() if p in frozen} or None)
    # NOTE: the root unit takes the remaining (non-block) trainable params; frozen ones are ignored, i.e. kept
    # whole on every rank and never all-gathered or reduced.
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward, ignored_params=frozen or None)
    if prefetch:
        for i, u in enumerate(units):
            if i + 1 < len(units):
                u.set_modules_to_forward_prefetch(units[i + 1:i + 1 + prefetch])
            if i > 0:
                u.set_modules_to_backward_prefetch(units[max(0, i - prefetch):i][::-1])
    return Parallelized(model, model, strategy, mesh=mesh, units=units, notes=notes)


@torch.no_grad()
def clip_grad_norm(params: list[nn.Parameter], max_norm: float, *,
                   into: torch.optim.Optimizer | None = None) -> torch.Tensor:
    """Global grad-norm clipping over plain or DTensor (sharded) gradients; returns the pre-clip norm as a
    tensor (no host sync: read it only when logging).

    ``into``: a fused Adam / AdamW (``fused_scale_target``) whose next ``step()`` applies the clip: its kernel
    divides every gradient by ``grad_scale`` (the hook AMP's ``GradScaler`` uses; the unscaled gradient is
    written back), so clipping costs no pass of its own over the gradients. Sharded (DTensor) gradients are
    always scaled here. The caller clears ``into.grad_scale`` after the step (as ``GradScaler`` does)."""
    if into is not None:
        into.grad_scale = None
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    # NOTE: our AdamW computes the norm from the gradient table its step then reuses (None: it cannot serve these)
    norm = into.grad_norm(params) if into is not None and hasattr(into, "grad_norm") else None
    if norm is None:
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    if max_norm > 0:
        if into is not None and not any(hasattr(g, "to_local") for g in grads):
            # NOTE: 1 / torch's clip coefficient min(max_norm / (norm + 1e-6), 1).
            into.grad_scale = ((norm.float() + 1e-6) / max_norm).clamp(min=1.0)  # fused AdamW takes fp32 only
            return norm
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        # NOTE: scale the local shards: DTensor x plain-tensor arithmetic is not allowed.
        torch._foreach_mul_([g.to_local() if hasattr(g, "to_local") else g for g in grads], coef)
    return norm


def all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value)
    return value
