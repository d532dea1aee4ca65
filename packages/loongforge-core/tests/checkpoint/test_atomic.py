from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from loongforge.checkpoint import (
    apply_retention,
    atomic_checkpoint,
    complete_checkpoints,
    latest_checkpoint,
    require_complete,
)
from loongforge.errors import CheckpointError


def _save(root, name, payload="x", **kw):
    with atomic_checkpoint(root, name, **kw) as d:
        (d / "state.txt").write_text(payload)


def test_save_publishes_and_points_latest(tmp_path):
    _save(tmp_path, "step_1", "one")
    _save(tmp_path, "step_2", "two")
    assert latest_checkpoint(tmp_path) == tmp_path / "step_2"
    assert (tmp_path / "latest").read_text() == "step_2"
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_1", "step_2"]
    assert require_complete(tmp_path / "step_2") == tmp_path / "step_2"


def test_exception_leaves_nothing(tmp_path):
    _save(tmp_path, "step_1")
    with pytest.raises(ValueError), atomic_checkpoint(tmp_path, "step_2") as d:
        (d / "half").write_text("x")
        raise ValueError
    assert latest_checkpoint(tmp_path) == tmp_path / "step_1"
    assert not (tmp_path / "step_2").exists() and not list(tmp_path.glob("*.tmp-*"))


def test_untrusted_dirs_are_ignored(tmp_path):
    (tmp_path / "step_9").mkdir()  # no marker: an interrupted foreign save
    assert latest_checkpoint(tmp_path) is None
    with pytest.raises(CheckpointError, match="incomplete"):
        require_complete(tmp_path / "step_9")
    _save(tmp_path, "step_1")
    (tmp_path / "latest").write_text("step_9")  # pointer to an incomplete dir falls back
    assert latest_checkpoint(tmp_path) == tmp_path / "step_1"


def test_retention_keeps_last_n(tmp_path):
    for i in range(5):
        _save(tmp_path, f"step_{i}", keep_last=2)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_3", "step_4"]
    with pytest.raises(CheckpointError):
        apply_retention(tmp_path, keep_last=0)


def test_sigkill_mid_save_keeps_previous(tmp_path):
    _save(tmp_path, "step_1", "good")
    script = textwrap.dedent(f"""
        import time
        from loongforge.checkpoint import atomic_checkpoint
        with atomic_checkpoint({str(tmp_path)!r}, "step_2") as d:
            with open(d / "big.bin", "wb") as f:
                f.write(b"0" * 1_000_000)
                f.flush()
                print("writing", flush=True)
                time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert list(tmp_path.glob("step_2.tmp-*"))  # the half-written staging dir is left behind ...
    latest = latest_checkpoint(tmp_path)  # ... but never trusted
    assert latest == tmp_path / "step_1" and (latest / "state.txt").read_text() == "good"
    assert not (tmp_path / "step_2").exists()
    time.sleep(0.01)
    apply_retention(tmp_path, keep_last=3)  # dead writer's staging dir is cleaned up
    assert not list(tmp_path.glob("step_2.tmp-*"))
