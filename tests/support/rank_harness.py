"""The workspace's multi-process test harness (a pytest plugin, loaded by the root ``conftest.py``).

``ranks(fn, world=N, out=DIR, **kwargs)`` runs ``fn(rank=r, world=N, **kwargs)`` in ``N`` processes that form a
torch.distributed env:// world (``MASTER_ADDR`` / ``MASTER_PORT`` / ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` set;
each rank initialises its own process group) and returns every rank's return value.

- Every rank is a fresh interpreter's child: a ``forkserver`` started from a clean interpreter (single-threaded, torch
  and megatron-core preloaded so a rank starts in well under a second), never a fork of pytest's process, which by
  then has run torch's intra-op pool, gloo and inductor's compile workers (a fork inherits their held locks).
- ``fn`` and the callables in ``kwargs`` are module-level functions; test modules (imported by pytest with
  ``--import-mode=importlib`` under names no child could import) are loaded in the rank from their files under the
  name pytest gave them, before the call is unpickled.
- A deadlock watchdog: at the timeout every live rank dumps all its threads' Python stacks (``faulthandler`` on
  SIGUSR1) into its log, then is killed; the failure shows every rank's log (stdout + stderr) and stack dump.
  The first rank that fails ends the call at once with its traceback (the others would wait in a collective).
"""

from __future__ import annotations

import faulthandler
import importlib
import multiprocessing as mp
import os
import pickle
import signal
import socket
import sys
import time
import traceback
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# Imported once in the forkserver, so a rank does not pay for them (megatron-core alone takes ~15 s on CI).
PRELOAD = ["torch", "torch.distributed", "megatron.core.models.gpt", "transformers", "rank_harness"]
LOG_TAIL_LINES = 80
_ROOT: Path | None = None  # pytest's rootdir: test modules' names are derived from it
_CTX = None


def free_port() -> int:
    """A free TCP port on the loopback interface (the one helper for every test that needs a port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _context():
    global _CTX
    if _CTX is None:
        # NOTE: the forkserver preloads torch, megatron and transformers; a CUDA query during those imports
        # (torch.cuda.is_available) would initialise CUDA in the process every rank forks from, and CUDA then
        # fails in the ranks ("initialization error", seen on an H200). NVML answers it without initialising CUDA.
        os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(PRELOAD)
    return _CTX


# ---- what a rank must import before it can unpickle the call
def _modules_of(obj: Any, seen: set[str], depth: int = 0) -> None:
    if depth > 4:
        return
    if isinstance(obj, types.FunctionType | type):
        seen.add(obj.__module__)
    elif isinstance(obj, dict):
        for v in obj.values():
            _modules_of(v, seen, depth + 1)
    elif isinstance(obj, list | tuple | set | frozenset):
        for v in obj:
            _modules_of(v, seen, depth + 1)


def _module_sources(fn: Callable[..., Any], kwargs: dict[str, Any]) -> list[tuple[str, str | None]]:
    """``(module name, file)`` for modules a rank loads from their file (pytest's test modules and conftests);
    ``file`` None for modules a rank imports by name."""
    from _pytest.pathlib import module_name_from_path

    names: set[str] = set()
    _modules_of(fn, names)
    _modules_of(kwargs, names)
    out = []
    for name in sorted(names):
        module = sys.modules.get(name)
        file = getattr(module, "__file__", None)
        by_file = (file is not None and _ROOT is not None and Path(file).is_relative_to(_ROOT)
                   and module_name_from_path(Path(file), _ROOT) == name)
        out.append((name, file if by_file else None))
    return out


def _load_modules(sources: list[tuple[str, str | None]], root: str) -> None:
    from _pytest.pathlib import ImportMode, import_path

    for name, file in sources:
        if name in sys.modules:
            continue
        if file is None:
            importlib.import_module(name)
        else:
            module = import_path(Path(file), mode=ImportMode.importlib, root=Path(root),
                                 consider_namespace_packages=False)
            sys.modules.setdefault(name, module)


# ---- one rank
def _rank_main(rank: int, world: int, port: int, out: str, env: dict[str, str], cwd: str, root: str,
               sources: list[tuple[str, str | None]], payload: bytes) -> None:
    out_dir = Path(out)
    log = open(out_dir / f"rank{rank}.log", "w", buffering=1)  # noqa: SIM115 (lives as long as the rank)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)
    faulthandler.enable(file=log)  # a segfault / abort also leaves its stack in the log
    os.environ.clear()
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    os.chdir(cwd)
    # NOTE: the parent starts ranks as daemons (they die with it) and kills them itself at the end; a rank may start
    # worker processes of its own (data.num_workers), which multiprocessing refuses to a daemon
    mp.current_process().daemon = False
    try:
        import torch

        # NOTE: N ranks on 2 cores: more intra-op threads make tiny matmuls far slower (spin-waiting).
        torch.set_num_threads(1)
        _load_modules(sources, root)
        fn, kwargs = pickle.loads(payload)
        result = fn(rank=rank, world=world, **kwargs)
        with open(out_dir / f"rank{rank}.result.tmp", "wb") as f:
            pickle.dump(result, f)
        os.replace(out_dir / f"rank{rank}.result.tmp", out_dir / f"rank{rank}.result")
    except BaseException:  # noqa: BLE001 (reported to the parent through the file)
        (out_dir / f"rank{rank}.err").write_text(traceback.format_exc())
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    if not path.exists():
        return "(no log)"
    text = path.read_text(errors="replace").splitlines()
    cut = len(text) - lines
    return (f"... ({cut} lines above)\n" if cut > 0 else "") + "\n".join(text[max(cut, 0):])


def _report(out: Path, world: int, headline: str, codes: list[int | None]) -> str:
    parts = [headline, f"exit codes: {codes}"]
    for r in range(world):
        err = out / f"rank{r}.err"
        parts.append(f"---- rank {r} log ({out / f'rank{r}.log'}):\n{_tail(out / f'rank{r}.log')}")
        if err.exists():
            parts.append(f"---- rank {r} traceback:\n{err.read_text()}")
    return "\n".join(parts)


def run_ranks(fn: Callable[..., Any], *, world: int, out: Path, timeout_s: float = 300,
              env: dict[str, str] | None = None, **kwargs: Any) -> list[Any]:
    """Run ``fn(rank=, world=, **kwargs)`` in ``world`` fresh processes; return each rank's result.

    The ranks see this process's environment and working directory at the call, or ``env`` when given.

    Fails the test at the first rank that fails (its traceback and every rank's log), or at ``timeout_s`` with
    every live rank's Python stacks (the deadlock watchdog).
    """
    ctx = _context()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for r in range(world):
        for suffix in ("log", "err", "result"):
            (out / f"rank{r}.{suffix}").unlink(missing_ok=True)
    payload = pickle.dumps((fn, kwargs))
    args = (world, free_port(), str(out), dict(os.environ if env is None else env), os.getcwd(), str(_ROOT or Path.cwd()),
            _module_sources(fn, kwargs), payload)
    procs = [ctx.Process(target=_rank_main, args=(r, *args), name=f"rank{r}", daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    failed = None
    while any(p.is_alive() for p in procs):
        failed = next((r for r, p in enumerate(procs) if p.exitcode not in (None, 0)), None)
        if failed is not None or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    timed_out = failed is None and any(p.is_alive() for p in procs)
    if timed_out:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGUSR1)
        time.sleep(1.5)  # NOTE: faulthandler writes from its signal handler; give every rank time to finish
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    codes = [p.exitcode for p in procs]
    if timed_out:
        hung = [r for r, c in enumerate(codes) if c == -signal.SIGKILL]
        pytest.fail(_report(out, world, f"deadlock watchdog: rank(s) {hung} of {world} still running after "
                                        f"{timeout_s:.0f} s; their Python stacks are at the end of their logs",
                            codes), pytrace=False)
    if failed is not None or any(c != 0 for c in codes):
        first = failed if failed is not None else next(r for r, c in enumerate(codes) if c != 0)
        pytest.fail(_report(out, world, f"rank {first} of {world} failed (exit code {codes[first]})", codes),
                    pytrace=False)
    results = []
    for r in range(world):
        with open(out / f"rank{r}.result", "rb") as f:
            results.append(pickle.load(f))
    return results


# ---- the plugin
def pytest_configure(config: pytest.Config) -> None:
    global _ROOT
    _ROOT = Path(config.rootpath)


@pytest.fixture(scope="session")
def ranks():
    """The :func:`run_ranks` launcher: ``ranks(fn, world=N, out=DIR, timeout_s=300, env=None, **kwargs)``."""
    return run_ranks


@pytest.fixture(name="free_port", scope="session")
def _free_port_fixture():
    """The :func:`free_port` helper."""
    return free_port
