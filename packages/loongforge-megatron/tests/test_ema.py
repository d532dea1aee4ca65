"""``train.ema_decay`` on the megatron backend: the average follows every optimizer step, resumes exactly, and is
what the HF export writes (one process, tiny Llama, fp32, CPU).

NOTE: every megatron job here runs in a rank (``ranks``), never in pytest's own process."""

from __future__ import annotations

from pathlib import Path

import loongforge
import torch

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "llm" / "tiny" / "llama_tiny.yaml"
DECAY = 0.6


def _job(out: Path, *over: str):
    recipe = loongforge.load_recipe(RECIPE, [f"train.ema_decay={DECAY}", "accelerator=cpu", "logging.console=false",
                                             *over])
    return loongforge.build_job(recipe, output_dir=out)


def _weights(job) -> dict[str, torch.Tensor]:

    return {n: p.detach().float().clone() for n, p in job.chunks[0].named_parameters()}


def _average_follows_each_step(*, rank, world, run_dir):
    job, runtime = _job(run_dir, "train.steps=3", "checkpoint.save_at_end=true", "checkpoint.save_format=[hf]")
    try:
        expected = _weights(job)
        for _ in range(3):
            job.step()
            for name, value in _weights(job).items():
                expected[name] = DECAY * expected[name] + (1 - DECAY) * value
        trained = _weights(job)
        shadow = job.ema.state_dict()[0]
        assert set(shadow) == set(expected)
        for name, value in expected.items():
            torch.testing.assert_close(shadow[name], value, rtol=1e-6, atol=1e-7)
        job.checkpointer.save(job.step_index, final=True)
        assert all(torch.equal(trained[n], v) for n, v in _weights(job).items())  # export put the trained ones back
    finally:
        job.close()
        runtime.logger.close()
    return expected, trained


def test_average_follows_each_step_and_is_exported(tmp_path, ranks):
    from safetensors.torch import load_file

    expected, trained = ranks(_average_follows_each_step, world=1, out=tmp_path / "ranks", run_dir=tmp_path / "run")[0]
    hf = {}
    for f in (tmp_path / "run" / "hf").glob("*.safetensors"):
        hf.update(load_file(f))
    torch.testing.assert_close(hf["model.norm.weight"], expected["decoder.final_layernorm.weight"])
    torch.testing.assert_close(hf["model.layers.0.mlp.down_proj.weight"],
                               expected["decoder.layers.0.mlp.linear_fc2.weight"])
    assert not torch.equal(hf["model.norm.weight"], trained["decoder.final_layernorm.weight"])


def _resume_restores_the_average(*, rank, world, tmp_path):
    whole, runtime = _job(tmp_path / "whole", "train.steps=4")
    try:
        whole.run()
        ref = {n: v.clone() for n, v in whole.ema.state_dict()[0].items()}
    finally:
        whole.close()
        runtime.logger.close()
    first, runtime = _job(tmp_path / "split", "train.steps=2", "checkpoint.save_at_end=true")
    try:
        first.run()
    finally:
        first.close()
        runtime.logger.close()
    second, runtime = _job(tmp_path / "split", "train.steps=4")
    try:
        assert second.step_index == 2
        second.run()
        for name, value in second.ema.state_dict()[0].items():
            assert torch.equal(value, ref[name]), name
    finally:
        second.close()
        runtime.logger.close()


def test_resume_restores_the_average(tmp_path, ranks):
    ranks(_resume_restores_the_average, world=1, out=tmp_path / "ranks", tmp_path=tmp_path)


def test_megatron_accepts_ema_decay(capsys):
    from loongforge.cli import main

    assert main(["validate", str(RECIPE), "train.ema_decay=0.999"]) == 0, capsys.readouterr().err


def _turning_ema_on_at_resume(*, rank, world, tmp_path):
    recipe = loongforge.load_recipe(RECIPE, ["train.steps=2", "accelerator=cpu", "logging.console=false",
                                             "checkpoint.save_at_end=true"])
    first, runtime = loongforge.build_job(recipe, output_dir=tmp_path / "run")
    try:
        first.run()
        saved = _weights(first)
    finally:
        first.close()
        runtime.logger.close()
    second, runtime = _job(tmp_path / "run", "train.steps=3")
    try:
        assert second.step_index == 2
        for name, value in second.ema.state_dict()[0].items():
            assert torch.equal(value, saved[name]), name
    finally:
        second.close()
        runtime.logger.close()


def test_turning_ema_on_at_resume_starts_from_the_resumed_weights(tmp_path, ranks):
    """A run saved without EMA, resumed with ``train.ema_decay``: the average starts at the resumed weights (not
    at the fresh initialisation the job was built with before the load)."""
    ranks(_turning_ema_on_at_resume, world=1, out=tmp_path / "ranks", tmp_path=tmp_path)


def _interval_exports(*, rank, world, run_dir):
    job, runtime = _job(run_dir, "train.steps=6", "checkpoint.save_interval=2", "checkpoint.keep_last=1",
                        "checkpoint.save_format=[dist,hf]", "checkpoint.save_at_end=false")
    try:
        job.run()
    finally:
        job.close()
        runtime.logger.close()


def test_interval_exports_follow_keep_last(tmp_path, ranks):
    """``checkpoint.keep_last`` prunes the interval HF exports (``checkpoints/hf_step_*``) like the checkpoints."""
    ranks(_interval_exports, world=1, out=tmp_path / "ranks", run_dir=tmp_path / "run")
    root = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in root.glob("hf_step_*")) == ["hf_step_00000004"]
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000004"]
