""""Did every rank get through this phase?" — one collective instead of a barrier on an error path.

NOTE: a rank that fails in build / resume and then waits in ``dist.barrier()`` (or simply exits) while its peers
are already in their first training collective leaves the job hung, or ends it with a peer's "connection
closed" instead of the cause. Calling :func:`agree` at the end of a phase on every rank, with the rank's own
error or None, makes every rank leave the phase together: the failing rank raises its own error, the others a
:class:`PeerFailedError` naming it (which the worker does not print again).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from loongforge.errors import LoongForgeError


class PeerFailedError(LoongForgeError):
    """Another rank failed in the phase; its own error is the one to show (``rank`` is the first that failed)."""

    def __init__(self, message: str, *, rank: int):
        self.rank = rank
        super().__init__(message)


def agree(error: BaseException | None, *, phase: str, device: torch.device | None = None,
          group: dist.ProcessGroup | None = None) -> None:
    """Collective over ``group``: every rank passes its exception from ``phase`` (or None). Returns when all ranks
    succeeded; else raises ``error`` on the ranks that had one and :class:`PeerFailedError` on the others.

    ``device``: where the flag tensor lives (the backend's device: cuda for NCCL; default from the backend)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        if error is not None:
            raise error
        return
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if device is None:
        nccl = "nccl" in str(dist.get_backend(group)).lower()
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    flags = torch.zeros(world, dtype=torch.int32, device=device)
    if error is not None:
        flags[rank] = 1
    dist.all_reduce(flags, group=group)
    if error is not None:
        raise error
    failed = [r for r, f in enumerate(flags.tolist()) if f]
    if failed:
        raise PeerFailedError(f"rank {failed[0]} failed during {phase} ({len(failed)} of {world} ranks); its error "
                              "is the one above", rank=failed[0])
