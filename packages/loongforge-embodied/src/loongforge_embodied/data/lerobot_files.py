"""The files of a local LeRobotDataset v3, checked offline before LeRobot opens them.

NOTE: LeRobot treats a missing local file as "not downloaded yet": ``LeRobotDatasetMetadata`` and
``LeRobotDataset`` then ask the Hugging Face Hub for the repo's refs and download ``data.repo_id`` into
``data.root``, and a truncated or garbled file surfaces as a pyarrow / json traceback without its name. Checking
what LeRobot will read first (``meta/info.json``, ``meta/stats.json``, ``meta/tasks.parquet``,
``meta/episodes/*/*.parquet``, ``data/*/*.parquet``, the videos) keeps training offline and makes every problem
one line naming the file. Only parquet footers and the ``episode_index`` column are read here; a file that
fails later, inside LeRobot, is found by :func:`find_unreadable_parquet`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loongforge.errors import LoongForgeError

HINT = "re-record it (loongforge data prepare --force) or point data.root at an intact LeRobotDataset v3"


class DatasetError(LoongForgeError):
    """A local LeRobotDataset is incomplete or corrupt; the message names the file."""


def read_json(path: Path) -> Any:
    """A JSON file of the dataset; missing / unreadable / garbled is a ``DatasetError`` naming it."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DatasetError(f"{path} is missing; {HINT}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DatasetError(f"{path} is not valid JSON ({str(exc)[:200]}); {HINT}") from None


def load_info(root: str | Path, *, full: bool = False) -> dict[str, Any]:
    """``meta/info.json`` with its features checked (what a recipe check reads), and with ``full`` the other keys
    LeRobot relies on."""
    path = Path(root) / "meta" / "info.json"
    info = read_json(path)
    if not isinstance(info, dict):
        raise DatasetError(f"{path} is not a JSON object; {HINT}")
    keys = (("features", dict), ("fps", int | float), ("total_episodes", int), ("data_path", str))
    for key, kind in keys if full else keys[:1]:
        if not isinstance(info.get(key), kind) or isinstance(info.get(key), bool):
            raise DatasetError(f"{path}: '{key}' is missing or malformed; {HINT}")
    feats = info["features"]
    for key in ("observation.state", "action"):
        shape = feats.get(key, {}).get("shape") if isinstance(feats.get(key), dict) else None
        if not (isinstance(shape, list) and shape and isinstance(shape[0], int) and shape[0] > 0):
            raise DatasetError(f"{path}: feature '{key}' is missing or has no shape; a VLA dataset records the "
                               "state and the action")
    if not all(isinstance(f, dict) and isinstance(f.get("dtype"), str) for f in feats.values()):
        raise DatasetError(f"{path}: every feature needs a 'dtype'; {HINT}")
    return info


def _parquet_rows(path: Path, *, column: str | None = None) -> list[Any] | None:
    """Open ``path``'s footer (and read ``column``); unreadable is a ``DatasetError`` naming the file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        if column is None:
            return None
        if column not in pf.schema_arrow.names:
            raise DatasetError(f"{path} has no '{column}' column; {HINT}")
        return pf.read(columns=[column]).column(column).to_pylist()
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise DatasetError(f"{path} is not a readable parquet file ({str(exc).splitlines()[0][:200]}); {HINT}") from None


def check_dataset(root: str | Path, *, state_key: str = "observation.state") -> dict[str, Any]:
    """Check the files LeRobot will open for the dataset at ``root`` (``state_key``: the state the policy reads);
    returns ``meta/info.json``."""
    root = Path(root)
    info = load_info(root, full=True)
    stats_path = root / "meta" / "stats.json"
    stats = read_json(stats_path)
    for key in dict.fromkeys(("observation.state", state_key, "action")):
        entry = stats.get(key) if isinstance(stats, dict) else None
        if not (isinstance(entry, dict) and all(isinstance(entry.get(m), list) for m in ("mean", "std"))):
            raise DatasetError(f"{stats_path}: no mean / std for '{key}' (the trainer normalises with them); {HINT}")
    if info.get("total_tasks", 1):
        tasks = root / "meta" / "tasks.parquet"
        if not tasks.is_file():
            raise DatasetError(f"{tasks} is missing; {HINT}")
        _parquet_rows(tasks)
    episodes = sorted((root / "meta" / "episodes").glob("*/*.parquet"))
    if info["total_episodes"] and not episodes:
        raise DatasetError(f"{root / 'meta' / 'episodes'} holds no episode parquet files; {HINT}")
    for path in episodes:
        _parquet_rows(path)
    data = sorted((root / "data").glob("*/*.parquet"))
    if not data:
        raise DatasetError(f"{root / 'data'} holds no parquet files; {HINT}")
    seen: set[int] = set()
    for path in data:
        seen.update(int(e) for e in _parquet_rows(path, column="episode_index") if e is not None)
    missing = sorted(set(range(info["total_episodes"])) - seen)
    if missing:
        raise DatasetError(f"{root / 'data'}: episode {missing[0]} of {info['total_episodes']} (meta/info.json) is in "
                           f"no data file ({len(missing)} missing); {HINT}")
    videos = [k for k, f in info["features"].items() if f["dtype"] == "video"]
    if videos and not any((root / "videos").glob("**/*.mp4")):
        raise DatasetError(f"{root / 'videos'} holds no videos for {', '.join(videos)}; {HINT}")
    return info


def find_unreadable_parquet(root: str | Path) -> str | None:
    """The first parquet file under ``root`` that pyarrow cannot read fully, with the reason (the error path of a
    failed LeRobot load), or None."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for path in sorted(Path(root).glob("**/*.parquet")):
        try:
            pq.read_table(path)
        except (pa.ArrowException, OSError, ValueError) as exc:
            return f"{path} ({str(exc).splitlines()[0][:200]})"
    return None
