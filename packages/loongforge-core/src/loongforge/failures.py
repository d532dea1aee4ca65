"""How one rank's failure, or a non-finite step, ends the whole run: the failure machinery every backend uses.

- :func:`agree` ends a phase (build, resume) on every rank together. A rank that failed joins the same collective
  as the healthy ones instead of leaving them hung in their next collective (or ending them with a peer's
  "connection closed" instead of the cause); every rank then raises with the failing rank's message.
- :class:`NonFiniteGuard` is a run's policy for a step whose loss or grad norm is NaN / inf: stop naming the step
  (default), or, with ``train.skip_nonfinite``, skip its update and count it in the :data:`SKIPPED_NONFINITE`
  metric. :func:`check_weights_finite` refuses to save or export weights holding NaN / inf.
- :func:`marker_path` is where a launch attempt's first failing rank records its one-line error, so the console
  shows it once (``loongforge.worker``).

The error classes (``PeerFailedError``, ``NonFiniteError``) live with the others in ``loongforge.errors``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from loongforge.errors import CheckpointError, LoongForgeError, NonFiniteError, PeerFailedError

SKIPPED_NONFINITE = "skipped_nonfinite"  # metric: steps whose update train.skip_nonfinite dropped (this process)
FAILED = ".failed"  # OUTPUT/.failed.<restart>: the first failing rank's one-line error (one launch attempt)


def marker_path(output: str | Path) -> Path:
    """This launch attempt's failure marker in the run directory ``output``."""
    return Path(output) / f"{FAILED}.{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _distributed(group: dist.ProcessGroup | None) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _flag_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a collective's small tensor lives: the current CUDA device under NCCL, else the CPU."""
    nccl = "nccl" in str(dist.get_backend(group)).lower()
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


def describe_error(exc: BaseException) -> str:
    """``exc`` on one line: a user error's own first line; any other error's prefixed with its type."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if isinstance(exc, LoongForgeError):
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _on_every_rank(exc: BaseException) -> BaseException:
    exc._loongforge_agreed = True
    return exc


def raised_on_every_rank(exc: BaseException) -> bool:
    """Whether every rank raises ``exc`` at the same point (from :func:`agree`, or an agreed non-finite verdict), so
    the ranks can still meet in a last collective (e.g. the barrier before the process group is torn down)."""
    return isinstance(exc, PeerFailedError | NonFiniteError) or getattr(exc, "_loongforge_agreed", False)


def agree(error: BaseException | None, *, phase: str, device: torch.device | None = None,
          group: dist.ProcessGroup | None = None) -> None:
    """Collective over ``group``: every rank passes its exception from ``phase`` (or None). Returns when all ranks
    succeeded. Otherwise the failing rank re-raises its own error (an internal error keeps its traceback there) and
    the others raise :class:`PeerFailedError` with the first failing rank's message: a user error's own text (so
    the worker prints it once), else ``rank R failed during PHASE (k of N ranks): Type: text``.

    ``device``: where the flag tensor lives (default: the current CUDA device under NCCL, else the CPU)."""
    if not _distributed(group):
        if error is not None:
            raise _on_every_rank(error)
        return
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    flags = torch.zeros(world, dtype=torch.int32, device=device or _flag_device(group))
    if error is not None:
        flags[rank] = 1
    dist.all_reduce(flags, group=group)
    failed = [r for r, f in enumerate(flags.tolist()) if f]
    if not failed:
        return
    # NOTE: the messages travel only after a failure (every rank knows of it now, so every rank joins)
    mine = None if error is None else (isinstance(error, LoongForgeError), describe_error(error))
    statuses: list[tuple[bool, str] | None] = [None] * world
    dist.all_gather_object(statuses, mine, group=group)
    first = failed[0]
    user_error, message = statuses[first]
    if error is not None and not isinstance(error, LoongForgeError):
        raise _on_every_rank(error)
    n = len({statuses[r] for r in failed}) - 1
    others = f" (and {n} other error{'s' if n > 1 else ''} on other ranks)" if n else ""
    if user_error:
        if error is not None and not others and describe_error(error) == message:
            raise _on_every_rank(error)
        raise PeerFailedError(f"{message}{others}", rank=first) from None
    raise PeerFailedError(f"rank {first} failed during {phase} ({len(failed)} of {world} ranks): {message}{others}",
                          rank=first) from None


def all_ranks_finite(local_ok: bool, *, device: torch.device | None = None,
                     group: dist.ProcessGroup | None = None) -> bool:
    """True when ``local_ok`` holds on every rank of ``group`` (one all-reduce of one number; collective)."""
    if not _distributed(group):
        return local_ok
    flag = torch.tensor([0 if local_ok else 1], dtype=torch.int32, device=device or _flag_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return int(flag.item()) == 0


def tensors_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether every floating-point value of ``tensors`` is finite (this rank's: a DTensor's local shard)."""
    # NOTE: one fp32 sum per tensor (NaN and inf propagate) instead of an elementwise mask the size of the model,
    # and one read to the host per device instead of one per tensor
    sums: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        t = t.detach()
        t = t.to_local() if hasattr(t, "to_local") else t
        if t.numel() and t.is_floating_point():
            sums.setdefault(t.device, []).append(torch.sum(t, dtype=torch.float32))
    return all(bool(torch.isfinite(torch.stack(s)).all()) for s in sums.values())


def _last_checkpoint(root: Path | None) -> Path | None:
    """The run's latest complete checkpoint, for messages (None when there is none or ``latest`` is unusable)."""
    if root is None:
        return None
    from loongforge.checkpoint.atomic import latest_checkpoint

    try:
        return latest_checkpoint(root)
    except (CheckpointError, OSError):
        return None


def _intact(root: Path | None) -> str:
    if root is None:
        return "the last checkpoint is intact"
    last = _last_checkpoint(root)
    return f"the last checkpoint is intact ({last if last is not None else 'none saved yet'})"


def check_weights_finite(tensors: Iterable[torch.Tensor], *, step: int, what: str, checkpoint_dir: Path | None = None,
                         device: torch.device | None = None) -> None:
    """Refuse to write ``what`` (a checkpoint, an export) of weights holding NaN / inf: a :class:`NonFiniteError` on
    every rank when any rank's ``tensors`` hold one (collective)."""
    if not all_ranks_finite(tensors_finite(tensors), device=device):
        raise NonFiniteError(f"the weights after step {step} hold NaN / inf values: the {what} is not written "
                             f"({_intact(checkpoint_dir)}); lower train.lr or raise train.grad_clip")


def _values(step: int, loss: float, grad_norm: float | None) -> str:
    norm = "" if grad_norm is None else f" and the grad norm {grad_norm:g}"
    return f"step {step}: the loss is {loss:g}{norm}"


class NonFiniteGuard:
    """A run's policy for a step whose loss or grad norm is NaN / inf (``train.skip_nonfinite``): stop with a
    :class:`NonFiniteError` naming the step (default; nothing of it or after it is saved), or skip its update and
    count it (``skipped``, the :data:`SKIPPED_NONFINITE` metric). The verdict must be the same on every rank: the
    backend passes values agreed across ranks (a reduced loss, a global grad norm, :func:`all_ranks_finite`)."""

    def __init__(self, *, skip: bool, checkpoint_dir: Path | None = None, log: Any = None):
        self.skip = skip
        self.skipped = 0
        self.checkpoint_dir = checkpoint_dir
        self.log = log
        self._first: torch.Tensor | None = None  # (step, loss, grad norm) of the first non-finite step, on device

    def metrics(self) -> dict[str, int]:
        """The skipped-steps metric, once a step was skipped."""
        return {SKIPPED_NONFINITE: self.skipped} if self.skipped else {}

    def check(self, step: int, *, loss: float, grad_norm: float | None = None, nonfinite: bool = False) -> bool:
        """The verdict on step ``step`` (``nonfinite``: the backend found a NaN / inf elsewhere, e.g. in a gradient).
        True for a finite step; False for a skipped one (counted); raises :class:`NonFiniteError` to stop."""
        if not (nonfinite or not math.isfinite(loss) or (grad_norm is not None and not math.isfinite(grad_norm))):
            return True
        if not self.skip:
            raise self.error(step, loss=loss, grad_norm=grad_norm)
        self.skipped += 1
        if self.log:
            self.log.info(f"[train] {_values(step, loss, grad_norm)} (not finite): update skipped "
                          f"({self.skipped} skipped so far; train.skip_nonfinite)")
        return False

    def defer(self, step: int, *, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Keep step ``step`` on the device if it is the first non-finite one: no host sync, so the step loop runs
        ahead of the device; :meth:`raise_deferred` reads the record (at reported steps, before every save)."""
        grad_norm = grad_norm.to(loss.device, loss.dtype)
        vals = torch.stack([torch.full_like(loss, step), loss, grad_norm])
        if self._first is None:
            self._first = torch.zeros_like(vals)
        new = (self._first[0] == 0) & ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        self._first = torch.where(new, vals, self._first)

    def raise_deferred(self) -> None:
        """Raise :class:`NonFiniteError` for the first non-finite step :meth:`defer` kept (reads one small tensor)."""
        if self._first is None:
            return
        step, loss, grad_norm = self._first.tolist()
        if step:
            raise self.error(int(step), loss=loss, grad_norm=grad_norm)

    def error(self, step: int, *, loss: float, grad_norm: float | None) -> NonFiniteError:
        """The stop: names the step, its values, the checkpoint a rerun resumes from and what to try."""
        return NonFiniteError(f"{_values(step, loss, grad_norm)} (not finite); stopped, and nothing of it or after "
                              f"it is saved: {_intact(self.checkpoint_dir)}. Lower train.lr, raise train.grad_clip, "
                              "or set train.skip_nonfinite: true to skip such steps")
