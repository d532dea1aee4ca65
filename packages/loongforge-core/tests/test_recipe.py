"""Recipe loading: extends, overrides, defaults, and one-line errors with the key path (exit code 2)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from loongforge.cli import main
from loongforge.errors import RecipeError
from loongforge.recipe import dump_recipe, load_recipe

BASE = """\
description: toy base
backend: toy
model: {width: 4}
data: {samples: 8}
train: {steps: 3, lr: 0.1, global_batch_size: 4}
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def run_cli(args, capsys) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_extends_and_overrides(tmp_path, toy_backend):
    write(tmp_path, "base.yaml", BASE)
    child = write(tmp_path, "child.yaml", "extends: base.yaml\nmodel: {kind: linear}\ntrain: {steps: 5}\n")
    r = load_recipe(child, ["train.lr=0.5", "parallel.tp=1", "checkpoint.save_format=[dist,hf]", "accelerator=cpu"])
    assert r.model.width == 4 and r.model.kind == "linear"
    assert r.train.steps == 5 and r.train.lr == 0.5 and r.train.global_batch_size == 4
    assert r.checkpoint.save_format == ["dist", "hf"]
    assert r.accelerator.name == "cpu"
    assert "micro_batch_size: 1" in dump_recipe(r)  # defaults are resolved


def test_validate_show_prints_defaults(tmp_path, toy_backend, capsys):
    p = write(tmp_path, "r.yaml", BASE)
    code, out, _ = run_cli(["validate", p, "--show"], capsys)
    assert code == 0
    for line in ("backend: toy", "warmup_steps: 0", "lr_schedule: cosine", "name: auto", "width: 4"):
        assert line in out


@pytest.mark.parametrize(
    ("text", "override", "expect"),
    [
        ("backend: toy\nmodel: {width: [1\n", None, "invalid YAML at line"),
        (BASE + "trian: {steps: 3}\n", None, "key 'trian': unknown section (did you mean 'train'?)"),
        (BASE, "train.setps=4", "key 'train.setps': unknown key (did you mean 'steps'?)"),
        (BASE, "model.widht=4", "key 'model.widht': unknown key (did you mean 'width'?)"),
        (BASE, "train.steps=many", "key 'train.steps': Input should be a valid integer"),
        (BASE, "train.lr=-1", "key 'train.lr': Input should be greater than 0"),
        (BASE, "model.kind=conv", "key 'model.kind': Input should be 'mlp' or 'linear'"),
        (BASE.replace("backend: toy", "backend: tyo"), None, "key 'backend': unknown backend 'tyo' (did you mean 'toy'?)"),
        (BASE.replace("backend: toy", "backend: megatron"), None, "pip install ./packages/loongforge-megatron"),
        (BASE, "accelerator=kunlun", "key 'accelerator.name': 'kunlun' is not installed: pip install ./packages/loongforge-xpu"),
        (BASE, "accelerator.name=cdua", "unknown value 'cdua' (did you mean 'cuda'?)"),
        (BASE, "parallel.tp=3", "tp*pp*cp = 3*1*1 = 3 does not divide world size 2"),
        ("extends: missing.yaml\n" + BASE, None, "key 'extends': extended recipe 'missing.yaml' not found"),
        (BASE, "train.micro_batch_size=3", "global_batch_size (4) must be a multiple of micro_batch_size (3)"),
    ],
)
def test_errors_are_one_line_exit_2(tmp_path, toy_backend, capsys, text, override, expect, monkeypatch):
    from loongforge import registry

    # simulate a core-only install for the install hints
    monkeypatch.delitem(registry.backends._scan(), "megatron", raising=False)
    monkeypatch.delitem(registry.accelerators._scan(), "kunlun", raising=False)
    p = write(tmp_path, "bad.yaml", text)
    args = ["validate", p] + ([override] if override else []) + ["--world-size", "2"]
    code, out, err = run_cli(args, capsys)
    assert code == 2, (out, err)
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert expect in err, err
    assert "Traceback" not in err


def test_extends_cycle(tmp_path, toy_backend):
    write(tmp_path, "a.yaml", "extends: b.yaml\n" + BASE)
    write(tmp_path, "b.yaml", "extends: a.yaml\n")
    with pytest.raises(RecipeError, match="extends cycle"):
        load_recipe(tmp_path / "a.yaml")


def test_bad_override_syntax(tmp_path, toy_backend):
    p = write(tmp_path, "r.yaml", BASE)
    with pytest.raises(RecipeError, match="not of the form a.b.c=value"):
        load_recipe(p, ["train.steps"])


def test_no_traceback_in_a_real_process(tmp_path):
    p = write(tmp_path, "bad.yaml", "backend: toy\ntrain: {steps: 0}\n")
    proc = subprocess.run([sys.executable, "-m", "loongforge", "validate", str(p)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1


def test_a_key_given_twice_is_an_error(tmp_path):
    p = tmp_path / "dup.yaml"
    p.write_text("backend: toy\ntrain: {steps: 3}\ntrain: {steps: 5}\n")
    with pytest.raises(RecipeError, match="line 3, column 1: key 'train' appears twice"):
        load_recipe(p, backend_schemas=False)



def test_yaml_merge_keys_still_work(tmp_path):
    p = tmp_path / "merge.yaml"
    p.write_text("backend: toy\n_t: &t {steps: 3, lr: 0.01}\ntrain:\n  <<: *t\n  steps: 5\n")
    from loongforge.recipe.loader import read_yaml

    assert read_yaml(p)["train"] == {"steps": 5, "lr": 0.01}


@pytest.mark.parametrize("stage", ["pretrain", "cpt", "sft"])
def test_lora_settings_need_the_lora_stage(tmp_path, toy_backend, capsys, stage):
    """``train.lora`` under another stage was ignored silently (the whole model trained): one line naming the file
    that sets it, the key and the fix; the same settings with ``stage: lora`` load, and a child recipe that changes
    the stage of a LoRA parent is told which file holds the section."""
    p = write(tmp_path, "r.yaml", BASE)
    code, _, err = run_cli(["validate", p, f"train.stage={stage}", "train.lora.rank=4"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert f"{p}: key 'train.lora': LoRA adapters are trained by train.stage lora only (got stage '{stage}')" in err
    assert "set train.stage lora" in err
    assert load_recipe(p, ["train.stage=lora", "train.lora.rank=4"]).train.lora.rank == 4
    parent = write(tmp_path, "lora.yaml", BASE.replace("train: {", "train: {stage: lora, lora: {rank: 4}, "))
    child = write(tmp_path, "child.yaml", f"extends: lora.yaml\ntrain: {{stage: {stage}}}\n")
    with pytest.raises(RecipeError) as exc:
        load_recipe(child)
    assert str(exc.value).startswith(f"{parent.resolve()} (extended by {child}): key 'train.lora'"), exc.value
    assert load_recipe(child, ["train.lora=null"]).train.lora is None
