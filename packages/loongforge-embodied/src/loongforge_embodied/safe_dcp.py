"""Reading torch.distributed.checkpoint (DCP) directories without running code from them.

NOTE: DCP's ``FileSystemReader.read_metadata`` unpickles ``.metadata`` with plain ``pickle.load``, and its
``DefaultLoadPlanner.load_bytes`` ``torch.load``s non-tensor items with ``weights_only=False``: a checkpoint
directory that someone else wrote (a shared run folder, a downloaded checkpoint) could run any command on
resume. Here ``.metadata`` goes through an unpickler that constructs only DCP's own metadata records (and the
torch / pathlib values they hold), and a non-tensor item is refused: our resume state holds tensors only.
Tensor items were already read with ``torch.load(weights_only=True)`` by DCP itself.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from loongforge.errors import CheckpointError, LoongForgeError
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # NOTE: a lookup by name in torch's own layout table
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Constructs DCP's metadata records and nothing else (``find_class`` is the only way a pickle reaches code)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == dcp_metadata.__name__ and isinstance(getattr(dcp_metadata, name, None), type):
            return getattr(dcp_metadata, name)
        raise pickle.UnpicklingError(f"it asks for {module}.{name}, which DCP metadata never holds")


def read_metadata_file(path: str | Path) -> dcp_metadata.Metadata:
    """``.metadata`` of a DCP directory, unpickled safely; a refused, truncated or foreign file is a one-line
    ``CheckpointError`` naming it."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete") from None
    except pickle.UnpicklingError as exc:
        raise CheckpointError(f"{path}: refused to load ({exc}); nothing from it was run. A checkpoint written by "
                              "LoongForge never asks for that: do not resume from this directory") from None
    except (EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError, MemoryError, OSError) as exc:
        raise CheckpointError(f"{path} is not a readable checkpoint metadata file ({type(exc).__name__}: "
                              f"{str(exc)[:200]}); the checkpoint is corrupt or truncated") from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP checkpoint metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file-system reader with :func:`read_metadata_file` for ``.metadata``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        metadata = read_metadata_file(self._get_metadata_path(kwargs.get("rank")))
        # NOTE: what FileSystemReader.read_metadata does after its pickle.load
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class TensorOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that a non-tensor (pickled) item is refused instead of unpickled."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        raise CheckpointError(f"'{read_item.dest_index.fqn}' is stored as a pickled object, not a tensor; refused "
                              "(resume state holds tensors only)")


def load(state: dict[str, Any], path: str | Path) -> None:
    """``dcp.load(state, checkpoint_id=path)`` through the safe reader and planner; our own errors come out as
    themselves, not wrapped in DCP's ``CheckpointException``."""
    import torch.distributed.checkpoint as dcp

    # NOTE: read (and refuse) here first: dcp.load swallows any exception of read_metadata and then fails on
    # "metadata is None", which would hide the reason
    check_data_files(Path(path), read_metadata_file(Path(path) / ".metadata"))
    try:
        dcp.load(state, checkpoint_id=path, storage_reader=SafeFileSystemReader(path), planner=TensorOnlyLoadPlanner())
    except CheckpointException as exc:
        cause = user_error(exc)
        if cause is not None:
            raise cause from None
        raise


def check_data_files(path: Path, metadata: dcp_metadata.Metadata) -> None:
    """Every data file ``.metadata`` points at is inside ``path`` and long enough for its items: a truncated or
    missing ``.distcp`` is named here, not reported by DCP as a size mismatch."""
    need: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = str(getattr(info, "relative_path", ""))
        if not name or Path(name).is_absolute() or ".." in Path(name).parts:
            raise CheckpointError(f"{path / '.metadata'} points outside its checkpoint ('{name}'); refused")
        need[name] = max(need.get(name, 0), int(info.offset) + int(info.length))
    for name, size in sorted(need.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file} is missing: the checkpoint is incomplete")
        if file.stat().st_size < size:
            raise CheckpointError(f"{file} is truncated ({file.stat().st_size:,} of {size:,} bytes); the checkpoint "
                                  "is corrupt")


def user_error(exc: BaseException) -> LoongForgeError | None:
    """The first ``LoongForgeError`` a rank raised inside a DCP collective (DCP gathers them into a
    ``CheckpointException``, a ``BaseException``), or None."""
    if isinstance(exc, LoongForgeError):
        return exc
    for failure in getattr(exc, "failures", {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, LoongForgeError):
            return inner
    return None
