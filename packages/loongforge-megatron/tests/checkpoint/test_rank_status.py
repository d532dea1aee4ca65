"""The all-ranks-OK check: a failure on one rank reaches every rank in the same collective, as one message."""

from __future__ import annotations


def _check(*, rank: int, world: int, failing: list[int], internal: bool) -> tuple[str, str] | None:
    import torch.distributed as dist
    from loongforge.errors import CheckpointError
    from loongforge_megatron.rank_status import all_ranks_ok

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        error = None
        if rank in failing:
            error = RuntimeError("boom") if internal else CheckpointError(f"/ckpt/rank_{rank:05d}.pt is unreadable")
        try:
            all_ranks_ok(error, what="resuming")
        except Exception as exc:  # noqa: BLE001 - the test looks at what each rank raised
            return type(exc).__name__, str(exc)
        return None
    finally:
        dist.destroy_process_group()


def test_one_failing_rank_fails_every_rank_with_its_message(ranks, tmp_path):
    out = ranks(_check, world=2, out=tmp_path, timeout_s=120, failing=[1], internal=False)
    assert out == [("PeerFailedError", "/ckpt/rank_00001.pt is unreadable"),
                   ("CheckpointError", "/ckpt/rank_00001.pt is unreadable")]


def test_all_ok_passes_and_internal_errors_keep_their_type(ranks, tmp_path):
    assert ranks(_check, world=2, out=tmp_path / "ok", timeout_s=120, failing=[], internal=False) == [None, None]
    out = ranks(_check, world=2, out=tmp_path / "bug", timeout_s=120, failing=[0], internal=True)
    assert out == [("RuntimeError", "boom"), ("PeerFailedError", "rank 0 failed while resuming: RuntimeError: boom")]


def test_several_failing_ranks_report_the_first(ranks, tmp_path):
    out = ranks(_check, world=2, out=tmp_path, timeout_s=120, failing=[0, 1], internal=False)
    assert all(msg.startswith("/ckpt/rank_00000.pt is unreadable (and 1 other error on other ranks)") for _, msg in out), out
