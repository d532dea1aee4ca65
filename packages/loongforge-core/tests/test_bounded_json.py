"""JSON files a user hands us are read bounded: anything but a small, shallow, regular JSON file is one line naming
it, as the error the caller chose, and nothing blocks (a FIFO) or grows (``/dev/zero``)."""

from __future__ import annotations

import json
import os
from functools import partial

import pytest
from loongforge.bounded_json import MAX_DEPTH, parse_json, read_json, read_json_object, read_regular_file
from loongforge.errors import CheckpointError, RecipeError


def test_a_config_reads_and_hostile_files_are_one_line(tmp_path):
    good = tmp_path / "config.json"
    good.write_text(json.dumps({"hidden_size": 64, "nested": {"a": [1, 2.5, None, True]}}))
    assert read_json_object(good, error=CheckpointError)["nested"]["a"] == [1, 2.5, None, True]
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(64)
    cases = {
        fifo: "not a regular file", tmp_path: "not a regular file", "/dev/zero": "not a regular file",
        tmp_path / "missing.json": "cannot be read",
        tmp_path / "deep.json": f"nests deeper than {MAX_DEPTH} levels",
        tmp_path / "deep70.json": f"nests deeper than {MAX_DEPTH} levels",
        tmp_path / "nan.json": "NaN is not JSON", tmp_path / "garbled.json": "not valid JSON",
        tmp_path / "latin1.json": "not valid JSON", tmp_path / "list.json": "a JSON object is expected, got a list",
    }
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (tmp_path / "deep70.json").write_text("[" * 70 + "]" * 70)
    (tmp_path / "nan.json").write_text('{"a": NaN}')
    (tmp_path / "garbled.json").write_text("{not json")
    (tmp_path / "latin1.json").write_bytes(b'{"a": "\xe9"}')
    (tmp_path / "list.json").write_text("[1, 2]")
    for path, expected in cases.items():
        with pytest.raises(CheckpointError) as err:
            read_json_object(path, error=CheckpointError)
        assert expected in str(err.value) and str(path) in str(err.value) and "\n" not in str(err.value), path
    with pytest.raises(CheckpointError, match="64 bytes, more than a JSON file here may hold \\(10\\)"):
        read_json(big, error=CheckpointError, max_bytes=10)


def test_a_recipe_file_error_names_the_key_and_records_may_hold_nan(tmp_path):
    """The same reader raises the caller's error: a RecipeError naming the recipe key and what the file is."""
    error = partial(RecipeError, key="data.path")
    with pytest.raises(RecipeError) as err:
        read_regular_file(tmp_path, error=error, what="records file")
    assert str(err.value).startswith("key 'data.path': records file") and "not a regular file (a directory)" in str(
        err.value)
    with pytest.raises(RecipeError, match="key 'data.path': .*missing.json' cannot be read: it does not exist"):
        read_json(tmp_path / "missing.json", error=error)
    with pytest.raises(RecipeError, match=r"key .data.path.: line 3: not valid JSON \(NaN is not JSON\)"):
        parse_json('{"fps": NaN}', error=error, where="line 3")
    assert parse_json('{"fps": NaN}', error=error, where="line 3", allow_nan=True)["fps"] != 0
