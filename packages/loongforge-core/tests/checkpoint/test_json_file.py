"""JSON files of a checkpoint folder are read bounded: anything but a small, shallow, regular JSON file is one line
naming it, and nothing blocks (a FIFO) or grows (``/dev/zero``)."""

from __future__ import annotations

import json
import os

import pytest
from loongforge.checkpoint.json_file import MAX_DEPTH, read_json, read_json_object
from loongforge.errors import CheckpointError


def test_a_config_reads_and_hostile_files_are_one_line(tmp_path):
    good = tmp_path / "config.json"
    good.write_text(json.dumps({"hidden_size": 64, "nested": {"a": [1, 2.5, None, True]}}))
    assert read_json_object(good)["nested"]["a"] == [1, 2.5, None, True]
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
            read_json_object(path)
        assert expected in str(err.value) and str(path) in str(err.value) and "\n" not in str(err.value), path
    with pytest.raises(CheckpointError, match="64 bytes, more than a JSON file here may hold \\(10\\)"):
        read_json(big, max_bytes=10)
