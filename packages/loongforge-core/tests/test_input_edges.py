"""Bad input at the edges of the CLI, loader and launcher is one line naming what is wrong (exit 2, or a failed
worker's own code), leaves nothing behind, and a signal to ``loongforge train`` stops the whole launched tree."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from loongforge.cli import main
from loongforge.errors import LaunchError, RecipeError
from loongforge.recipe import load_recipe

TOY = "backend: toy\ntrain: {steps: 2, lr: 0.1, global_batch_size: 2}\naccelerator: cpu\n"


def _recipe(tmp_path: Path, text: str = TOY, name: str = "r.yaml") -> Path:
    path = tmp_path / name
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return path


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.mark.parametrize(("args", "message"), [
    (["--nproc", "2", "--nnodes", "abc"], "--nnodes must be a number of nodes (>= 1) or MIN:MAX"),
    (["--nproc", "2", "--nnodes", "0"], "--nnodes must be"),
    (["--nproc", "2", "--nnodes", "3:2"], "--nnodes must be"),
    (["--nproc", "0"], "--nproc must be at least 1 (got 0)"),
])
def test_launch_arguments_are_checked_before_anything_is_written(tmp_path, toy_backend, capsys, args, message):
    out = tmp_path / "run"
    assert main(["train", str(_recipe(tmp_path)), "--output", str(out), *args]) == 2
    assert message in _error(capsys)
    assert not out.exists()  # NOTE: no orphan recipe.launch.yaml


def test_validate_refuses_world_size_zero(tmp_path, toy_backend, capsys):
    assert main(["validate", str(_recipe(tmp_path)), "--world-size", "0"]) == 2
    assert "--world-size must be at least 1 (got 0)" in _error(capsys)


def test_an_unusable_output_is_named(tmp_path, toy_backend, capsys):
    a_file = tmp_path / "afile"
    a_file.write_text("x")
    for out, what in ((a_file, "is a file"), (a_file / "sub", "cannot be created")):
        assert main(["train", str(_recipe(tmp_path)), "--output", str(out)]) == 2
        line = _error(capsys)
        assert f"--output '{out}' {what}" in line, line
    assert a_file.read_text() == "x"
    (tmp_path / "run").mkdir()
    assert main(["train", str(_recipe(tmp_path)), "--output", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    assert main(["plot", str(tmp_path / "run"), "--output", str(a_file / "plot.png")]) == 2
    assert "cannot write the plot" in _error(capsys)


@pytest.mark.parametrize(("text", "message"), [
    (TOY + "1: foo\n", "section names are strings; 1 is a int"),
    (TOY + "on: x\n", "section names are strings; True is a bool"),
    (b"\xff\xfebackend: toy\n", "not UTF-8 text (byte 0)"),
])
def test_odd_recipe_files_are_one_line_errors(tmp_path, toy_backend, text, message):
    path = _recipe(tmp_path, text)
    with pytest.raises(RecipeError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        load_recipe(path)
    assert str(path) in str(e.value)


def test_a_blank_accelerator_env_value_is_refused(tmp_path, toy_backend):
    with pytest.raises(RecipeError, match="NCCL_DEBUG has no value") as e:
        load_recipe(_recipe(tmp_path, TOY.replace("accelerator: cpu", "accelerator: {name: cpu, env: {NCCL_DEBUG: }}")))
    assert "accelerator.env" in str(e.value)
    r = load_recipe(_recipe(tmp_path, TOY.replace("accelerator: cpu", "accelerator: {name: cpu, env: {X: '', Y: 1}}")))
    assert r.accelerator.env == {"X": "", "Y": "1"}


def test_a_resumed_run_does_not_append_after_a_partial_metrics_line(tmp_path, toy_backend):
    """A crash mid-write leaves a partial last line; the resumed run cuts it off instead of gluing its first
    record onto it (which made the file unreadable for ``loongforge plot``)."""
    from loongforge.metrics import MetricsLogger, read_metrics

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n" + '{"step": 2, "lo')
    logger = MetricsLogger(run, config=None)
    logger.log(2, {"loss": 0.5})
    logger.close()
    assert [r["step"] for r in read_metrics(run)] == [1, 2]
    assert (run / "metrics.jsonl").read_text().count("\n") == 2


def test_a_failed_sharded_commit_leaves_no_staging_dir(tmp_path):
    from loongforge.checkpoint.safetensors_io import ShardedSafetensorsWriter

    out = tmp_path / "out"
    with pytest.raises(Exception, match="never written"):
        with ShardedSafetensorsWriter(out, {"a": (torch.float32, (2,)), "b": (torch.float32, (3,))}) as w:
            w.add("a", torch.ones(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_failed_launch_exits_with_the_workers_code(tmp_path, toy_backend, monkeypatch, capsys):
    """A rank killed by the OOM killer (137) is not reported as a user error (2): a scheduler can tell them apart."""
    from loongforge import api

    monkeypatch.setattr(api, "launch", lambda config, **kw: 137)
    assert main(["train", str(_recipe(tmp_path)), "--output", str(tmp_path / "run"), "--nproc", "2"]) == 137
    assert "training failed on one of 2 processes (exit code 137)" in _error(capsys)
    assert issubclass(LaunchError, Exception)


CHILD = """
import os, signal, sys, time
out = sys.argv[1]
def stop(signum, frame):
    with open(out + ".stopping", "w") as f:  # NOTE: whole, then renamed: the test never reads a half-written file
        f.write(signal.Signals(signum).name)
    os.replace(out + ".stopping", out + ".stopped")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
open(out + ".pid", "w").write(str(os.getpid()))
time.sleep(60)
"""

PARENT = """
import sys
from pathlib import Path
from loongforge import launcher
child, out = sys.argv[1], sys.argv[2]
launcher.torchrun_command = lambda config, **kw: [sys.executable, child, out]
sys.exit(launcher.launch(launcher.LaunchConfig(nproc=2), recipe_file=Path("r"), output_dir=Path("o")))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="signals and PR_SET_PDEATHSIG: Linux")
@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "SIGKILL"])
def test_a_signal_to_the_cli_stops_the_launcher(tmp_path, how):
    """SIGTERM / SIGINT sent to ``loongforge train`` (a scheduler's cancel) reach the launcher, which runs in its
    own session; even SIGKILL of the CLI stops it (PR_SET_PDEATHSIG). Before, SIGTERM orphaned torchrun and its
    workers, and SIGINT had ``subprocess.run`` SIGKILL torchrun with the workers still running."""
    child, out = tmp_path / "child.py", tmp_path / "launcher"
    child.write_text(CHILD)
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(child), str(out)],
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    pid_file = Path(f"{out}.pid")
    deadline = time.time() + 60
    while not pid_file.is_file() and time.time() < deadline:
        time.sleep(0.05)
    assert pid_file.is_file(), "the launcher never started"
    time.sleep(0.2)
    parent.send_signal(getattr(signal, how))
    parent.wait(timeout=30)
    deadline = time.time() + 30
    while not Path(f"{out}.stopped").is_file() and time.time() < deadline:
        time.sleep(0.05)
    assert Path(f"{out}.stopped").read_text() == ("SIGTERM" if how == "SIGKILL" else how)
    if how != "SIGKILL":
        assert parent.returncode == 0  # NOTE: the launcher's own exit code once it stopped cleanly


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="signals: Linux")
def test_a_stopped_launcher_ends_with_one_line_and_the_signal_code(tmp_path):
    """torchrun raises ``SignalException`` when it is stopped; ours stops the workers, says so in one line and exits
    128 + the signal (no traceback)."""
    script = tmp_path / "worker.py"
    script.write_text("import time\nopen(__file__ + '.up', 'w').write('1')\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-m", "loongforge.launcher", "--standalone", "--nproc-per-node=1",
                             "--monitor-interval=0.1", str(script)], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 60
    while not Path(f"{script}.up").is_file() and time.time() < deadline:
        time.sleep(0.05)
    assert Path(f"{script}.up").is_file(), "the worker never started"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "Traceback" not in err and "error: training stopped by SIGTERM" in err, err[-2000:]


def test_an_error_in_an_extended_recipe_names_that_file(tmp_path, toy_backend):
    """A bad key inherited through ``extends:`` is reported in the file that sets it (where the fix goes); a key
    the child sets, or an override, still names the child."""
    parent = _recipe(tmp_path, TOY.replace("steps: 2", "stpes: 2"), name="_parent.yaml")
    child = _recipe(tmp_path, "extends: _parent.yaml\nmodel: {width: 4}\n", name="child.yaml")
    with pytest.raises(RecipeError) as e:
        load_recipe(child)
    assert e.value.key == "train.stpes" and str(e.value).startswith(f"{parent} (extended by {child}): key 'train.stpes'")
    _recipe(tmp_path, TOY, name="_parent.yaml")
    bad_child = _recipe(tmp_path, "extends: _parent.yaml\nmodel: {width: 0}\n", name="child.yaml")
    with pytest.raises(RecipeError) as e:
        load_recipe(bad_child)
    assert e.value.file == str(bad_child) and e.value.key == "model.width"


def test_default_run_directories_never_collide(tmp_path, monkeypatch):
    """Runs started in the same second get their own directories (LeRobot refuses an existing output dir; we
    number them), each claimed by an exclusive mkdir; a 'runs' that is a file is left to the output check."""
    import time

    from loongforge.api import default_output_dir

    monkeypatch.setattr(time, "strftime", lambda fmt: "20261201-120000")
    dirs = [default_output_dir("recipes/x/quick.yaml", root=tmp_path / "runs") for _ in range(3)]
    assert [d.name for d in dirs] == ["quick-20261201-120000", "quick-20261201-120000-2", "quick-20261201-120000-3"]
    assert all(d.is_dir() for d in dirs)
    (tmp_path / "file").write_text("x")
    assert default_output_dir("quick.yaml", root=tmp_path / "file").parent == tmp_path / "file"


def test_default_run_directory_is_claimed_after_the_checks(tmp_path, toy_backend, capsys, monkeypatch):
    import time

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(time, "strftime", lambda fmt: "20261201-120000")
    recipe = _recipe(tmp_path)
    assert main(["train", str(recipe), "--nproc", "0"]) == 2
    assert not (tmp_path / "runs").exists()  # NOTE: a refused launch claims no directory
    capsys.readouterr()
    assert main(["train", str(recipe)]) == 0 and main(["train", str(recipe)]) == 0
    names = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert names == [f"{recipe.stem}-20261201-120000", f"{recipe.stem}-20261201-120000-2"]
    assert f"run directory: runs/{recipe.stem}-20261201-120000-2" in capsys.readouterr().err
