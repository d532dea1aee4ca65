""""All ranks OK": a collective status check, so a failure on one rank ends every rank, with its message.

A rank that failed (e.g. its checkpoint file is unreadable) joins the same collective as the healthy ranks,
instead of waiting in a barrier they never reach; every rank then raises the same one-line error, naming the
rank that failed first, so the launcher prints it once and every worker exits.
"""

from __future__ import annotations

import torch.distributed as dist
from loongforge.errors import LoongForgeError


class PeerFailedError(LoongForgeError):
    """Another rank failed; the message is that rank's."""


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return text if isinstance(exc, LoongForgeError) else f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def all_ranks_ok(error: BaseException | None, *, what: str) -> None:
    """Collective: every rank passes its own failure (None when it succeeded). Re-raises ``error`` on the failing
    rank; on the others raises :class:`PeerFailedError` with the first failing rank's message (same text on every
    rank when that failure is a user error, so it is printed once)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    mine = None if error is None else (isinstance(error, LoongForgeError), _describe(error))
    statuses: list = [None] * dist.get_world_size()
    dist.all_gather_object(statuses, mine)
    failed = [(r, s) for r, s in enumerate(statuses) if s is not None]
    if not failed:
        return
    first, (user_error, message) = failed[0]
    if error is not None and not isinstance(error, LoongForgeError):
        raise error  # NOTE: an internal error keeps its traceback on the rank where it happened
    distinct = {s for _, s in failed}
    n = len(distinct) - 1
    others = f" (and {n} other error{'s' if n > 1 else ''} on other ranks)" if n else ""
    if user_error:
        if error is not None and _describe(error) == message and not others:
            raise error
        raise PeerFailedError(f"{message}{others}") from None
    raise PeerFailedError(f"rank {first} failed while {what}{others}: {message}") from None
