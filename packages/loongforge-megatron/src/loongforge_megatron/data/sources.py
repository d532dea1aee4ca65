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


def iter_documents(source, *, sft: bool = False) -> Iterator[object]:
    """Yield documents (str for pretraining; dict records for SFT) from a ``DataSource``, up to ``max_bytes``."""
    budget = source.max_bytes
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
            yield text
        return
    for path in _expand(source.paths):
        if source.kind == "text":
            text = path.read_text(errors="replace")
            if not take(len(text)):
                return
            yield text
        elif source.kind == "jsonl":
            with open(path) as fh:
                for lineno, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise RecipeError(f"{path}:{lineno}: invalid JSON ({exc.msg})", key="data.source.paths") from None
                    if sft:
                        if not take(len(line)):
                            return
                        yield rec
                        continue
                    if source.text_key not in rec:
                        raise RecipeError(f"{path}:{lineno}: record has no '{source.text_key}' field", key="data.source.text_key")
                    if not take(len(rec[source.text_key])):
                        return
                    yield rec[source.text_key]
        elif source.kind == "parquet":
            import pyarrow.parquet as pq

            table = pq.read_table(path)
            if sft:
                for rec in table.to_pylist():
                    if not take(len(json.dumps(rec))):
                        return
                    yield rec
                continue
            if source.text_key not in table.column_names:
                raise RecipeError(f"{path}: no column '{source.text_key}' (columns: {table.column_names})", key="data.source.text_key")
            for text in table.column(source.text_key).to_pylist():
                if not take(len(text)):
                    return
                yield text
