"""Corrupt checkpoint files are one-line ``CheckpointError``s naming the file, checked before anything is allocated;
a truncated latest checkpoint is skipped for the previous one; ``latest`` and index shard names stay inside their
directory; retention never deletes the newest finite checkpoint; a full disk says so."""

from __future__ import annotations

import errno
import json
import struct

import pytest
import torch
from loongforge.checkpoint import SafetensorsReader, apply_retention, atomic_checkpoint, latest_checkpoint
from loongforge.checkpoint.atomic import disk_full, verify_files
from loongforge.errors import CheckpointError
from safetensors.torch import save_file


def _file(tmp_path, name="w.safetensors"):
    path = tmp_path / name
    save_file({"a": torch.randn(8, 4), "b": torch.arange(6)}, str(path))
    return path


def _with_header(path, header: dict, data: bytes = b"") -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _read_all(path):
    with SafetensorsReader(path) as r:
        return {k: r.get(k) for k in r.keys()}


@pytest.mark.parametrize("cut", [0, 5, 8, 40, -1])
def test_truncated_safetensors_names_the_file(tmp_path, cut):
    path = _file(tmp_path)
    raw = path.read_bytes()
    path.write_bytes(raw[:cut] if cut >= 0 else raw[:-10])
    with pytest.raises(CheckpointError, match=r"w\.safetensors: .*(truncated|not a safetensors)"):
        _read_all(path)


def test_garbled_header_names_the_file(tmp_path):
    path = tmp_path / "w.safetensors"
    path.write_bytes(struct.pack("<Q", 12) + b"\xff\xfe{garbage!" + b"\0" * 64)
    with pytest.raises(CheckpointError, match=r"w\.safetensors: garbled safetensors header"):
        _read_all(path)
    _with_header(path, ["not", "an", "object"])
    with pytest.raises(CheckpointError, match="not a JSON object"):
        _read_all(path)


@pytest.mark.parametrize("shape", [[-4, 2], [2**40, 2**40], ["x"], [1.5]])
def test_bogus_shape_is_refused_before_allocating(tmp_path, shape, monkeypatch):
    path = tmp_path / "w.safetensors"
    _with_header(path, {"a": {"dtype": "F32", "shape": shape, "data_offsets": [0, 16]}}, b"\0" * 16)
    allocated = []
    real = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: allocated.append(a) or real(*a, **k))
    with pytest.raises(CheckpointError, match=r"w\.safetensors: tensor 'a' has (an invalid shape|\d+ bytes for shape)"):
        _read_all(path)
    assert not allocated


def test_offsets_past_the_end_and_bad_dtype(tmp_path):
    path = tmp_path / "w.safetensors"
    _with_header(path, {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8)
    with pytest.raises(CheckpointError, match="ends at byte 16 of a 8-byte data section"):
        _read_all(path)
    _with_header(path, {"a": {"dtype": "F99", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 16)
    with pytest.raises(CheckpointError, match="unsupported dtype 'F99'"):
        _read_all(path)


@pytest.mark.parametrize("shard", ["../../x.safetensors", "/etc/passwd", "sub/../../y.safetensors"])
def test_index_shard_names_stay_in_the_checkpoint_dir(tmp_path, shard):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    _file(tmp_path, "x.safetensors")  # a real file outside: must not be opened
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": shard}}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: key 'weight_map\.a' names"):
        SafetensorsReader(ckpt)


def test_garbled_index_names_the_file(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="index.json: not a safetensors index"):
        SafetensorsReader(tmp_path)


def _save(root, name, payload="x" * 100, **kw):
    with atomic_checkpoint(root, name, **kw) as d:
        (d / "state.bin").write_text(payload)


def test_truncated_latest_checkpoint_is_skipped_with_a_warning(tmp_path, capsys):
    _save(tmp_path, "step_1")
    _save(tmp_path, "step_2")
    (tmp_path / "step_2" / "state.bin").write_text("x" * 10)
    assert verify_files(tmp_path / "step_2").endswith("has 10 of its 100 bytes (truncated or overwritten)")
    skipped: list[str] = []
    assert latest_checkpoint(tmp_path, verify=True, skipped=skipped) == tmp_path / "step_1"
    assert "skipping step_2" in capsys.readouterr().err and "state.bin" in skipped[0]
    (tmp_path / "step_1" / "state.bin").unlink()
    assert latest_checkpoint(tmp_path, verify=True) is None


@pytest.mark.parametrize("pointer", ["../other_run/checkpoints/step_1", "/tmp/step_1", "sub/../../step_1"])
def test_latest_outside_the_checkpoints_dir_is_refused(tmp_path, pointer):
    root = tmp_path / "run" / "checkpoints"
    _save(root, "step_1")
    _save(tmp_path / "other_run" / "checkpoints", "step_1")
    (root / "latest").write_text(pointer)
    with pytest.raises(CheckpointError, match=r"latest points outside"):
        latest_checkpoint(root)


@pytest.mark.parametrize("content", [b"\xff\xfe\x00garbage", b"", b"step_9"])
def test_garbled_latest_falls_back_to_newest_complete(tmp_path, content, capsys):
    _save(tmp_path, "step_1")
    _save(tmp_path, "step_2")
    (tmp_path / "latest").write_bytes(content)
    assert latest_checkpoint(tmp_path) == tmp_path / "step_2"


def test_retention_keeps_the_newest_finite_checkpoint(tmp_path):
    _save(tmp_path, "step_1")
    _save(tmp_path, "step_2", finite=False)
    _save(tmp_path, "step_3", finite=False, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["step_1", "step_3"]
    _save(tmp_path, "step_4", keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["step_4"]
    assert apply_retention(tmp_path, keep_last=1) == []


def test_disk_full_is_recognised():
    assert disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert disk_full(RuntimeError("[enforce fail at inline_container.cc:783] . PytorchStreamWriter failed writing "
                                  "file data/3: file write failed, unexpected pos 2816 vs 2752"))
    assert not disk_full(OSError(errno.EACCES, "Permission denied"))


def test_disk_full_while_publishing_says_so(tmp_path, monkeypatch):
    import loongforge.checkpoint.atomic as atomic

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic, "write_atomic", full)
    with pytest.raises(CheckpointError, match="no space left on the device"):
        _save(tmp_path, "step_1")
    assert not any(tmp_path.iterdir())


def test_disk_full_while_exporting_says_so_and_leaves_nothing(tmp_path, monkeypatch):
    from loongforge.checkpoint import ShardedSafetensorsWriter, StreamingSafetensorsFile

    def full(self, name, row, tensor, *, whole=False):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(StreamingSafetensorsFile, "write_rows", full)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: no space left on the device"):
        with ShardedSafetensorsWriter(tmp_path / "hf", {"a": (torch.float32, (2, 2))}) as w:
            w.add("a", torch.zeros(2, 2))
    assert list(tmp_path.iterdir()) == []
