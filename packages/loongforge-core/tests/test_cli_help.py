"""What ``loongforge --help`` / ``--version`` / ``recipes`` promise: every argument documented with its default,
the shipped names accepted by ``train`` / ``validate``, and a help that imports no heavy library."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
from loongforge.cli import HelpFormatter, build_parser, find_recipe, main

ROOT = Path(__file__).resolve().parents[3]


def _parsers(parser: argparse.ArgumentParser, name: str = "loongforge"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def test_every_argument_has_help_and_shows_its_default():
    parsers = dict(_parsers(build_parser()))
    # NOTE: the installed backends' commands too (the workspace installs them all)
    assert {"loongforge convert", "loongforge place-experts", "loongforge eval", "loongforge serve"} <= set(parsers)
    formatter = HelpFormatter("loongforge")
    for name, parser in parsers.items():
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            what = f"{name} {'/'.join(action.option_strings) or action.dest}"
            assert action.help and action.help != argparse.SUPPRESS, f"{what} has no help"
            d = action.default
            if not (d is None or d is False or d is argparse.SUPPRESS or d == []):
                assert "default" in formatter._get_help_string(action), f"{what} does not show its default {d!r}"
    assert "(default: 8000)" in parsers["loongforge serve"].format_help()
    assert "(default: 50)" in parsers["loongforge eval"].format_help()


def test_version_names_core_its_plugins_and_torch(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("loongforge 0.1.0") and "loongforge-megatron" in out and "torch " in out
    assert len(out.splitlines()) == 1


def test_the_commands_the_core_readme_names_exist(capsys):
    for command in ("convert", "place-experts"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "--backend" in capsys.readouterr().out, command
    readme = (ROOT / "packages" / "loongforge-core" / "README.md").read_text()
    assert "convert SRC DST --to megatron" in readme and "[--backend B]" in readme


def test_recipes_prints_names_that_train_and_validate_accept(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # NOTE: not in the checkout: names resolve against the shipped recipes folder
    monkeypatch.delenv("LOONGFORGE_RECIPES", raising=False)
    assert main(["recipes"]) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert "quickstart/llama_stdlib.yaml" in names and "llm/tiny/llama_tiny.yaml" in names
    for name in names:
        assert Path(find_recipe(name)).is_file(), name
    assert main(["validate", "quickstart/llama_stdlib.yaml"]) == 0
    assert "ok: " in capsys.readouterr().out
    assert main(["validate", "quickstart/no_such.yaml"]) == 2
    assert "file not found" in capsys.readouterr().err


def test_help_imports_no_heavy_library():
    """``loongforge --help`` builds every command's parser without importing torch (it took ~4 s with it)."""
    probe = ("import sys, time; t = time.perf_counter(); from loongforge.cli import main\n"
             "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
             "print('HEAVY', sorted(m for m in ('torch', 'transformers', 'megatron', 'lerobot', 'diffusers') "
             "if m in sys.modules))")
    got = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert "convert" in got.stdout and "eval" in got.stdout, got.stderr[-2000:]
    assert "HEAVY []" in got.stdout, got.stdout[-500:]
