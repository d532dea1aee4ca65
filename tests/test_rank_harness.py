"""The multi-process test harness itself (tests/support/rank_harness.py): fresh processes, results, failures,
and the deadlock watchdog's stack dumps."""

from __future__ import annotations

import os
import time

import pytest

WATCHDOG_S = 20


def _who(*, rank: int, world: int, tag: str) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        t = __import__("torch").tensor([rank + 1.0])
        dist.all_reduce(t)
        return {"rank": rank, "world": world, "tag": tag, "sum": float(t), "pid": os.getpid(),
                "ppid": os.getppid(), "cwd": os.getcwd(), "env": os.environ.get("RANK_HARNESS_PROBE")}
    finally:
        dist.destroy_process_group()


def test_ranks_return_results_in_fresh_processes(ranks, tmp_path, monkeypatch):
    monkeypatch.setenv("RANK_HARNESS_PROBE", "seen")
    monkeypatch.chdir(tmp_path)
    results = ranks(_who, world=2, out=tmp_path / "out", tag="x")
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world"] == 2 and r["tag"] == "x" and r["sum"] == 3.0 for r in results)
    assert all(r["env"] == "seen" and r["cwd"] == str(tmp_path) for r in results)  # the caller's env and cwd
    # NOTE: children of the forkserver, never forked from pytest's own (multi-threaded) process
    assert all(r["ppid"] != os.getpid() for r in results)


def _fails_on_rank_one(*, rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank one refuses")
    time.sleep(60)  # a healthy rank waiting on the failed one, as in a collective


def test_a_failing_rank_ends_the_call_with_its_traceback(ranks, tmp_path):
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as err:
        ranks(_fails_on_rank_one, world=2, out=tmp_path, timeout_s=WATCHDOG_S)
    assert time.monotonic() - start < WATCHDOG_S  # the first failure ends the call, not the watchdog
    text = str(err.value)
    assert "rank 1 of 2 failed" in text and "ValueError: rank one refuses" in text


def _deadlocks(*, rank: int, world: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    print(f"rank {rank} before the collective", flush=True)
    if rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins
    else:
        _waits_forever()


def _waits_forever() -> None:
    while True:
        time.sleep(0.1)


def test_watchdog_dumps_every_ranks_stack_then_fails(ranks, tmp_path):
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as err:
        ranks(_deadlocks, world=2, out=tmp_path, timeout_s=WATCHDOG_S)
    elapsed = time.monotonic() - start
    assert WATCHDOG_S <= elapsed < WATCHDOG_S + 15, elapsed
    text = str(err.value)
    assert "deadlock watchdog: rank(s) [0, 1] of 2 still running after 20 s" in text
    assert "rank 0 before the collective" in text and "rank 1 before the collective" in text  # per-rank logs
    # every rank's Python stack, down to the call it hangs in
    rank0, rank1 = text.split("---- rank 1 log")
    assert "_deadlocks" in rank0 and "all_reduce" in rank0
    assert "_waits_forever" in rank1


def _sums(*, rank: int, world: int, values: list[int], combine) -> int:
    return combine(values) + rank


def test_functions_of_test_modules_travel_as_arguments(ranks, tmp_path):
    assert ranks(_sums, world=1, out=tmp_path, values=[1, 2], combine=_combine) == [3]


def _combine(values: list[int]) -> int:
    return sum(values)
