"""data.balance: packed SFT rows placed over two data-parallel ranks by their cost train to the losses of the
in-order placement (the same global batch each step; the loss is a token sum over the global token count).

NOTE: every megatron job here runs in a rank (``ranks``), never in pytest's own process."""

from __future__ import annotations

import json
import random

import loongforge
import pytest
import yaml

STEPS = 4  # three warm-up steps (default coefficients), then one with the fitted cost model


def _records() -> list[dict]:
    """Answers of lognormal length, so packed rows differ in their attention cost."""
    rng = random.Random(0)
    words = ["one", "two", "three", "four", "five", "six", "seven", "eight"]
    return [{"instruction": f"Say {k} words", "output": " ".join(rng.choice(words) for _ in range(
        max(1, min(60, int(rng.lognormvariate(1.5, 1.2))))))} for k in range(24)]


def _recipe(tmp_path, *, balance: bool) -> str:
    from loongforge_megatron.data.prepare import prepare
    from loongforge_megatron.data.tokenizer import train_bpe

    records = _records()
    if not (tmp_path / "tok").exists():
        train_bpe([json.dumps(r) for r in records] * 10 + ["user assistant system"] * 10, vocab_size=300,
                  out_dir=tmp_path / "tok")
        (tmp_path / "sft.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    data = {"format": "sft", "path": str(tmp_path / "sft"), "seq_length": 128, "tokenizer": str(tmp_path / "tok"),
            "source": {"kind": "jsonl", "paths": [str(tmp_path / "sft.jsonl")]}, "pack": True, "balance": balance}
    recipe = {
        "backend": "megatron",
        "model": {"preset": "llama-tiny"},
        "data": data,
        "parallel": {"dp": 2},
        "train": {"stage": "sft", "steps": STEPS, "global_batch_size": 4, "micro_batch_size": 1,
                  "precision": "fp32", "lr": 1e-3, "seed": 3},
        "checkpoint": {"save_at_end": False},
        "accelerator": "cpu",
        "logging": {"tensorboard": False},
    }
    path = tmp_path / f"balance-{balance}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    if not (tmp_path / "sft").exists():
        prepare(loongforge.load_recipe(str(path)))
    return str(path)


def _train(*, rank, world, recipe_path, run_dir):
    job, _ = loongforge.build_job(loongforge.load_recipe(recipe_path), output_dir=run_dir)
    try:
        return [job.step() for _ in range(STEPS)]
    finally:
        job.close()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The prepared SFT data and the recipes with and without balancing."""
    tmp = tmp_path_factory.mktemp("balance")
    return tmp, {b: _recipe(tmp, balance=b) for b in (False, True)}


def test_balanced_placement_keeps_the_losses(tmp_path, ranks, prepared):
    _, recipes = prepared
    plain = ranks(_train, world=2, out=tmp_path / "plain", recipe_path=recipes[False], run_dir=tmp_path / "run_plain")
    balanced = ranks(_train, world=2, out=tmp_path / "balanced", recipe_path=recipes[True],
                     run_dir=tmp_path / "run_balanced")
    for rank in range(2):
        assert [m["loss"] for m in balanced[rank]] == pytest.approx([m["loss"] for m in plain[rank]], rel=1e-5)
    steps = balanced[0]
    assert all("dp_imbalance_before" not in m for m in plain[0])
    assert all(m["dp_imbalance_after"] <= m["dp_imbalance_before"] + 1e-12 for m in steps)
    assert any(m["dp_imbalance_after"] < m["dp_imbalance_before"] for m in steps)  # samples did move
    fitted = steps[STEPS - 2]  # the fit is made after the warm-up's last step and logged with it
    assert fitted["balance_cost_a"] > 0 or fitted["balance_cost_b"] > 0 or fitted["balance_cost_c"] > 0


class _Rows:
    """Rows of one token each, the row's index as its token; a cost that grows fast with the index."""

    def __len__(self) -> int:
        return 1000

    def __getitem__(self, idx: int):
        import torch

        return {"tokens": torch.tensor([idx]), "labels": torch.tensor([idx]), "loss_mask": torch.ones(1),
                "position_ids": torch.zeros(1, dtype=torch.long)}

    def cost_features(self, idx: int) -> tuple[float, float, float]:
        return float((idx % 16) ** 4), 1.0, 0.0


def test_every_rank_takes_its_share_of_the_same_global_batch():
    """dp 4 ranks × 2 micro-batches × 2 rows: together they read every row of the global batch exactly once, and
    the ranks' costs are more even than in order."""
    import torch
    from loongforge.parallel.balance import LoadBalancer
    from loongforge_megatron.data.datasets import BatchSchedule

    for step in (0, 3):
        seen = []
        for rank in range(4):
            schedule = BatchSchedule(_Rows(), global_batch_size=16, micro_batch_size=2, dp_size=4, dp_rank=rank,
                                     balancer=LoadBalancer())
            batches = schedule.microbatches(step, device=torch.device("cpu"))
            assert len(batches) == 2 and all(b["tokens"].shape == (2, 1) for b in batches)
            seen += [int(t) for b in batches for t in b["tokens"].reshape(-1)]
            before, after = batches[0]["dp_imbalance"]
            assert after < before
        assert sorted(seen) == list(range(step * 16, step * 16 + 16))


def test_row_costs_are_read_from_the_index_as_the_rows_are_made(prepared):
    """A packed row's cost features are the lengths its ``cu_seqlens`` gives attention, without reading its tokens."""
    from loongforge_megatron.data.datasets import PackedSFTDataset

    tmp_path, _ = prepared
    for pack in (True, False):
        ds = PackedSFTDataset(str(tmp_path / "sft"), seq_length=128, pad_id=0, pack=pack)
        for i in range(len(ds)):
            row = ds[i]
            bounds = row["cu_seqlens"].tolist() if pack else [0, 128]
            lengths = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
            assert ds.cost_features(i) == (float(sum(x * x for x in lengths)), 128.0, 0.0)
        assert not pack or len({ds.cost_features(i) for i in range(len(ds))}) > 1


def test_balance_of_data_without_costs_is_refused(capsys):
    from pathlib import Path

    from loongforge.cli import main

    recipe = Path(__file__).resolve().parents[3] / "recipes" / "vlm" / "qwen2_5_vl_tiny.yaml"
    assert main(["validate", str(recipe), "data.balance=true"]) == 2
    err = capsys.readouterr().err
    assert "key 'data.balance'" in err and "format 'synthetic'" in err and err.count("\n") == 1, err
