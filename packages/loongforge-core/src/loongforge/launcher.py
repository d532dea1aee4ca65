"""Run a recipe: in this process for one process, through torch.distributed's elastic launcher otherwise.

NOTE: no home-made launcher. For N > 1 (or several nodes) we run ``python -m loongforge.launcher``: torch's own
``torchrun`` (``torch.distributed.run``: its argument parser and ``run``, with the flags PyTorch users know —
rendezvous, restarts) — whose only addition is that a failed worker ends it with the worker's exit code instead of
a ``ChildFailedError`` traceback (the worker already printed its one-line error). Workers run
``python -m loongforge.worker`` on the already-resolved recipe.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

from loongforge.errors import LoongForgeError


@dataclass(frozen=True)
class LaunchConfig:
    """torchrun's options. ``nproc`` is processes per node."""

    nproc: int = 1
    nnodes: str = "1"
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    rdzv_backend: str = "c10d"
    rdzv_id: str | None = None
    max_restarts: int = 0
    monitor_interval: float = 0.5

    @property
    def single_process(self) -> bool:
        return self.nproc == 1 and str(self.nnodes) == "1"

    def check(self) -> None:
        """One-line errors for values torchrun would meet with a traceback (or take silently)."""
        if self.nproc < 1:
            raise LoongForgeError(f"--nproc must be at least 1 (got {self.nproc})")
        if self.max_restarts < 0:
            raise LoongForgeError(f"--max-restarts must be 0 or more (got {self.max_restarts})")
        parts = str(self.nnodes).split(":")
        if len(parts) > 2 or not all(p.isdigit() and int(p) >= 1 for p in parts) or int(parts[0]) > int(parts[-1]):
            raise LoongForgeError(f"--nnodes must be a number of nodes (>= 1) or MIN:MAX with 1 <= MIN <= MAX "
                                  f"(got '{self.nnodes}')")

    @property
    def min_nodes(self) -> int:
        return int(str(self.nnodes).split(":")[0])


def torchrun_command(config: LaunchConfig, *, recipe_file: Path, output_dir: Path) -> list[str]:
    """The ``python -m loongforge.launcher ...`` (torchrun's arguments) command line for ``config``."""
    config.check()
    cmd = [sys.executable, "-m", "loongforge.launcher", f"--nproc-per-node={config.nproc}", f"--nnodes={config.nnodes}"]
    if config.rdzv_endpoint:
        cmd += [
            f"--node-rank={config.node_rank}",
            f"--rdzv-backend={config.rdzv_backend}",
            f"--rdzv-endpoint={config.rdzv_endpoint}",
        ]
        if config.rdzv_id:
            cmd.append(f"--rdzv-id={config.rdzv_id}")
    elif str(config.nnodes) == "1":
        # NOTE: torchrun's --standalone, with its stores on 127.0.0.1 only (loongforge.loopback_rendezvous)
        from loongforge.loopback_rendezvous import BACKEND

        cmd += [f"--rdzv-backend={BACKEND}", "--rdzv-endpoint=127.0.0.1:0", f"--rdzv-id={uuid.uuid4()}",
                "--local-addr=127.0.0.1"]
    else:
        raise LoongForgeError(f"--nnodes {config.nnodes} needs --rdzv-endpoint HOST:PORT")
    cmd += [f"--max-restarts={config.max_restarts}", f"--monitor-interval={config.monitor_interval}"]
    cmd += ["-m", "loongforge.worker", "--recipe", str(recipe_file), "--output", str(output_dir)]
    return cmd


def launch(config: LaunchConfig, *, recipe_file: Path, output_dir: Path) -> int:
    """Run the elastic launcher and return its exit code (a failing worker's one-line error is on stderr)."""
    # torchrun sets each worker's rendezvous variables itself; inherited ones (from a parent job) must not leak
    stale = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
             "TORCHELASTIC_RUN_ID")
    env = {k: v for k, v in os.environ.items() if k not in stale}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, config.nproc))))
    env.setdefault("PYTHONUNBUFFERED", "1")
    env["LOONGFORGE_LAUNCHED"] = "1"
    if str(config.nnodes) == "1" and not config.rdzv_endpoint and Path("/sys/class/net/lo").exists():
        # NOTE: gloo's pair sockets on loopback too: a single-node job listens on no external interface
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # NOTE: the launcher runs in its own session, and SIGTERM / SIGINT / SIGHUP sent to us are passed on to it:
    # torchrun then stops its workers and exits. Killed without that (subprocess.run's SIGKILL after a
    # KeyboardInterrupt, or our own death on SIGTERM), it would leave the workers running, holding the devices. A
    # terminal's Ctrl-C reaches us only (another session), so the launcher gets it once.
    proc = subprocess.Popen(torchrun_command(config, recipe_file=recipe_file, output_dir=output_dir), env=env,
                            start_new_session=True, preexec_fn=_stop_with_parent)
    previous = {}
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        try:
            previous[sig] = signal.signal(sig, lambda signum, frame: proc.send_signal(signum))
        except ValueError:  # NOTE: not the main thread: signals are not ours to handle
            break
    try:
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - code if code < 0 else code


def _stop_with_parent() -> None:
    """In the launcher's child, before exec: SIGTERM when we die, even by SIGKILL (Linux ``PR_SET_PDEATHSIG``), so
    the launcher, in its own session, still stops its workers."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # NOTE: 1 = PR_SET_PDEATHSIG


def _torchrun(argv: list[str]) -> int:
    """torchrun on ``argv``; a failed worker gives its exit code (its error is already on stderr), no traceback."""
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from loongforge.loopback_rendezvous import register

    register()

    # NOTE: its "failed (exitcode: 2) local_rank: 0 ..." line repeats what the worker and our summary say.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)

    try:
        run(parse_args(argv))
    except SignalException as exc:  # NOTE: stopped (SIGTERM / SIGINT ...): torchrun already stopped its workers
        sys.stderr.write(f"error: training stopped by {signal.Signals(exc.sigval).name}\n")
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        return _failed_exit_code(exc.failures)
    return 0


def _failed_exit_code(failures: dict) -> int:
    """The launcher's exit code for torchrun's ``failures`` (local rank -> ProcessFailure, in the order seen)."""
    codes = [(rank, f, f.exitcode if isinstance(f.exitcode, int) else 1) for rank, f in failures.items()]
    if any(c > 0 for _, _, c in codes):
        # NOTE: a rank failed on its own (its error is on stderr); ranks torchrun then stopped with a signal
        # are its clean-up, not another cause.
        return max(c for _, _, c in codes if c > 0)
    killed = [(i, rank, f, c) for i, (rank, f, c) in enumerate(codes) if c < 0]
    if not killed:
        return 1
    # NOTE: torch records the ranks it stopped itself (SIGTERM, SIGKILL after its grace period) after the one that
    # died first, in the order it saw them: the cause is the first one seen, and never a SIGTERM of its clean-up
    # when another signal is there (an OOM kill's SIGKILL exits 137, not torchrun's 143).
    _, rank, failure, code = min(killed, key=lambda k: (k[3] == -signal.SIGTERM, k[0]))
    name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
    sys.stderr.write(f"error: rank {rank} (pid {failure.pid}) was killed by {name}\n")
    return 128 - code


if __name__ == "__main__":
    sys.exit(_torchrun(sys.argv[1:]))
