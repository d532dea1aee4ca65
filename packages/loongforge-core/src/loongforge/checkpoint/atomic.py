"""Atomic checkpoint directories: a crash mid-save never replaces or corrupts the last good checkpoint.

Save: write into ``<root>/<name>.tmp-<pid>``, fsync, write the completion marker (which lists every file's size
and whether the weights were finite), rename into place, then point ``<root>/latest`` at it (temp file +
``os.replace``). Load trusts only directories with the marker; ``latest_checkpoint(verify=True)`` also skips, with
a warning, a checkpoint whose files no longer have their recorded sizes (a truncated rank file). ``latest`` must
name a checkpoint inside its own directory. Retention never deletes the newest checkpoint with finite weights.
Used by every backend for resume checkpoints.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import sys
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


def disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` is an out-of-space write error (torch.save reports it as a RuntimeError)."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(exc)
    return "No space left on device" in text or "unexpected pos" in text or "Disk quota exceeded" in text


def disk_full_error(path: str | os.PathLike, exc: BaseException) -> CheckpointError:
    """The one-line error for a write to ``path`` that ran out of space."""
    try:
        free = f" ({shutil.disk_usage(Path(path).parent).free / 2**20:.0f} MiB free)"
    except OSError:
        free = ""
    return CheckpointError(f"{path}: no space left on the device{free}; free some space (or lower "
                           "checkpoint.keep_last) and rerun with the same --output to resume")


def is_complete(path: str | os.PathLike) -> bool:
    """True when ``path`` is a directory whose save finished (it carries the completion marker)."""
    return (Path(path) / MARKER).is_file()


def _marker(path: Path) -> dict:
    try:
        value = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _created(path: Path) -> int:
    try:
        return int(_marker(path)["created_ns"])
    except (KeyError, TypeError, ValueError):
        return 0


def is_finite(path: str | os.PathLike) -> bool:
    """False only for a checkpoint saved with non-finite weights (``atomic_checkpoint(finite=False)``)."""
    return _marker(Path(path)).get("finite", True) is not False


def _file_sizes(staging: Path) -> dict[str, int]:
    return {str(p.relative_to(staging)): p.stat().st_size for p in sorted(staging.rglob("*")) if p.is_file()}


def verify_files(path: str | os.PathLike) -> str | None:
    """What is wrong with the files of complete checkpoint ``path`` (None when every file the marker lists has its
    recorded size; checkpoints saved before the marker listed files are not checked)."""
    path = Path(path)
    marker = _marker(path)
    if not marker:
        return f"{path / MARKER} is unreadable"
    files = marker.get("files")
    if not isinstance(files, dict):
        return None
    for name, size in files.items():
        f = path / name
        if not f.is_file():
            return f"{f} is missing"
        if f.stat().st_size != size:
            return f"{f} has {f.stat().st_size} of its {size} bytes (truncated or overwritten)"
    return None


def complete_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Finished checkpoint directories under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and ".tmp-" not in p.name and is_complete(p)]
    return sorted(found, key=lambda p: (_created(p), p.name))


@contextlib.contextmanager
def atomic_checkpoint(
    root: str | os.PathLike, name: str, *, keep_last: int | None = None, finite: bool = True
) -> Iterator[Path]:
    """Yield a staging directory; on normal exit publish it as ``<root>/<name>`` and update ``latest``.

    On an exception the staging directory is removed and nothing visible changes (running out of space is a
    ``CheckpointError`` that says so). ``keep_last`` deletes older complete checkpoints beyond the newest N after
    publishing; ``finite=False`` records weights that are not finite (retention then keeps the newest finite one).
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
    try:
        fsync_tree(staging)
        marker = {"created_ns": time.time_ns(), "name": name, "finite": finite, "files": _file_sizes(staging)}
        write_atomic(staging / MARKER, json.dumps(marker))
        replace_dir(staging, final)
        write_atomic(root / LATEST, name)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if disk_full(exc):
            raise disk_full_error(staging, exc) from None
        raise
    if keep_last is not None:
        apply_retention(root, keep_last=keep_last)


def _pointed(root: Path) -> Path | None:
    """The directory ``<root>/latest`` names (None when there is no pointer, or it names nothing readable)."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    try:
        name = pointer.read_bytes().decode().strip()
    except (OSError, UnicodeDecodeError):
        _warn(f"{pointer} is unreadable; using the newest complete checkpoint")
        return None
    if not name or "\x00" in name:
        _warn(f"{pointer} names no checkpoint; using the newest complete checkpoint")
        return None
    target = (root / name).resolve()
    if name.startswith("/") or ".." in Path(name).parts or target.parent != root.resolve():
        raise CheckpointError(f"{pointer} points outside {root} ('{name[:200]}'): only a checkpoint in the run's own "
                              "checkpoints directory is resumed; fix or delete the file")
    return root / name


def _warn(message: str) -> None:
    sys.stderr.write(f"[checkpoint] warning: {message}\n")


def latest_checkpoint(
    root: str | os.PathLike, *, verify: bool = False, exclude: tuple[Path, ...] = (), skipped: list[str] | None = None,
) -> Path | None:
    """The checkpoint to resume from: ``latest`` if it names a complete directory, else the newest complete
    one, else None. Incomplete (``.tmp-``) directories are never returned; a ``latest`` naming a path outside
    ``root`` is a ``CheckpointError``. With ``verify``, checkpoints whose files lost their recorded sizes (and
    those in ``exclude``) are skipped with a warning naming them, and the reasons appended to ``skipped``."""
    root = Path(root)
    target = _pointed(root)
    done = complete_checkpoints(root)
    order = ([target] if target is not None and is_complete(target) else []) + [p for p in reversed(done) if p != target]
    for path in order:
        if not verify:
            return path
        if path in exclude:
            continue
        problem = verify_files(path)
        if problem is None:
            return path
        _warn(f"skipping {path.name}: {problem}")
        if skipped is not None:
            skipped.append(f"{path.name}: {problem}")
    return None


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """The optimizer step of a checkpoint named ``step_<N>`` (every backend's resume checkpoints), else None."""
    name = Path(path).name
    if name.startswith("step_") and name[5:].isdigit():
        return int(name[5:])
    return None


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
    done = complete_checkpoints(root)
    try:
        keep = {latest_checkpoint(root)}
    except CheckpointError:
        keep = set()
    # NOTE: a run that went NaN must still be resumable from before it did
    keep |= {next((p for p in reversed(done) if is_finite(p)), None)}
    removed = []
    for p in done[:-keep_last]:
        if p not in keep:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    for p in root.glob("*.tmp-*"):
        pid = p.name.rsplit(".tmp-", 1)[1]
        if p.is_dir() and pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed
