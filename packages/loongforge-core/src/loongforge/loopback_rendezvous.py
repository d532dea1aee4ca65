"""torchrun's rendezvous for a single-node run, with every store it opens listening on 127.0.0.1 only.

NOTE: ``torchrun --standalone`` hosts its c10d rendezvous store, and the store it shares with the workers
(``MASTER_ADDR:MASTER_PORT``), on every network interface, unauthenticated: anyone who can reach the machine
could join or disturb the job. A single-node run needs no remote peer, so the launcher registers this handler
(``--rdzv-backend=loongforge-loopback``) in torch's own rendezvous registry and passes ``--local-addr=127.0.0.1``:
the same ``DynamicRendezvousHandler`` over a ``C10dRendezvousBackend``, but its stores are bound to loopback.
Multi-node runs keep torch's c10d rendezvous on ``--rdzv-endpoint``.
"""

from __future__ import annotations

from typing import Any

BACKEND = "loongforge-loopback"


def _create_handler(params: Any) -> Any:
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    from loongforge.errors import AdaptationError
    from loongforge.runtime import loopback_store

    class LoopbackBackend(C10dRendezvousBackend):
        @property
        def name(self) -> str:  # NOTE: torch's registry checks the handler's backend name against the flag
            return BACKEND

    store = loopback_store(world_size=None)
    handler = create_handler(store, LoopbackBackend(store, params.run_id), params)
    if not hasattr(handler, "_create_tcp_store_server"):
        raise AdaptationError("torch's DynamicRendezvousHandler no longer creates its shared store in "
                              "_create_tcp_store_server: update loongforge.loopback_rendezvous")
    # NOTE: the store the workers bootstrap from (torch's TCPStore sharing), on loopback too
    handler._create_tcp_store_server = lambda addr, port: loopback_store(world_size=None)
    return handler


def register() -> None:
    """Make ``--rdzv-backend=loongforge-loopback`` known to torchrun (in the launcher's process)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, _create_handler)
