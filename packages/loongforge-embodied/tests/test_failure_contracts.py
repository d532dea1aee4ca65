"""Failure contracts of the embodied backend: a checkpoint never runs code, a non-finite step stops the run (or is
skipped) and non-finite weights are never written, a full disk and a corrupt dataset are one line naming the file,
and a LeRobot dataset is read offline."""

from __future__ import annotations

import errno
import json
import os
import pickle
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "recipes" / "embodied" / "tiny_vla_synthetic.yaml"
FAST = ["train.warmup_steps=0", "data.synthetic_samples=16", "train.global_batch_size=4", "train.micro_batch_size=4",
        "logging.tensorboard=false", "logging.console=false"]


def _job(tmp_path: Path, *over: str):
    from loongforge.api import build_job, load_recipe

    job, _ = build_job(load_recipe(RECIPE, [*FAST, *over]), output_dir=tmp_path)
    return job


def _saved_step(tmp_path: Path) -> Path:
    job = _job(tmp_path, "train.steps=1")
    try:
        job.step()
        return job.save()
    finally:
        job.close()


class _Planted:
    """A pickle that runs a command when loaded (what an attacker would put into ``.metadata``)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_planted_pickle_in_dcp_metadata_is_refused_and_runs_nothing(tmp_path):
    from loongforge.errors import CheckpointError

    step = _saved_step(tmp_path)
    marker = tmp_path / "pwned"
    (step / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
    with pytest.raises(CheckpointError, match=r"\.metadata: refused to load .*os\.system|posix\.system") as err:
        _job(tmp_path, "train.steps=2")
    assert str(step / ".metadata") in str(err.value) and "\n" not in str(err.value)
    assert not marker.exists()


def test_metadata_of_a_real_checkpoint_loads_and_resumes(tmp_path):
    from loongforge_embodied.safe_dcp import read_metadata_file

    step = _saved_step(tmp_path)
    assert read_metadata_file(step / ".metadata").state_dict_metadata
    job = _job(tmp_path, "train.steps=2")
    try:
        assert job.step_index == 1
    finally:
        job.close()


def test_pickled_items_are_refused(tmp_path):
    from loongforge.errors import CheckpointError
    from loongforge_embodied.safe_dcp import TensorOnlyLoadPlanner

    class Item:
        class dest_index:  # noqa: N801 - the shape of DCP's ReadItem
            fqn = "model.x"

    with pytest.raises(CheckpointError, match="'model.x' is stored as a pickled object"):
        TensorOnlyLoadPlanner().load_bytes(Item, None)


@pytest.mark.parametrize("damage", ["truncate", "empty", "garbage"])
def test_corrupt_metadata_is_one_line_naming_it(tmp_path, damage):
    from loongforge.errors import CheckpointError

    step = _saved_step(tmp_path)
    md = step / ".metadata"
    data = md.read_bytes()
    md.write_bytes({"truncate": data[: len(data) // 2], "empty": b"", "garbage": os.urandom(256)}[damage])
    with pytest.raises(CheckpointError, match=r"\.metadata") as err:
        _job(tmp_path, "train.steps=2")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("text", ["{not json", "[]", '{"step": "x", "world_size": 1}', ""])
def test_garbled_trainer_json_names_it(tmp_path, text):
    from loongforge.errors import CheckpointError

    step = _saved_step(tmp_path)
    (step / "trainer.json").write_text(text)
    with pytest.raises(CheckpointError, match="trainer.json"):
        _job(tmp_path, "train.steps=2")


def _strict_json_lines(path: Path) -> list[dict]:
    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def test_nonfinite_step_stops_naming_it_and_keeps_the_last_finite_checkpoint(tmp_path):
    from loongforge.errors import NonFiniteError
    from loongforge_embodied.checkpoint import read_trainer_meta

    job = _job(tmp_path, "train.steps=8", "train.lr=1e6", "train.grad_clip=0", "checkpoint.save_interval=1",
               "checkpoint.keep_last=1", "checkpoint.save_format=[dist,hf]", "logging.interval=1")
    try:
        with pytest.raises(NonFiniteError, match=r"^step (\d+): the loss is .* \(not finite\)") as err:
            job.run()
        bad = int(str(err.value).split()[1].rstrip(":"))
        assert bad >= 2
    finally:
        job.close()
        job.runtime.logger.close()
    latest = (tmp_path / "checkpoints" / "latest").read_text().strip()
    assert read_trainer_meta(tmp_path / "checkpoints" / latest)["step"] == bad - 1
    from loongforge_embodied.safe_dcp import read_metadata_file

    assert read_metadata_file(tmp_path / "checkpoints" / latest / ".metadata").state_dict_metadata
    assert not (tmp_path / "hf").exists()
    records = _strict_json_lines(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, bad))


def test_first_nonfinite_step_is_named_when_steps_between_reports_are_not_read(tmp_path):
    from loongforge.errors import NonFiniteError

    job = _job(tmp_path, "train.steps=9", "train.lr=1e6", "train.grad_clip=0", "logging.interval=8",
               "checkpoint.save_at_end=true")
    try:
        with pytest.raises(NonFiniteError, match=r"^step 2: ") as err:
            job.run()
        assert "the last checkpoint is intact" in str(err.value)
    finally:
        job.close()
        job.runtime.logger.close()
    assert not (tmp_path / "checkpoints").exists() or not list((tmp_path / "checkpoints").glob("step_*"))


def test_skip_nonfinite_skips_the_update_and_counts_it(tmp_path):
    job = _job(tmp_path, "train.steps=4", "train.lr=1e6", "train.grad_clip=0", "train.skip_nonfinite=true",
               "logging.interval=1", "checkpoint.save_at_end=false")
    try:
        job.step()  # NOTE: one huge finite update; the next steps' losses are not finite
        before = [p.detach().clone() for p in job.model.raw.parameters()]
        metrics = job.step()
        assert job.nonfinite.skipped == 1 and metrics["skipped_nonfinite"] == 1
        assert not torch.isfinite(torch.tensor(metrics["loss"]))
        assert all(torch.equal(a, b) for a, b in zip(before, job.model.raw.parameters(), strict=True))
    finally:
        job.close()
        job.runtime.logger.close()
    records = _strict_json_lines(tmp_path / "metrics.jsonl")
    assert records[-1]["loss"] is None and records[-1]["skipped_nonfinite"] == 1


def test_nonfinite_weights_are_never_saved_or_exported(tmp_path):
    from loongforge.errors import NonFiniteError

    job = _job(tmp_path, "train.steps=2")
    try:
        job.step()
        with torch.no_grad():
            next(job.model.raw.parameters()).view(-1)[0] = float("inf")
        with pytest.raises(NonFiniteError, match="checkpoint is not written"):
            job.save()
        with pytest.raises(NonFiniteError, match="policy export is not written"):
            job.export()
    finally:
        job.close()
    assert not list((tmp_path / "checkpoints").glob("step_*")) if (tmp_path / "checkpoints").exists() else True
    assert not (tmp_path / "hf").exists()


def test_disk_full_in_the_dcp_save_is_one_line(tmp_path, monkeypatch, capsys):
    import torch.distributed.checkpoint.filesystem as fs
    from loongforge.cli import main

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fs, "_write_item", full)
    rc = main(["train", str(RECIPE), "--output", str(tmp_path / "run"), *FAST, "train.steps=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2, err
    assert len(err) == 1 and err[0].startswith("error: out of disk space writing checkpoint"), err
    assert str(tmp_path / "run" / "checkpoints" / "step_00000001") in err[0]


def test_negative_chunk_size_is_refused_at_validate():
    from loongforge.errors import RecipeError
    from loongforge.recipe import load_recipe

    with pytest.raises(RecipeError, match="'chunk_size' must be a positive integer, got -4"):
        load_recipe(RECIPE, ["model.arch.chunk_size=-4"])
    for policy in ("groot", "lerobot_pi05"):
        with pytest.raises(RecipeError, match="'image_size' must be a positive integer, got 0"):
            load_recipe(RECIPE, [f"model.policy={policy}", "model.preset=tiny", "model.arch.image_size=0"])


# ---- LeRobot datasets: checked offline, every problem one line naming the file --------------------------------


def make_dataset(root: Path, *, episodes: int = 2, frames: int = 6) -> Path:
    """A tiny LeRobotDataset v3 written by LeRobot itself (random frames)."""
    import numpy as np
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    features = {
        "observation.image": {"dtype": "image", "shape": (16, 16, 3), "names": ["height", "width", "channel"]},
        "observation.state": {"dtype": "float32", "shape": (2,), "names": ["x", "y"]},
        "action": {"dtype": "float32", "shape": (2,), "names": ["x", "y"]},
    }
    ds = LeRobotDataset.create("local/tiny", fps=10, root=root, features=features, use_videos=False)
    rng = np.random.default_rng(0)
    for _ in range(episodes):
        for _ in range(frames):
            ds.add_frame({"observation.image": rng.integers(0, 255, (16, 16, 3), dtype=np.uint8),
                          "observation.state": rng.standard_normal(2).astype(np.float32),
                          "action": rng.standard_normal(2).astype(np.float32), "task": "push"})
        ds.save_episode()
    ds.finalize()
    return root


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("lerobot") / "tiny")


@pytest.fixture
def no_hub(monkeypatch):
    """Any Hugging Face Hub call fails the test."""
    import huggingface_hub
    import lerobot.datasets.dataset_metadata as md
    import lerobot.datasets.lerobot_dataset as ld

    def refuse(*args, **kwargs):
        raise AssertionError("the Hugging Face Hub was contacted")

    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_refs", refuse)
    monkeypatch.setattr(md, "snapshot_download", refuse)
    monkeypatch.setattr(ld, "snapshot_download", refuse)


def _copy(dataset: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(dataset, tmp_path / "ds"))


def _first(root: Path, pattern: str) -> Path:
    return sorted(root.glob(pattern))[0]


DAMAGES = {
    "data parquet missing": ("data/*/*.parquet", "delete"),
    "data parquet truncated": ("data/*/*.parquet", "truncate"),
    "data parquet garbage": ("data/*/*.parquet", "garbage"),
    "episodes parquet missing": ("meta/episodes/*/*.parquet", "delete"),
    "episodes parquet truncated": ("meta/episodes/*/*.parquet", "truncate"),
    "tasks parquet missing": ("meta/tasks.parquet", "delete"),
    "tasks parquet truncated": ("meta/tasks.parquet", "truncate"),
    "stats missing": ("meta/stats.json", "delete"),
    "stats truncated": ("meta/stats.json", "truncate"),
    "info truncated": ("meta/info.json", "truncate"),
    "info garbage": ("meta/info.json", "garbage"),
}


def damage(root: Path, pattern: str, how: str) -> Path:
    path = _first(root, pattern)
    if how == "delete":
        path.unlink()
    elif how == "truncate":
        path.write_bytes(path.read_bytes()[: max(1, path.stat().st_size // 2)])
    else:
        path.write_bytes(os.urandom(200))
    return path


@pytest.mark.parametrize("case", sorted(DAMAGES))
def test_damaged_lerobot_dataset_is_one_line_naming_the_file_offline(dataset, tmp_path, no_hub, case):
    from loongforge.errors import LoongForgeError
    from loongforge.recipe import load_recipe
    from loongforge_embodied.data.dataset import LeRobotSource
    from loongforge_embodied.policies import resolve_arch

    root = _copy(dataset, tmp_path)
    path = damage(root, *DAMAGES[case])
    pattern = DAMAGES[case][0]
    named = str(path) if "*" not in pattern or DAMAGES[case][1] != "delete" else str(path.parents[1])
    with pytest.raises(LoongForgeError) as err:
        recipe = load_recipe(RECIPE, ["data.format=lerobot", f"data.root={root}"])
        LeRobotSource(root=str(root), repo_id="local/tiny", arch=resolve_arch(recipe.model, recipe.data), cameras=None)
    assert named in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_intact_lerobot_dataset_opens_offline(dataset, tmp_path, no_hub):
    from loongforge.recipe import load_recipe
    from loongforge_embodied.data.dataset import LeRobotSource
    from loongforge_embodied.policies import resolve_arch

    root = _copy(dataset, tmp_path)
    recipe = load_recipe(RECIPE, ["data.format=lerobot", f"data.root={root}"])
    src = LeRobotSource(root=str(root), repo_id="local/tiny", arch=resolve_arch(recipe.model, recipe.data), cameras=None)
    assert len(src) == 12 and src[0]["actions"].shape == (8, 2)
