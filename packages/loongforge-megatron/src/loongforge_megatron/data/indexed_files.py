"""Checks of megatron's indexed-dataset files (``.bin`` / ``.idx``) and its sample-index cache, before megatron
opens them: a truncated, garbled or empty file is one ``RecipeError`` line naming it (megatron would fail with an
assertion or a numpy error, mid-build, plus a ``__del__`` traceback of its half-opened reader).

The cache directory is keyed by the content of the datasets it indexes, so a corpus prepared again (``data
prepare --force``, or files replaced by hand) never reuses the sample plan of the old one.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import numpy as np
from loongforge.errors import RecipeError

_HEADER = b"MMIDIDX\x00\x00"
_ITEMSIZE = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}  # megatron's DType codes
_FIX = "run `loongforge data prepare --force` to rebuild it"


def _bad(path: Path, what: str, key: str) -> RecipeError:
    return RecipeError(f"{path}: {what}; {_FIX}", key=key)


def check_indexed(prefix: str | Path, *, key: str = "data.path") -> int:
    """Check ``prefix.idx`` / ``prefix.bin``; returns the number of documents."""
    idx, bin_ = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    for f in (idx, bin_):
        if not f.is_file():
            raise RecipeError(f"{f} not found; run `loongforge data prepare` first", key=key)
    size = idx.stat().st_size
    with open(idx, "rb") as fh:
        head = fh.read(34)
    if len(head) < 34 or head[:9] != _HEADER:
        raise _bad(idx, "not a megatron index file (empty, truncated or garbled header)", key)
    version, code, sequences, documents = struct.unpack("<QBQQ", head[9:34])
    if version != 1 or code not in _ITEMSIZE:
        raise _bad(idx, f"unsupported index version {version} / dtype code {code}", key)
    expected = 34 + sequences * 12 + documents * 8
    if size != expected:
        raise _bad(idx, f"has {size} bytes, its header ({sequences} sequences, {documents} document bounds) needs "
                        f"{expected} (truncated or garbled)", key)
    if sequences == 0 or documents < 2:
        raise RecipeError(f"{idx}: the dataset is empty (no documents); prepare it from a source with text", key=key)
    lengths = np.fromfile(idx, dtype=np.int32, count=sequences, offset=34)
    pointers = np.fromfile(idx, dtype=np.int64, count=sequences, offset=34 + 4 * sequences)
    bounds = np.fromfile(idx, dtype=np.int64, count=documents, offset=34 + 12 * sequences)
    item = _ITEMSIZE[code]
    if (lengths < 0).any() or (np.diff(pointers) != lengths[:-1].astype(np.int64) * item).any() or pointers[0] != 0:
        raise _bad(idx, "sequence lengths and pointers disagree (garbled)", key)
    if bounds[0] != 0 or bounds[-1] != sequences or (np.diff(bounds) < 0).any():
        raise _bad(idx, "document bounds are out of order (garbled)", key)
    need = int(pointers[-1]) + int(lengths[-1]) * item
    if bin_.stat().st_size != need:
        raise _bad(bin_, f"has {bin_.stat().st_size} bytes, its index {idx.name} needs {need} (truncated, or the "
                         "two files are from different preparations)", key)
    return documents - 1


def content_key(prefixes: list[str]) -> str:
    """A short hash of the datasets' index files and data sizes: the cache sub-directory of exactly this data."""
    h = hashlib.sha256()
    for p in prefixes:
        h.update(Path(f"{p}.idx").read_bytes())
        h.update(str(Path(f"{p}.bin").stat().st_size).encode())
    return h.hexdigest()[:16]


def _load(path: Path, key: str) -> np.ndarray:
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise RecipeError(f"{path}: corrupt index cache ({str(exc).splitlines()[0][:120]}); delete it (it is "
                          "rebuilt)", key=key) from None
    if not np.issubdtype(arr.dtype, np.integer):
        raise RecipeError(f"{path}: corrupt index cache (dtype {arr.dtype}); delete it (it is rebuilt)", key=key)
    return arr


def check_cache(cache: Path, *, num_documents: int, key: str = "data.path") -> None:
    """Check megatron's cached document / sample / shuffle indices under ``cache`` (their shapes and ranges)."""
    if not cache.is_dir():
        return
    for doc_path in sorted(cache.glob("*-document_index.npy")):
        base = doc_path.name.removesuffix("document_index.npy")
        sample_path, shuffle_path = cache / f"{base}sample_index.npy", cache / f"{base}shuffle_index.npy"
        if not (sample_path.is_file() and shuffle_path.is_file()):
            continue  # NOTE: megatron rebuilds an incomplete set
        doc, sample, shuffle = _load(doc_path, key), _load(sample_path, key), _load(shuffle_path, key)
        if doc.ndim == 1 and not len(doc) and sample.shape == (1, 2) and not len(shuffle):
            continue  # NOTE: a split with no documents (a small corpus' valid / test share): megatron's empty indices
        if doc.ndim != 1 or not len(doc) or doc.min() < 0 or doc.max() >= num_documents:
            raise RecipeError(f"{doc_path}: corrupt index cache (document ids outside 0..{num_documents - 1}); "
                              "delete it (it is rebuilt)", key=key)
        if sample.ndim != 2 or sample.shape[0] < 2 or sample[:, 0].min() < 0 or sample[:, 0].max() >= len(doc):
            raise RecipeError(f"{sample_path}: corrupt index cache; delete it (it is rebuilt)", key=key)
        if shuffle.ndim != 1 or (len(shuffle) and (shuffle.min() < 0 or shuffle.max() >= sample.shape[0] - 1)):
            raise RecipeError(f"{shuffle_path}: corrupt index cache; delete it (it is rebuilt)", key=key)
