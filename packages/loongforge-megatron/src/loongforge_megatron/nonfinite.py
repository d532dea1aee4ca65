"""Non-finite steps: a NaN / inf loss or gradient never reaches the weights, a checkpoint or an export.

Every step checks the reduced loss and this rank's gradients, then agrees across all ranks (one scalar
all-reduce), before the optimizer runs. Where the step folds the clipping into the fused Adam kernel
(``engine/optimizer.py``), the gradients' check is their norm, which that step computes anyway. A non-finite step
stops the run with a message naming it, or, with ``train.skip_nonfinite: true``, skips the update and is counted
(megatron-LM's ``--check-for-nan-in-loss-and-grad`` stops, its fp16 loss scaler skips). With fp16 loss scaling,
gradient overflows stay the scaler's business (it skips and lowers the scale); only a non-finite loss counts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from loongforge.errors import LoongForgeError


class NonFiniteError(LoongForgeError):
    """Training produced a non-finite loss, gradient or weight."""


def skip_nonfinite(recipe: Any) -> bool:
    """``train.skip_nonfinite`` (absent in older recipe schemas: false)."""
    return bool(getattr(recipe.train, "skip_nonfinite", False))


def uses_loss_scaling(optimizer: Any) -> bool:
    """True when megatron's optimizer scales the loss (fp16): it detects overflowing gradients itself."""
    inner = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return any(getattr(o, "grad_scaler", None) is not None for o in inner)


def _grad_tensors(model_chunks: Iterable[torch.nn.Module]) -> Iterable[torch.Tensor]:
    for m in model_chunks:
        buffers = getattr(m, "buffers", None)
        if isinstance(buffers, list):  # megatron DDP: contiguous grad buffers (after the data-parallel reduction)
            for buf in buffers + list(getattr(m, "expert_parallel_buffers", [])):
                yield buf.grad_data
            continue
        for p in m.parameters():
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            if g is not None:
                yield g


def _locally_finite(tensors: Iterable[torch.Tensor]) -> bool:
    # NOTE: one fp32 sum per buffer (NaN and inf propagate) instead of an elementwise mask the size of the model
    return all(bool(torch.isfinite(torch.sum(t, dtype=torch.float32))) for t in tensors if t.numel())


def all_ranks_finite(local_ok: bool) -> bool:
    """True when every rank's ``local_ok`` is (one all-reduce on the default group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return local_ok
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    flag = torch.tensor([0.0 if local_ok else 1.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return float(flag.item()) == 0.0


def step_is_finite(model_chunks: list[torch.nn.Module], loss: float, optimizer: Any) -> bool:
    """Whether this step's loss and (unless the optimizer scales the loss) gradients are finite on every rank."""
    ok = math.isfinite(loss)
    if ok and not uses_loss_scaling(optimizer):
        ok = _locally_finite(_grad_tensors(model_chunks))
    return all_ranks_finite(ok)


def weights_finite(model_chunks: list[torch.nn.Module]) -> bool:
    """Whether every rank's weights are finite (collective)."""
    return all_ranks_finite(_locally_finite(p.detach() for m in model_chunks for p in m.parameters()))


def last_checkpoint(root: Any) -> Any:
    """The run's latest complete checkpoint, for messages (None when there is none or ``latest`` is unusable)."""
    from loongforge.checkpoint.atomic import latest_checkpoint
    from loongforge.errors import CheckpointError

    try:
        return latest_checkpoint(root)
    except (CheckpointError, OSError):
        return None


def describe(step: int, out: dict[str, Any]) -> str:
    """``step N: loss nan, grad norm inf``."""
    parts = [f"loss {out.get('loss')}"]
    if out.get("grad_norm") is not None:
        parts.append(f"grad norm {out['grad_norm']}")
    return f"step {step}: {', '.join(parts)}"


class NonFiniteGuard:
    """The run's policy for non-finite steps: stop (default) or skip and count."""

    def __init__(self, recipe: Any, *, checkpoint_dir: Any = None, log: Any = None):
        self.skip = skip_nonfinite(recipe)
        self.skipped = 0
        self.checkpoint_dir = checkpoint_dir
        self.log = log

    def check(self, step: int, out: dict[str, Any]) -> None:
        """Raise :class:`NonFiniteError` for a non-finite step (or count it when skipping)."""
        grad_norm = out.get("grad_norm")
        bad = out.get("nonfinite") or not math.isfinite(out["loss"]) or (
            grad_norm is not None and not math.isfinite(grad_norm))
        if not bad:
            return
        if self.skip:
            self.skipped += 1
            if self.log:
                self.log.info(f"[train] {describe(step, out)}: update skipped (train.skip_nonfinite; "
                              f"{self.skipped} skipped so far)")
            return
        where = ""
        if self.checkpoint_dir is not None:
            last = last_checkpoint(self.checkpoint_dir)
            where = f"; the last checkpoint, {last}, is intact" if last is not None else "; no checkpoint was saved"
        when = "before updating the weights" if out.get("skipped") else "after its update"
        raise NonFiniteError(f"{describe(step, out)} is not finite: stopped {when}{where} "
                             "(lower train.lr, set train.grad_clip, or train.skip_nonfinite: true to skip such steps)")
