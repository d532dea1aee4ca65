"""Streaming safetensors I/O: read one tensor at a time from HF checkpoints, write size-capped shards.

Never unpickles: only safetensors files are read. Peak memory is one tensor (reader) or one shard (writer).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
from pathlib import Path

import torch

from loongforge.checkpoint.atomic import disk_full, disk_full_error, fsync_tree, replace_dir
from loongforge.errors import CheckpointError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

def _bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no copy; numpy is never imported).

    NOTE: the view does not keep ``t`` alive; callers hold ``t`` while they use it.
    """
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B") if n else memoryview(b"")


_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


_ITEMSIZE = {code: torch.empty((), dtype=dt).element_size() for code, dt in _DTYPES.items()}


def _check_entry(path: str | os.PathLike, name: str, info: object, data_size: int) -> None:
    """A header entry's dtype, shape and offsets agree with each other and lie inside the file (checked before
    anything is allocated, so a bogus shape never reaches ``torch.empty``)."""
    if not isinstance(info, dict):
        raise CheckpointError(f"{path}: tensor '{name}': header entry is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in _ITEMSIZE:
        raise CheckpointError(f"{path}: tensor '{name}' has unsupported dtype {dtype!r}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise CheckpointError(f"{path}: tensor '{name}' has an invalid shape {str(shape)[:100]} (non-negative "
                              "integers expected)")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise CheckpointError(f"{path}: tensor '{name}' has invalid data_offsets {str(offsets)[:100]}")
    numel = 1
    for d in shape:
        numel *= d
    nbytes = offsets[1] - offsets[0]
    if numel * _ITEMSIZE[dtype] != nbytes:
        raise CheckpointError(f"{path}: tensor '{name}' has {nbytes} bytes for shape {shape} of {dtype}")
    if offsets[1] > data_size:
        raise CheckpointError(f"{path}: tensor '{name}' ends at byte {offsets[1]} of a {data_size}-byte data "
                              "section (the file is truncated)")


def read_header(path: str | os.PathLike) -> dict[str, dict]:
    """The JSON header of a safetensors file (name -> dtype, shape, data_offsets), without reading data; every
    entry is checked against the file's size (a truncated or garbled file is a one-line ``CheckpointError``)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little")
            if len(head) < 8 or n <= 0 or n > 100 * 2**20 or 8 + n > size:
                raise CheckpointError(f"{path}: not a safetensors file, or truncated (header length {n}, file "
                                      f"size {size} bytes)")
            raw = f.read(n)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{path}: garbled safetensors header ({str(exc).splitlines()[0][:120]})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: garbled safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    for name, info in header.items():
        _check_entry(path, name, info, size - 8 - n)
        info["start"] = 8 + n + info["data_offsets"][0]
    return header


def _weight_map(path: Path, index: Path) -> list[Path]:
    """The shard files an HF index names, each confined to the index's directory."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        raise CheckpointError(f"{index}: not a safetensors index (a JSON object with a 'weight_map' object)") from None
    root = path.resolve()
    files = set()
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str) or not shard or Path(shard).is_absolute() or (path / shard).resolve().parent != root:
            raise CheckpointError(f"{index}: key 'weight_map.{tensor}' names '{str(shard)[:200]}', not a file in "
                                  f"{path}")
        files.add(path / shard)
    return sorted(files)


class SafetensorsReader:
    """Lazy reader over a file, or a directory holding ``model.safetensors``, an index, or ``*.safetensors``.

    Only headers are parsed up front; ``get`` reads one tensor with a plain positioned read. NOTE: no mmap,
    so pages of tensors already converted never count towards the process's resident memory.
    """

    def __init__(self, path: str | os.PathLike):
        path = Path(path)
        if path.is_file():
            files = [path]
        elif (path / INDEX_NAME).is_file():
            files = _weight_map(path, path / INDEX_NAME)
        elif path.is_dir():
            files = sorted(path.glob("*.safetensors"))
        else:
            raise CheckpointError(f"{path}: no such checkpoint file or directory")
        if not files:
            raise CheckpointError(f"{path}: no *.safetensors files found")
        self._index: dict[str, tuple[Path, dict]] = {}
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{f}: shard listed in the index is missing")
            for name, info in read_header(f).items():
                self._index[name] = (f, info)
        self._open: dict[Path, object] = {}
        self.path = path

    def keys(self) -> list[str]:
        return list(self._index)

    def __contains__(self, name: str) -> bool:
        return name in self._index

    def __len__(self) -> int:
        return len(self._index)

    def _info(self, name: str) -> tuple[Path, dict]:
        if name not in self._index:
            raise CheckpointError(f"{self.path}: tensor '{name}' is missing")
        return self._index[name]

    def get(self, name: str) -> torch.Tensor:
        """Read one tensor into memory."""
        f, info = self._info(name)  # NOTE: read_header checked the shape against the bytes and the file's size
        return self.read_rows(name, 0, torch.empty(info["shape"], dtype=self.dtype(name)))

    def read_rows(self, name: str, row: int, out: torch.Tensor) -> torch.Tensor:
        """Positioned read of ``out.shape[0]`` dim-0 rows of ``name``, starting at ``row``, into ``out``
        (contiguous, same dtype and trailing shape). Lets converters fill a shard without the whole tensor."""
        f, info = self._info(name)
        shape = tuple(info["shape"])
        if out.dtype != self.dtype(name) or not out.is_contiguous() or (shape and tuple(out.shape[1:]) != shape[1:]):
            raise CheckpointError(f"{f}: cannot read '{name}' {shape} into {out.dtype}{tuple(out.shape)}")
        if shape and (row < 0 or row + out.shape[0] > shape[0]):
            raise CheckpointError(f"{f}: rows {row}..{row + out.shape[0]} of '{name}' are out of range {shape}")
        nbytes = out.numel() * out.element_size()
        if nbytes:
            row_bytes = nbytes // out.shape[0] if out.dim() else 0
            if f not in self._open:
                self._open[f] = open(f, "rb")  # noqa: SIM115 - closed in close()
            handle = self._open[f]
            handle.seek(info["start"] + row * row_bytes)
            if handle.readinto(_bytes(out)) != nbytes:
                raise CheckpointError(f"{f}: truncated while reading tensor '{name}'")
        return out

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape without reading data."""
        return tuple(self._info(name)[1]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        code = self._info(name)[1]["dtype"]
        if code not in _DTYPES:
            raise CheckpointError(f"{self.path}: tensor '{name}' has unsupported dtype {code}")
        return _DTYPES[code]

    def close(self) -> None:
        for handle in self._open.values():
            handle.close()
        self._open.clear()

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


TensorSpec = tuple[torch.dtype, tuple[int, ...]]
_NAMES = {v: k for k, v in _DTYPES.items()}


def _nbytes(spec: TensorSpec) -> int:
    dtype, shape = spec
    n = 1
    for d in shape:
        n *= d
    return n * torch.empty((), dtype=dtype).element_size()


class StreamingSafetensorsFile:
    """One safetensors file written tensor by tensor: the header is laid out from ``specs`` up front, then
    each ``write`` seeks to its slot. Nothing is buffered, so peak memory is the caller's one tensor.
    """

    def __init__(self, path: str | os.PathLike, specs: dict[str, TensorSpec], *, metadata: dict | None = None):
        self.path = Path(path)
        header: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
        offset = 0
        self._slots: dict[str, tuple[int, TensorSpec]] = {}
        for name, spec in specs.items():
            size = _nbytes(spec)
            header[name] = {"dtype": _NAMES[spec[0]], "shape": list(spec[1]), "data_offsets": [offset, offset + size]}
            self._slots[name] = (offset, spec)
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._data_start = 8 + len(raw)
        self._file = open(self.path, "wb")  # noqa: SIM115 - closed in close()
        self._file.write(len(raw).to_bytes(8, "little") + raw)
        self._file.truncate(self._data_start + offset)
        self._missing = set(specs)
        self._rows_left = {name: (spec[1][0] if spec[1] else 1) for name, spec in specs.items()}

    def write(self, name: str, tensor: torch.Tensor) -> None:
        self.write_rows(name, 0, tensor, whole=True)

    def write_rows(self, name: str, row: int, tensor: torch.Tensor, *, whole: bool = False) -> None:
        """Write ``tensor`` as dim-0 rows ``row..row+len`` of ``name`` (the whole tensor when ``whole``).
        A tensor counts as written once all its rows were; converters stream shards straight into place."""
        if name not in self._slots:
            raise CheckpointError(f"{self.path}: unexpected tensor '{name}'")
        offset, (dtype, shape) = self._slots[name]
        shape = tuple(shape)
        got = tuple(tensor.shape)
        bad = got != shape if whole or not shape else (
            got[1:] != shape[1:] or len(got) != len(shape) or row < 0 or row + got[0] > shape[0])
        if tensor.dtype != dtype or bad:
            where = "" if whole else f" at row {row}"
            raise CheckpointError(
                f"{self.path}: tensor '{name}' is {tensor.dtype}{got}{where}, expected {dtype}{shape}"
            )
        t = tensor.detach().cpu().contiguous()
        n = t.numel() * t.element_size()
        rows = got[0] if shape else 1
        self._file.seek(self._data_start + offset + (row * (n // rows) if rows else 0))
        self._file.write(_bytes(t))
        left = self._rows_left[name] - rows
        self._rows_left[name] = left
        if left <= 0:
            self._missing.discard(name)

    def close(self) -> None:
        if self._missing:
            self._file.close()
            raise CheckpointError(f"{self.path}: {len(self._missing)} tensors never written, e.g. "
                                  f"'{sorted(self._missing)[0]}'")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()


class ShardedSafetensorsWriter:
    """HF-style sharded checkpoint written in ``<out_dir>.tmp-<pid>``; ``commit()`` renames it into place.

    Shards are planned from ``specs`` (name -> (dtype, shape), in order) with at most ``max_shard_bytes`` each:
    one shard -> ``model.safetensors``; several -> ``model-0000i-of-0000n.safetensors`` plus the HF index
    (``stem`` replaces ``model``: diffusers names its weights ``diffusion_pytorch_model``).
    Tensors may be added in any order and are written straight to disk. ``staging_dir`` is where callers put
    extra files (config, tokenizer) so they land atomically with the weights.
    """

    def __init__(
        self, out_dir: str | os.PathLike, specs: dict[str, TensorSpec], *,
        max_shard_bytes: int = 5 * 2**30, force: bool = False, stem: str = "model",
    ):
        self.out_dir = Path(out_dir)
        if self.out_dir.exists() and any(self.out_dir.iterdir()) and not force:
            raise CheckpointError(f"{self.out_dir}: destination is not empty (--force, or force=True, overwrites it)")
        self.staging_dir = self.out_dir.with_name(f"{self.out_dir.name}.tmp-{os.getpid()}")
        shutil.rmtree(self.staging_dir, ignore_errors=True)
        self.staging_dir.mkdir(parents=True)
        groups: list[dict[str, TensorSpec]] = [{}]
        size = 0
        for name, spec in specs.items():
            nbytes = _nbytes(spec)
            if groups[-1] and size + nbytes > max_shard_bytes:
                groups.append({})
                size = 0
            groups[-1][name] = spec
            size += nbytes
        n = len(groups)
        self._files: list[StreamingSafetensorsFile] = []
        self._where: dict[str, StreamingSafetensorsFile] = {}
        weight_map = {}
        for i, group in enumerate(groups):
            fname = f"{stem}.safetensors" if n == 1 else f"{stem}-{i + 1:05d}-of-{n:05d}.safetensors"
            f = StreamingSafetensorsFile(self.staging_dir / fname, group)
            self._files.append(f)
            for name in group:
                self._where[name] = f
                weight_map[name] = fname
        if n > 1:
            total = sum(_nbytes(s) for s in specs.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (self.staging_dir / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2))

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self._where:
            raise CheckpointError(f"{self.out_dir}: unexpected tensor '{name}'")
        with self._space(self._where[name].path):
            self._where[name].write(name, tensor)

    def add_rows(self, name: str, row: int, tensor: torch.Tensor) -> None:
        """Write dim-0 rows ``row..row+len(tensor)`` of ``name`` (see ``StreamingSafetensorsFile.write_rows``)."""
        if name not in self._where:
            raise CheckpointError(f"{self.out_dir}: unexpected tensor '{name}'")
        with self._space(self._where[name].path):
            self._where[name].write_rows(name, row, tensor)

    @staticmethod
    @contextlib.contextmanager
    def _space(path: Path):
        """Out of disk space is a ``CheckpointError`` that says so (the caller's abort removes the staging dir)."""
        try:
            yield
        except OSError as exc:
            if disk_full(exc):
                raise disk_full_error(path, exc) from None
            raise

    def commit(self) -> Path:
        """Close every shard (fails if a tensor was never written), fsync, rename into place."""
        with self._space(self.staging_dir):
            for f in self._files:
                f.close()
            fsync_tree(self.staging_dir)
            replace_dir(self.staging_dir, self.out_dir)
        return self.out_dir

    def abort(self) -> None:
        for f in self._files:
            if not f._file.closed:
                f._file.close()
        shutil.rmtree(self.staging_dir, ignore_errors=True)

    def __enter__(self) -> ShardedSafetensorsWriter:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None:
            self.abort()
            return
        try:
            self.commit()
        except BaseException:
            self.abort()  # NOTE: a failed commit (a tensor never written) leaves no staging dir or open shards
            raise
