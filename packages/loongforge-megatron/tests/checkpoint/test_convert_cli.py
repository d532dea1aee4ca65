"""``loongforge convert`` end to end: HF -> megatron (tp=2, pp=2) -> HF is bit-exact; a non-empty destination is
refused without --force with a one-line error and exit code 2."""

from __future__ import annotations

import pytest
import torch
from loongforge.checkpoint import SafetensorsReader
from loongforge.cli import main


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_convert_roundtrip_bit_exact(tmp_path, tiny_hf, family, capsys):
    hf = tiny_hf(family, tmp_path / "hf")
    mg, back = tmp_path / "mg", tmp_path / "back"
    assert main(["convert", str(hf), str(mg), "--to", "megatron", "--tp", "2", "--pp", "2"]) == 0
    assert (mg / "mp_rank_01_001_000" / "model.safetensors").is_file()
    assert main(["convert", str(mg), str(back), "--to", "hf"]) == 0
    a, b = SafetensorsReader(hf), SafetensorsReader(back)
    assert sorted(a.keys()) == sorted(b.keys())
    for name in a.keys():
        x, y = a.get(name), b.get(name)
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert x.contiguous().view(torch.uint8).equal(y.contiguous().view(torch.uint8)), name  # bitwise
    capsys.readouterr()

    # A non-empty destination is refused: one line on stderr, exit 2, nothing changed.
    before = sorted(p.name for p in back.iterdir())
    assert main(["convert", str(mg), str(back), "--to", "hf"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "not empty" in err and "force" in err, err
    assert err.count("\n") == 1, err
    assert sorted(p.name for p in back.iterdir()) == before
    assert main(["convert", str(mg), str(back), "--to", "hf", "--force"]) == 0


def test_convert_bad_source_is_one_line_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["convert", str(tmp_path / "empty"), str(tmp_path / "out"), "--to", "megatron", "--tp", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err


def test_convert_uneven_split_flags(tmp_path, tiny_hf, capsys):
    """--first-stage-layers through the CLI; with --to hf the flags are refused (the layout file decides)."""
    import json

    hf = tiny_hf("llama", tmp_path / "hf", num_hidden_layers=3)
    mg = tmp_path / "mg"
    capsys.readouterr()  # transformers' save progress bar
    assert main(["convert", str(hf), str(mg), "--to", "megatron", "--pp", "2"]) == 2  # 3 layers over 2 stages
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--first-stage-layers" in err, err
    assert main(["convert", str(hf), str(mg), "--to", "megatron", "--pp", "2", "--first-stage-layers", "1"]) == 0
    assert json.loads((mg / "loongforge_layout.json").read_text())["first_stage_layers"] == 1
    capsys.readouterr()  # the conversion's progress lines
    assert main(["convert", str(mg), str(tmp_path / "back"), "--to", "hf", "--first-stage-layers", "1"]) == 2
    err = capsys.readouterr().err
    assert "applies to --to megatron" in err and err.count("\n") == 1, err
    assert main(["convert", str(mg), str(tmp_path / "back"), "--to", "hf"]) == 0
