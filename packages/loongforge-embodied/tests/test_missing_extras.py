"""A missing optional dependency of ``loongforge eval`` / ``serve`` is one line naming the extra to install."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from loongforge.cli import main

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "embodied" / "tiny_vla_synthetic.yaml"


@pytest.mark.skipif(importlib.util.find_spec("gym_aloha") is not None, reason="gym-aloha is installed here")
def test_eval_env_aloha_without_its_extra_names_it(tmp_path, capsys):
    code = main(["eval", str(RECIPE), "--env", "aloha", "--policy", "random", "--episodes", "1",
                 "--output", str(tmp_path / "eval")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "gym_aloha" in err and "loongforge-embodied[aloha]" in err and "uv pip install" in err


@pytest.mark.parametrize("command", ["serve", "eval"])
def test_serve_and_eval_without_the_eval_extra_name_it(command, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "websockets", None)  # NOTE: as if the [eval] extra were not installed
    code = main([command, str(RECIPE), "--policy", "random", "--output" if command == "eval" else "--port",
                 str(tmp_path / "eval") if command == "eval" else "0"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"loongforge {command} needs the Python module 'websockets'" in err and "loongforge-embodied[eval]" in err
