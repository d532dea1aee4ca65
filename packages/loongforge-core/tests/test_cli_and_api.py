"""CLI commands and the public Python API on the toy backend (in process)."""

from __future__ import annotations

import json
from pathlib import Path

import loongforge
import pytest
from loongforge.cli import main
from loongforge.errors import LoongForgeError
from loongforge.metrics import read_metrics


def test_train_writes_run_directory_contract(tmp_path, toy_backend, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("backend: toy\ntrain: {steps: 4, lr: 0.1, global_batch_size: 2}\naccelerator: cpu\n")
    out = tmp_path / "run"
    assert main(["train", str(recipe), "train.steps=6", "--output", str(out)]) == 0
    assert (out / "recipe.yaml").is_file()
    assert "steps: 6" in (out / "recipe.yaml").read_text()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert all("loss" in r for r in records)
    assert records[-1]["loss"] < records[0]["loss"]
    assert any((out / "tensorboard").iterdir())
    err = capsys.readouterr().err
    assert "step 6/6" in err and "loss" in err and "ETA" in err
    assert main(["plot", str(out)]) == 0
    assert (out / "plot.png").stat().st_size > 1000
    assert len(read_metrics(out)) == 6


def test_public_api_step_by_step(tmp_path, toy_backend):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("backend: toy\ntrain: {steps: 3, lr: 0.1, global_batch_size: 2}\naccelerator: cpu\n")
    r = loongforge.load_recipe(recipe, ["train.lr=0.2"])
    job, runtime = loongforge.build_job(r, output_dir=tmp_path / "nb")
    losses = [job.step()["loss"] for _ in range(3)]
    assert losses[0] > losses[1] > losses[2]
    assert runtime.plan.dp == 1 and runtime.accelerator.name == "cpu"
    job.close()


def test_plugins_lists_builtin_accelerators(capsys):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "cpu          loongforge-core" in out
    groups = [line for line in out.splitlines() if line.startswith("loongforge.")]
    assert groups == [
        "loongforge.backends", "loongforge.accelerators", "loongforge.kernels", "loongforge.commands",
        "loongforge.megatron.models",
    ]
    assert "place-experts loongforge-megatron" in out  # a backend's command, from its entry point


def test_a_plugin_command_is_loaded_only_when_asked_for(tmp_path):
    """``loongforge validate`` imports no command module; ``loongforge place-experts`` imports only its own."""
    import subprocess
    import sys

    probe = ("import sys; from loongforge.cli import main; main(sys.argv[1:]); "
             "print('LOADED', 'loongforge_megatron.commands' in sys.modules)")
    recipe = Path(__file__).resolve().parents[3] / "recipes" / "quickstart" / "llama_stdlib.yaml"
    got = subprocess.run([sys.executable, "-c", probe, "validate", str(recipe)], capture_output=True, text=True)
    assert "LOADED False" in got.stdout, got.stderr[-2000:]
    got = subprocess.run([sys.executable, "-c", probe, "place-experts", "--help"], capture_output=True, text=True)
    assert "--loads" in got.stdout, got.stderr[-2000:]


def test_launcher_builds_torchrun_command(tmp_path):
    from loongforge.launcher import LaunchConfig, torchrun_command

    cmd = torchrun_command(LaunchConfig(nproc=2, max_restarts=3), recipe_file=tmp_path / "r.yaml", output_dir=tmp_path)
    assert cmd[1:3] == ["-m", "loongforge.launcher"]  # torchrun's run() on torchrun's own argument parser
    assert "--nproc-per-node=2" in cmd and "--rdzv-backend=loongforge-loopback" in cmd and "--max-restarts=3" in cmd
    from torch.distributed.run import parse_args

    parsed = parse_args(cmd[3:])  # NOTE: the arguments are torchrun's, as PyTorch users know them
    assert (parsed.nproc_per_node, parsed.max_restarts, parsed.module) == ("2", 3, True)
    for bad in (LaunchConfig(nproc=0), LaunchConfig(nproc=2, max_restarts=-1)):
        with pytest.raises(LoongForgeError, match="--nproc must be|--max-restarts must be"):
            torchrun_command(bad, recipe_file=tmp_path / "r.yaml", output_dir=tmp_path)
    cmd = torchrun_command(LaunchConfig(nproc=8, nnodes="2", node_rank=1, rdzv_endpoint="h:29400"),
                           recipe_file=tmp_path / "r.yaml", output_dir=tmp_path)
    assert "--rdzv-endpoint=h:29400" in cmd and "--node-rank=1" in cmd and "--standalone" not in cmd


def test_metrics_reader_survives_a_partial_last_line_and_names_a_corrupt_one(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]  # a run killed mid-write
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\ngarbage\n{"step": 3, "loss": 1.0}\n')
    assert main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "metrics.jsonl:2: not a metrics record" in err and err.count("\n") == 1


def test_convert_names_a_missing_or_unconvertible_source(tmp_path, capsys):
    assert main(["convert", str(tmp_path / "nope"), str(tmp_path / "out"), "--to", "megatron", "--tp", "2"]) == 2
    assert "does not exist" in capsys.readouterr().err
    ckpt = tmp_path / "checkpoints" / "step_00000002"
    ckpt.mkdir(parents=True)
    (ckpt / "rank_00000.pt").write_bytes(b"")
    assert main(["convert", str(ckpt), str(tmp_path / "out"), "--to", "hf"]) == 2
    assert "is a training checkpoint" in capsys.readouterr().err


def test_launcher_names_a_rank_killed_by_a_signal(tmp_path, capfd):
    """A worker killed by a signal (OOM killer, segfault) prints nothing itself: the launcher names it (exit
    128+signal); ranks torchrun stops after another rank's own failure are not reported as causes."""
    from loongforge.launcher import _torchrun

    script = tmp_path / "w.py"
    script.write_text("import os, signal, sys\nif os.environ['RANK'] == '1':\n    os.kill(os.getpid(), signal.SIGKILL)\n")
    assert _torchrun(["--standalone", "--nproc-per-node=2", "--monitor-interval=0.1", str(script)]) == 137
    err = capfd.readouterr().err
    assert "rank 1 (pid" in err and "killed by SIGKILL" in err, err
    script.write_text("import os, sys, time\nif os.environ['RANK'] == '0':\n    sys.exit(2)\ntime.sleep(30)\n")
    assert _torchrun(["--standalone", "--nproc-per-node=2", "--monitor-interval=0.1", str(script)]) == 2
    assert "killed by" not in capfd.readouterr().err
