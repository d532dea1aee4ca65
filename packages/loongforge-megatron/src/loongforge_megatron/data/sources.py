"""Read raw documents for data preparation: text files, JSONL, Parquet, or the Python standard library's
own sources (a real corpus available offline on any machine with Python)."""

from __future__ import annotations

import glob
import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from loongforge.errors import RecipeError


def _expand(patterns: list[str]) -> list[Path]:
    files: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern, recursive=True))
        if not matches:
            raise RecipeError(f"no file matches '{pattern}'", key="data.source.paths")
        files += [Path(m) for m in matches if Path(m).is_file()]
    return files


def stdlib_files() -> list[Path]:
    """The ``.py`` files of this interpreter's standard library, in a stable order (tests excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not (skip & set(p.relative_to(root).parts)))


def iter_documents(source, *, sft: bool = False, origins: list[str] | None = None) -> Iterator[object]:
    """Yield documents (str for pretraining; dict records for SFT) from a ``DataSource``, up to ``max_bytes``;
    ``origins`` gets each document's ``file`` or ``file:line`` (for errors that name the record)."""
    budget = source.max_bytes
    where = origins.append if origins is not None else (lambda _: None)
    seen = 0

    def take(text_len: int) -> bool:
        nonlocal seen
        if budget is not None and seen >= budget:
            return False
        seen += text_len
        return True

    if source.kind == "python_stdlib":
        for path in stdlib_files():
            text = path.read_text(errors="replace")
            if not take(len(text)):
                return
            where(str(path))
            yield text
        return
    for path in _expand(source.paths):
        if source.kind == "text":
            text = path.read_text(errors="replace")
            if not take(len(text)):
                return
            where(str(path))
            yield text
        elif source.kind == "jsonl":
            for lineno, line in _lines(path):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise RecipeError(f"{path}:{lineno}: invalid JSON ({exc.msg})", key="data.source.paths") from None
                if not isinstance(rec, dict):
                    raise RecipeError(f"{path}:{lineno}: expected a JSON object per line, got {type(rec).__name__}",
                                      key="data.source.paths")
                if sft:
                    if not take(len(line)):
                        return
                    where(f"{path}:{lineno}")
                    yield rec
                    continue
                if not isinstance(rec.get(source.text_key), str):
                    what = "has no" if source.text_key not in rec else "has a non-string"
                    raise RecipeError(f"{path}:{lineno}: record {what} '{source.text_key}' field", key="data.source.text_key")
                if not take(len(rec[source.text_key])):
                    return
                where(f"{path}:{lineno}")
                yield rec[source.text_key]
        elif source.kind == "parquet":
            table = _parquet(path)
            if sft:
                for row, rec in enumerate(table.to_pylist()):
                    if not take(len(json.dumps(rec, default=str))):
                        return
                    where(f"{path}: row {row}")
                    yield rec
                continue
            if source.text_key not in table.column_names:
                raise RecipeError(f"{path}: no column '{source.text_key}' (columns: {table.column_names})", key="data.source.text_key")
            for row, text in enumerate(table.column(source.text_key).to_pylist()):
                if not isinstance(text, str):
                    raise RecipeError(f"{path}: row {row}: column '{source.text_key}' is not a string",
                                      key="data.source.text_key")
                if not take(len(text)):
                    return
                where(f"{path}: row {row}")
                yield text


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, line) of a UTF-8 text file; a binary file is one error naming it."""
    def binary(lineno: int) -> RecipeError:
        return RecipeError(f"{path}:{lineno}: not UTF-8 text (a binary file?); JSONL is one JSON object per line",
                           key="data.source.paths")

    with open(path, encoding="utf-8") as fh:
        lineno = 0
        try:
            for lineno, line in enumerate(fh, 1):  # noqa: B007 - read in the except clause
                if "\x00" in line:
                    raise binary(lineno)
                yield lineno, line
        except UnicodeDecodeError:
            raise binary(lineno + 1) from None


def _parquet(path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise RecipeError(f"{path}: not a readable Parquet file ({str(exc).splitlines()[0][:120]})",
                          key="data.source.paths") from None
