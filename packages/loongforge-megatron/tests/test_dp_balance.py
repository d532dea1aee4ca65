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


def test_balanced_placement_keeps_the_losses(tmp_path, ranks):
    plain = ranks(_train, world=2, out=tmp_path / "plain", recipe_path=_recipe(tmp_path, balance=False),
                  run_dir=tmp_path / "run_plain")
    balanced = ranks(_train, world=2, out=tmp_path / "balanced", recipe_path=_recipe(tmp_path, balance=True),
                     run_dir=tmp_path / "run_balanced")
    for rank in range(2):
        assert [m["loss"] for m in balanced[rank]] == pytest.approx([m["loss"] for m in plain[rank]], rel=1e-5)
    steps = balanced[0]
    assert all("dp_imbalance_before" not in m for m in plain[0])
    assert all(m["dp_imbalance_after"] <= m["dp_imbalance_before"] + 1e-12 for m in steps)
    assert any(m["dp_imbalance_after"] < m["dp_imbalance_before"] for m in steps)  # samples did move
    fitted = steps[STEPS - 2]  # the fit is made after the warm-up's last step and logged with it
    assert fitted["balance_cost_a"] > 0 or fitted["balance_cost_b"] > 0 or fitted["balance_cost_c"] > 0
