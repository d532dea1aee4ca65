"""An HF safetensors reader under the names a model family spells (one spelling for several HF versions)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from loongforge.checkpoint import SafetensorsReader


class AliasedReader:
    """A reader whose tensor names are ``alias(name)`` of the file's (one spelling for several HF versions)."""

    def __init__(self, reader: SafetensorsReader, alias: Callable[[str], str]):
        self._reader, self.path = reader, reader.path
        self._file_name = {alias(k): k for k in reader.keys()}

    def keys(self) -> list[str]:
        return list(self._file_name)

    def __contains__(self, name: str) -> bool:
        return name in self._file_name

    def get(self, name: str) -> torch.Tensor:
        return self._reader.get(self._file_name[name])

    def read_rows(self, name: str, row: int, out: torch.Tensor) -> torch.Tensor:
        return self._reader.read_rows(self._file_name[name], row, out)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._reader.shape(self._file_name[name])

    def dtype(self, name: str) -> torch.dtype:
        return self._reader.dtype(self._file_name[name])

    def read_columns(self, name: str, cols: torch.Tensor) -> torch.Tensor | None:
        """Columns ``cols`` of a block-scaled FP8 weight, dequantized (None: the file's reader has no such read,
        or ``name`` is not FP8)."""
        read = getattr(self._reader, "read_columns", None)
        return None if read is None else read(self._file_name[name], cols)
