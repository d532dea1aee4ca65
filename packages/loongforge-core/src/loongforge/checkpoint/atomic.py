"""Atomic checkpoint directories: a crash mid-save never replaces or corrupts the last good checkpoint.

Save: write into ``<root>/<name>.tmp-<pid>``, fsync, write the completion marker, rename into place, then
point ``<root>/latest`` at it (temp file + ``os.replace``). Load trusts only directories with the marker.
Used by every backend for resume checkpoints.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from loongforge.errors import CheckpointError

MARKER = ".loongforge_complete"
LATEST = "latest"


def fsync_tree(path: str | os.PathLike) -> None:
    """fsync every file and directory below ``path`` (and ``path`` itself)."""
    path = Path(path)
    for dirpath, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_dir(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Move directory ``src`` to ``dst``, replacing an existing ``dst`` (moved aside first, then deleted)."""
    src, dst = Path(src), Path(dst)
    old = None
    if dst.exists():
        old = dst.with_name(f"{dst.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(dst, old)
    os.rename(src, dst)
    _fsync_dir(dst.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, fsync and rename (readers never see a partial file)."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def is_complete(path: str | os.PathLike) -> bool:
    """True when ``path`` is a directory whose save finished (it carries the completion marker)."""
    return (Path(path) / MARKER).is_file()


def _created(path: Path) -> int:
    try:
        return int(json.loads((path / MARKER).read_text())["created_ns"])
    except (OSError, ValueError, KeyError):
        return 0


def complete_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Finished checkpoint directories under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and ".tmp-" not in p.name and is_complete(p)]
    return sorted(found, key=lambda p: (_created(p), p.name))


@contextlib.contextmanager
def atomic_checkpoint(
    root: str | os.PathLike, name: str, *, keep_last: int | None = None
) -> Iterator[Path]:
    """Yield a staging directory; on normal exit publish it as ``<root>/<name>`` and update ``latest``.

    On an exception the staging directory is removed and nothing visible changes. ``keep_last`` deletes
    older complete checkpoints beyond the newest N after publishing.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / name
    staging = root / f"{name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    fsync_tree(staging)
    write_atomic(staging / MARKER, json.dumps({"created_ns": time.time_ns(), "name": name}))
    replace_dir(staging, final)
    write_atomic(root / LATEST, name)
    if keep_last is not None:
        apply_retention(root, keep_last=keep_last)


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The checkpoint to resume from: ``latest`` if it names a complete directory, else the newest complete
    one, else None. Incomplete (``.tmp-``) directories are never returned."""
    root = Path(root)
    pointer = root / LATEST
    if pointer.is_file():
        target = root / pointer.read_text().strip()
        if is_complete(target):
            return target
    done = complete_checkpoints(root)
    return done[-1] if done else None


def require_complete(path: str | os.PathLike) -> Path:
    """Raise CheckpointError unless ``path`` is a finished checkpoint directory."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint directory does not exist")
    if not is_complete(path):
        raise CheckpointError(f"{path}: checkpoint is incomplete (no {MARKER} marker; the save was interrupted)")
    return path


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def apply_retention(root: str | os.PathLike, *, keep_last: int) -> list[Path]:
    """Delete complete checkpoints older than the newest ``keep_last`` (never the one ``latest`` names) and
    staging directories of processes that no longer run. Returns what was deleted."""
    if keep_last < 1:
        raise CheckpointError(f"keep_last must be >= 1, got {keep_last}")
    root = Path(root)
    keep = latest_checkpoint(root)
    removed = []
    for p in complete_checkpoints(root)[:-keep_last]:
        if p != keep:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    for p in root.glob("*.tmp-*"):
        pid = p.name.rsplit(".tmp-", 1)[1]
        if p.is_dir() and pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed
