from __future__ import annotations

import json

import pytest
import torch
from loongforge.checkpoint import SafetensorsReader, ShardedSafetensorsWriter, StreamingSafetensorsFile
from loongforge.errors import CheckpointError
from safetensors.torch import load_file, save_file


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(64, 32, generator=g),
        "b": torch.randn(100, generator=g).to(torch.bfloat16),
        "c": torch.arange(10, dtype=torch.int64),
        "d": torch.randn(32, 64, generator=g).to(torch.float16),
        "s": torch.tensor(3.5),
    }


def _specs(ts):
    return {k: (v.dtype, tuple(v.shape)) for k, v in ts.items()}


def test_streaming_file_is_valid_safetensors(tmp_path):
    ts = _tensors()
    f = StreamingSafetensorsFile(tmp_path / "x.safetensors", _specs(ts))
    for k in reversed(list(ts)):  # any order
        f.write(k, ts[k])
    f.close()
    back = load_file(tmp_path / "x.safetensors")
    assert all(torch.equal(back[k], ts[k]) for k in ts)


def test_streaming_file_rejects_wrong_or_missing(tmp_path):
    ts = _tensors()
    f = StreamingSafetensorsFile(tmp_path / "x.safetensors", _specs(ts))
    with pytest.raises(CheckpointError, match="tensor 'a' is torch.float32\\(2, 2\\)"):
        f.write("a", torch.zeros(2, 2))
    with pytest.raises(CheckpointError, match="never written"):
        f.close()


def test_sharded_writer_and_reader_roundtrip(tmp_path):
    ts = _tensors()
    out = tmp_path / "hf"
    with ShardedSafetensorsWriter(out, _specs(ts), max_shard_bytes=8 * 1024) as w:
        for k, v in ts.items():
            w.add(k, v)
    files = sorted(p.name for p in out.iterdir())
    assert "model.safetensors.index.json" in files and "model-00001-of-00002.safetensors" in files
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(ts)
    r = SafetensorsReader(out)
    assert set(r.keys()) == set(ts) and len(r) == len(ts)
    for k, v in ts.items():
        assert r.shape(k) == tuple(v.shape) and r.dtype(k) == v.dtype
        assert torch.equal(r.get(k), v)
    assert not list(tmp_path.glob("*.tmp-*"))


def test_single_shard_has_no_index(tmp_path):
    ts = _tensors()
    with ShardedSafetensorsWriter(tmp_path / "o", _specs(ts)) as w:
        for k, v in ts.items():
            w.add(k, v)
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["model.safetensors"]


def test_stem_names_the_weight_files(tmp_path):
    """diffusers names its weights diffusion_pytorch_model[-0000i-of-0000n].safetensors (+ its index)."""
    ts = _tensors()
    for out, limit in ((tmp_path / "one", 2**30), (tmp_path / "two", 8 * 1024)):
        with ShardedSafetensorsWriter(out, _specs(ts), max_shard_bytes=limit, stem="diffusion_pytorch_model") as w:
            for k, v in ts.items():
                w.add(k, v)
        assert set(SafetensorsReader(out).keys()) == set(ts)
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == ["diffusion_pytorch_model.safetensors"]
    two = sorted(p.name for p in (tmp_path / "two").iterdir())
    assert "diffusion_pytorch_model.safetensors.index.json" in two
    assert "diffusion_pytorch_model-00001-of-00002.safetensors" in two


def test_writer_refuses_non_empty_and_aborts_cleanly(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep").write_text("x")
    with pytest.raises(CheckpointError, match="not empty"):
        ShardedSafetensorsWriter(out, {"a": (torch.float32, (1,))})
    with pytest.raises(RuntimeError), ShardedSafetensorsWriter(out, {"a": (torch.float32, (1,))}, force=True):
        raise RuntimeError("boom")
    assert (out / "keep").read_text() == "x" and not list(tmp_path.glob("*.tmp-*"))


def test_reader_plain_files_and_errors(tmp_path):
    save_file({"x": torch.ones(2)}, str(tmp_path / "one.safetensors"))
    save_file({"y": torch.zeros(3)}, str(tmp_path / "two.safetensors"))
    r = SafetensorsReader(tmp_path)
    assert sorted(r.keys()) == ["x", "y"]
    assert torch.equal(SafetensorsReader(tmp_path / "one.safetensors").get("x"), torch.ones(2))
    with pytest.raises(CheckpointError, match="tensor 'z' is missing"):
        r.get("z")
    with pytest.raises(CheckpointError, match="no such"):
        SafetensorsReader(tmp_path / "nope")


def test_rows_stream_in_and_out_in_any_order(tmp_path):
    ts = _tensors()
    f = StreamingSafetensorsFile(tmp_path / "x.safetensors", _specs(ts))
    f.write_rows("a", 40, ts["a"][40:])
    with pytest.raises(CheckpointError, match="never written"):  # 'a' is only partly written
        StreamingSafetensorsFile.close(f)
    f = StreamingSafetensorsFile(tmp_path / "x.safetensors", _specs(ts))
    f.write_rows("a", 40, ts["a"][40:])
    f.write_rows("a", 0, ts["a"][:40])
    with pytest.raises(CheckpointError, match="at row 60"):
        f.write_rows("a", 60, ts["a"][:10])
    for k in ("b", "c", "d", "s"):
        f.write(k, ts[k])
    f.close()
    with SafetensorsReader(tmp_path / "x.safetensors") as r:
        assert all(torch.equal(r.get(k), ts[k]) for k in ts)
        out = torch.empty(5, 64, dtype=torch.float16)
        assert torch.equal(r.read_rows("d", 7, out), ts["d"][7:12])
        with pytest.raises(CheckpointError, match="out of range"):
            r.read_rows("d", 30, out)
