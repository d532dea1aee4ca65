"""Acceptance: every parallel layout of the megatron backend (2 gloo processes, 4 for tp 2 x cp 2 and tp 2 x ep 2, tiny models, fp32, the loongforge
spec: SDPA attention + fused kernels + fused linear cross-entropy) gives the single-process losses over 5 steps.

All runs start from the same weights, a tiny model saved by transformers and loaded online into each layout's
shards, so the online load is exercised at every layout too (random init is layout-invariant as well:
``packages/loongforge-megatron/tests/engine/test_random_init_layouts.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

RECIPES = Path(__file__).resolve().parents[1] / "recipes" / "llm" / "tiny"
REL_TOL = 1e-5  # relative, per step; reduction order differs between layouts

LAYOUTS = {
    "tp2_sp": ("llama", ["parallel.tp=2", "parallel.sp=true"]),
    "pp2_vpp3": ("llama", ["parallel.pp=2", "parallel.vpp=3"]),  # even and interleaved: 6 chunks of 1 layer
    # uneven and interleaved: stage 0 holds 2 layers (1 per chunk), stage 1 holds 4 (2 per chunk)
    "pp2_vpp2_uneven": ("llama", ["parallel.pp=2", "parallel.vpp=2", "parallel.first_stage_layers=2"]),
    "dp2_distopt": ("llama", ["parallel.distributed_optimizer=true", "parallel.dp=2"]),
    # NOTE: 4 processes: a context-parallel group next to a tensor-parallel one (smaller than the world)
    "tp2_cp2": ("llama", ["parallel.tp=2", "parallel.cp=2"]),
    "ep2_moe": ("qwen3_moe", ["parallel.ep=2", "logging.moe_trace=true"]),  # + the per-step routing trace
    # NOTE: 4 processes: experts split over tp 2 too (etp = tp), each rank's tokens gathered unevenly
    "tp2_sp_ep2_moe": ("qwen3_moe", ["parallel.tp=2", "parallel.sp=true", "parallel.ep=2"]),
}
FOUR = {"tp2_cp2", "tp2_sp_ep2_moe"}  # the layouts run on 4 processes
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)


def save_hf(family: str, out: Path) -> Path:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    if family == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**{**TINY, "num_hidden_layers": 6}))  # 6: room for an uneven split
    else:
        model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**TINY, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                                         moe_intermediate_size=32, norm_topk_prob=True))
    model.save_pretrained(out)
    return out


def train(family: str, overrides: list[str], out: Path, nproc: int, hf_dir: Path) -> list[dict]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    recipe = "qwen3_moe_tiny.yaml" if family == "qwen3_moe" else "llama_tiny.yaml"
    cmd = [sys.executable, "-m", "loongforge", "train", str(RECIPES / recipe), "--output", str(out), "--nproc", str(nproc),
           "accelerator=cpu", "kernels.layers=loongforge", f"model={{hf: {hf_dir}}}", f"checkpoint.load={hf_dir}",
           "train.stage=cpt", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    cache: dict[str, tuple[Path, list[dict]]] = {}

    def get(family: str) -> tuple[Path, list[dict]]:
        if family not in cache:
            hf_dir = save_hf(family, tmp_path_factory.mktemp(f"hf-{family}"))
            get.run_dir[family] = tmp_path_factory.mktemp("ref")
            cache[family] = hf_dir, train(family, [], get.run_dir[family], 1, hf_dir)
        return cache[family]

    get.run_dir = {}  # family -> the reference run's output directory
    return get


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(layout, references, tmp_path):
    family, overrides = LAYOUTS[layout]
    hf_dir, ref = references(family)
    got = train(family, overrides, tmp_path / layout, 4 if layout in FOUR else 2, hf_dir)
    assert [r["step"] for r in got] == [r["step"] for r in ref] == [1, 2, 3, 4, 5]
    for a, b in zip(got, ref, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=REL_TOL), (layout, a["step"], a["loss"], b["loss"])
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), (layout, a["step"])
    assert all(r["loss"] == r["loss"] and r["grad_norm"] < 1e6 for r in got)  # finite
    if family == "qwen3_moe":
        check_router_load(got, ref, tmp_path / layout / "moe_imbalance.json")
    if "logging.moe_trace=true" in overrides:
        check_moe_trace(tmp_path / layout)


def check_moe_trace(run_dir: Path) -> None:
    """``moe_trace.jsonl`` holds every step's loads (summed over the EP ranks) and they add up to the run's totals;
    ``loongforge moe simulate`` replays it."""
    from loongforge.cli import main
    from loongforge_megatron.moe.trace import read_trace

    loads, ep = read_trace(run_dir / "moe_trace.jsonl")
    total = json.loads((run_dir / "moe_imbalance.json").read_text())["tokens_per_expert"]
    assert ep == 2 and loads.shape[0] == 5 and loads.sum(0).tolist() == total
    assert main(["moe", "simulate", str(run_dir / "moe_trace.jsonl"), "--ranks-per-node", "1"]) == 0


def check_router_load(got: list[dict], ref: list[dict], summary: Path) -> None:
    """Every routed token is counted once across the 2 EP ranks: per layer, tokens x top-k over the run; the
    per-expert imbalance of the EP run equals the single-process one (same weights, same tokens)."""
    import yaml

    recipe = yaml.safe_load((summary.parent / "recipe.yaml").read_text())
    tokens = recipe["train"]["steps"] * recipe["train"]["global_batch_size"] * recipe["data"]["seq_length"]
    stats = json.loads(summary.read_text())
    assert stats["ep_size"] == 2 and len(stats["tokens_per_expert"]) == TINY["num_hidden_layers"]
    assert (stats["first_step"], stats["last_step"]) == (1, recipe["train"]["steps"])
    assert [sum(row) for row in stats["tokens_per_expert"]] == [tokens * 2] * TINY["num_hidden_layers"]  # top-2
    assert all(v is not None and v >= 0 for v in stats["ep"] + stats["expert"])
    for a, b in zip(got, ref, strict=True):
        assert a["moe_expert_imbalance"] == pytest.approx(b["moe_expert_imbalance"], rel=0.02)  # a near-tie may route one token differently
        assert a["moe_ep_imbalance"] >= 0 and "moe_ep_imbalance" not in b


def test_expert_placement_round_trip(references, tmp_path):
    """``loongforge place-experts`` renumbers experts; the renumbered checkpoint trains one EP2 step with the same loss,
    and its EP ranks carry exactly the loads the original run measured, regrouped by the new order. (The placement is
    planned from skewed loads so that it moves experts: this tiny random model is balanced already.)"""
    from loongforge.cli import main
    from loongforge_megatron.moe_placement import rank_imbalance

    hf_dir, _ = references("qwen3_moe")
    one = ["parallel.ep=2", "train.steps=1", "train.warmup_steps=0"]
    before = train("qwen3_moe", one, tmp_path / "before", 2, hf_dir)
    skewed = tmp_path / "skewed.json"
    skewed.write_text(json.dumps({"tokens_per_expert": [[1000, 900, 10, 20]] * TINY["num_hidden_layers"]}))
    assert main(["place-experts", str(hf_dir), str(tmp_path / "placed"), "--loads", str(skewed), "--ep", "2"]) == 0
    after = train("qwen3_moe", one, tmp_path / "after", 2, tmp_path / "placed")
    assert after[0]["loss"] == pytest.approx(before[0]["loss"], rel=REL_TOL)
    plan = json.loads((tmp_path / "placed" / "expert_placement.json").read_text())["layers"]
    assert all(r["order"] != [0, 1, 2, 3] for r in plan.values())
    measured = json.loads((tmp_path / "before" / "moe_imbalance.json").read_text())["tokens_per_expert"]
    placed = json.loads((tmp_path / "after" / "moe_imbalance.json").read_text())["tokens_per_expert"]
    for k, r in plan.items():
        assert placed[int(k)] == [measured[int(k)][old] for old in r["order"]], k  # same tokens, renumbered experts
    expected = max(rank_imbalance(measured[int(k)], r["order"], ep=2) for k, r in plan.items())
    assert after[0]["moe_ep_imbalance"] == pytest.approx(expected, abs=1e-9)


def test_router_load_survives_resume(references, tmp_path):
    """The per-expert token counts are saved with the checkpoint: a run that resumes from step 3 of 5 writes the
    same ``moe_imbalance.json`` counts (and first step) as 5 steps straight."""
    hf_dir, _ = references("qwen3_moe")
    first = train("qwen3_moe", ["checkpoint.save_interval=3"], tmp_path / "run", 1, hf_dir)  # saves step 3 only
    rerun = train("qwen3_moe", ["checkpoint.save_interval=3"], tmp_path / "run", 1, hf_dir)  # resumes at step 3
    assert [r["step"] for r in rerun] == [1, 2, 3, 4, 5, 4, 5]
    assert [r["loss"] for r in rerun[5:]] == [r["loss"] for r in first[3:5]]  # exact resume
    straight = json.loads((references.run_dir["qwen3_moe"] / "moe_imbalance.json").read_text())
    got = json.loads((tmp_path / "run" / "moe_imbalance.json").read_text())
    assert (got["first_step"], got["last_step"]) == (1, 5)
    assert got["tokens_per_expert"] == straight["tokens_per_expert"]


def test_resume_follows_the_recipes_lr_schedule(references, tmp_path):
    """A run extended on resume (3 steps saved, rerun with 5) takes the recipe's schedule from there: steps 4-5 get
    the learning rates of a 5-step run, not the finished 3-step cosine's minimum (only progress is restored)."""
    hf_dir, ref = references("llama")
    train("llama", ["train.steps=3", "checkpoint.save_at_end=true"], tmp_path / "run", 1, hf_dir)
    resumed = train("llama", [], tmp_path / "run", 1, hf_dir)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5]
    assert [r["lr"] for r in resumed[3:]] == pytest.approx([r["lr"] for r in ref[3:]], rel=1e-12)


def test_resume_into_another_models_run_is_a_clear_error(tmp_path):
    """Resuming a run directory whose checkpoint has other shapes ends in one line, exit 2 (not a state-dict
    traceback)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    base = [sys.executable, "-m", "loongforge", "train", str(RECIPES / "llama_tiny.yaml"), "--output", str(tmp_path)]
    done = subprocess.run([*base, "train.steps=2", "checkpoint.save_at_end=true"], capture_output=True, text=True,
                          timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    bad = subprocess.run([*base, "train.steps=3", "model.ffn_hidden_size=96"], capture_output=True, text=True,
                         timeout=600, env=env)
    last = bad.stderr.strip().splitlines()[-1]
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr[-3000:]
    assert last.startswith("error: ") and "does not match this recipe's model (size mismatch for" in last, last


def test_random_init_does_not_depend_on_tp_with_cpu_init(tmp_path):
    """``model.init_on_cpu`` (megatron's use_cpu_initialization; what every CPU run does): a random init draws each
    tensor-parallel weight whole and splits it, so TP 2 trains the one-process losses from a random init too (on
    a GPU without the knob, megatron draws each TP rank's shard from its own generator)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    losses = {}
    for tp in (1, 2):
        out = tmp_path / f"tp{tp}"
        cmd = [sys.executable, "-m", "loongforge", "train", str(RECIPES / "llama_tiny.yaml"), "--output", str(out),
               "--nproc", str(tp), "accelerator=cpu", f"parallel.tp={tp}", "train.steps=3", "logging.interval=1",
               "model.init_on_cpu=true"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        assert proc.returncode == 0, proc.stderr[-4000:]
        losses[tp] = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses[1]) == 3
    assert losses[2] == pytest.approx(losses[1], rel=REL_TOL), losses
