"""Failure contracts of a megatron run, end to end (``python -m loongforge train`` in a subprocess with a timeout):
one rank's broken checkpoint ends every rank with one line naming the file; a truncated latest checkpoint falls back
to the previous one with a warning; a run that goes non-finite stops naming the step and keeps its last finite
checkpoint (or, with ``train.skip_nonfinite``, skips those updates and counts them)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import yaml

pytestmark = pytest.mark.slow

_cache: dict = {}


@pytest.fixture
def base(tmp_path_factory, tiny_hf, recipe, loongforge_cli):
    """A tiny llama and a 2-rank run of 4 steps with a checkpoint every 2 (step 2 and step 4), made once."""
    if not _cache:
        root = tmp_path_factory.mktemp("contracts")
        hf = tiny_hf("llama", root / "hf")
        r = recipe(root / "r.yaml", hf, steps=4, save_interval=2, keep_last=5)
        done = loongforge_cli("train", str(r), "--output", str(root / "base"), "--nproc", "2")
        assert done.returncode == 0, done.stdout[-3000:]
        _cache.update(root=root, hf=hf, recipe=r, run=root / "base")
    return _cache


def _copy_run(base: dict, name: str) -> Path:
    dst = base["root"] / name
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(base["run"], dst)
    return dst


def _with(recipe_path: Path, out: Path, **train) -> Path:
    r = yaml.safe_load(recipe_path.read_text())
    r["train"].update(train)
    path = out.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(r))
    return path


def _error_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("error:")]


def test_one_ranks_broken_files_end_every_rank(base, loongforge_cli):
    """Rank 1's file of step 4 garbled at the same size (only rank 1's read fails) and of step 2 cut in half (the
    sizes recorded at save show it): every rank skips both, then exits 2 with one line naming the files (no hang)."""
    run = _copy_run(base, "broken")
    ckpt = run / "checkpoints"
    f = ckpt / "step_00000004" / "rank_00001.pt"
    raw = bytearray(f.read_bytes())
    raw[-200:] = b"\xff" * 200  # the zip's central directory
    f.write_bytes(bytes(raw))
    f = ckpt / "step_00000002" / "rank_00001.pt"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    r = _with(base["recipe"], run, steps=6)
    done = loongforge_cli("train", str(r), "--output", str(run), "--nproc", "2", timeout_s=150)
    assert done.returncode == 2, done.stdout[-3000:]
    assert "Traceback" not in done.stdout, done.stdout[-3000:]
    lines = _error_lines(done.stdout)
    assert "no readable checkpoint" in lines[0], done.stdout[-3000:]
    assert "step_00000004/rank_00001.pt is unreadable" in lines[0] and "step_00000002/rank_00001.pt has" in lines[0]
    assert lines[1:] == [] or "training failed on one of 2 processes" in lines[1]  # the launcher's summary


def test_truncated_latest_falls_back_to_previous_step(base, loongforge_cli):
    run = _copy_run(base, "fallback")
    f = run / "checkpoints" / "step_00000004" / "rank_00000.pt"
    f.write_bytes(f.read_bytes()[:1000])
    r = _with(base["recipe"], run, steps=6)
    done = loongforge_cli("train", str(r), "--output", str(run), "--nproc", "2", timeout_s=240)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "skipping step_00000004" in done.stdout and "rank_00000.pt" in done.stdout, done.stdout[-3000:]
    assert "resumed from" in done.stdout and "step_00000002" in done.stdout
    steps = [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    assert steps[-4:] == [3, 4, 5, 6]


def _finite(rank_file: Path) -> bool:
    state = torch.load(rank_file, map_location="cpu", weights_only=True)
    return all(bool(torch.isfinite(t).all()) for sd in state["model"] for t in sd.values()
               if isinstance(t, torch.Tensor) and t.is_floating_point())


def test_nan_run_stops_at_first_nonfinite_step_and_keeps_last_finite_checkpoint(base, loongforge_cli):
    run = base["root"] / "nan"
    shutil.rmtree(run, ignore_errors=True)
    r = yaml.safe_load(base["recipe"].read_text())
    r["train"].update(lr=1e6, steps=12, lr_schedule="constant")
    r["checkpoint"].update(save_interval=1, keep_last=1)
    path = base["root"] / "nan.yaml"
    path.write_text(yaml.safe_dump(r))
    done = loongforge_cli("train", str(path), "--output", str(run), "--nproc", "1", timeout_s=240)
    assert done.returncode == 2, done.stdout[-3000:]
    lines = _error_lines(done.stdout)
    assert lines and "not finite" in lines[0], done.stdout[-3000:]
    bad = int(lines[0].split("step ", 1)[1].split(":", 1)[0])
    logged = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    assert [m["step"] for m in logged] == list(range(1, bad)), (bad, logged)
    assert all(math.isfinite(m["loss"]) for m in logged)
    ckpt = run / "checkpoints"
    latest = (ckpt / "latest").read_text().strip()
    assert latest == f"step_{bad - 1:08d}" and f"{latest}" in lines[0]
    assert _finite(ckpt / latest / "rank_00000.pt")
    assert not (run / "hf").exists()


def test_skip_nonfinite_skips_updates_and_counts_them(base, loongforge_cli):
    run = base["root"] / "skip"
    shutil.rmtree(run, ignore_errors=True)
    r = yaml.safe_load(base["recipe"].read_text())
    r["train"].update(lr=1e6, steps=6, lr_schedule="constant", skip_nonfinite=True)
    r["checkpoint"].update(save_interval=None, save_format=["dist", "hf"])
    path = base["root"] / "skip.yaml"
    path.write_text(yaml.safe_dump(r))
    done = loongforge_cli("train", str(path), "--output", str(run), "--nproc", "1", timeout_s=240)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "update skipped" in done.stdout
    last = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()][-1]
    assert last["step"] == 6 and last["skipped_nonfinite"] >= 1
    assert _finite(run / "checkpoints" / "step_00000006" / "rank_00000.pt")
