"""Runtime: this process's place in the run (rank, world, device, output directory) and its services."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from loongforge.accelerator import Accelerator, get_accelerator

if TYPE_CHECKING:
    from loongforge.metrics import MetricsLogger
    from loongforge.parallel import ParallelPlan
    from loongforge.recipe.schema import Recipe


def free_port() -> int:
    """A free TCP port on localhost (for single-process and test process groups)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_store(*, world_size: int | None = 1, timeout_s: float = 300.0):
    """A c10d ``TCPStore`` server listening on 127.0.0.1 only, on a free port.

    NOTE: ``TCPStore(host, ...)`` as master listens on every interface whatever ``host`` says (``host`` is where
    clients connect), unauthenticated. Handing it a socket already bound to loopback (``master_listen_fd``) keeps a
    single-node run unreachable from the network."""
    from datetime import timedelta

    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    return dist.TCPStore("127.0.0.1", port, world_size, True, timedelta(seconds=timeout_s),
                         wait_for_workers=False, master_listen_fd=sock.detach(), use_libuv=True)


def init_distributed(accelerator: Accelerator, *, rank: int = 0, world_size: int = 1) -> None:
    """The one way LoongForge starts torch.distributed: the accelerator's backend; a launched rank rendezvouses
    through torchrun's environment (env://), a lone process through a private store on a free port. A no-op when
    a process group exists already."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    kwargs = {}
    if accelerator.device_type != "cpu":
        kwargs["device_id"] = accelerator.device()
    if world_size == 1 and "LOCAL_WORLD_SIZE" not in os.environ:
        # NOTE: a single in-process run gets a private store on loopback and leaves os.environ alone, so
        # nothing (a stale MASTER_PORT, RANK) leaks into later runs or into child processes.
        kwargs["store"] = loopback_store()
    dist.init_process_group(backend=accelerator.dist_backend, rank=rank, world_size=world_size, **kwargs)


@dataclass
class Runtime:
    """What a backend's ``build`` receives. Created once per process by :func:`Runtime.create`."""

    recipe: Recipe
    accelerator: Accelerator
    plan: ParallelPlan
    output_dir: Path
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    logger: MetricsLogger | None = field(default=None, repr=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def checkpoint_dir(self) -> Path:
        return self.output_dir / "checkpoints"

    @property
    def hf_dir(self) -> Path:
        return self.output_dir / "hf"

    @classmethod
    def create(cls, recipe: Recipe, output_dir: str | Path) -> Runtime:
        """Read rank/world from torchrun's environment (or run as a single process), pick the accelerator,
        export its environment, bind the device and resolve the parallel plan for this world size."""
        rank = int(os.environ.get("RANK", 0))
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        world_size = int(os.environ.get("WORLD_SIZE", 1))
        acc = get_accelerator(recipe.accelerator.name, options=recipe.accelerator.options, env=recipe.accelerator.env)
        acc.setup_environment()
        acc.set_device(local_rank)
        plan = recipe.parallel.plan(world_size)
        from loongforge.metrics import MetricsLogger

        out = Path(output_dir)
        logger = MetricsLogger(out, enabled=rank == 0, config=recipe.logging, total_steps=recipe.train.steps)
        return cls(recipe, acc, plan, out, rank, local_rank, world_size, logger)

    def init_distributed(self) -> None:
        """Initialise torch.distributed with the accelerator's backend (also for a single process)."""
        init_distributed(self.accelerator, rank=self.rank, world_size=self.world_size)

    def seed(self, seed: int) -> None:
        self.accelerator.manual_seed(seed)
        torch.manual_seed(seed)
