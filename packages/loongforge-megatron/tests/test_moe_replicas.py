"""In-training expert replicas and the overlapped expert-parallel all-to-all (``model.moe``), CPU gloo fp32.

One launch of 2 ranks trains a tiny Qwen3-MoE (4 experts, EP 2) 5 steps in several configurations: without
replicas, with 1 and 2 replica slots per rank (re-planned every 2 steps from the live loads), with the overlapped
all-to-all, with both; all give the plain run's losses, and the replicas computed tokens. The replica run's checkpoint
(step 4) resumes without replicas and its step 5 has the plain run's loss. A tiny DeepSeek-V3 (a dense first layer,
shared experts computed during megatron's all-to-all) with replicas equals it without. The slot routing and the recipe refusals are checked in one process.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml

STEPS = 5
RTOL = 1e-5


def _recipe(tmp_path, hf_dir, name: str, *, moe: dict | None = None, save: bool = False, accelerator: str = "cpu",
            precision: str = "fp32", model: dict | None = None):
    r = {
        "backend": "megatron",
        "model": {"hf": str(hf_dir), "moe": moe or {}, **(model or {})},
        "data": {"format": "synthetic", "seq_length": 32},
        "train": {"steps": STEPS, "global_batch_size": 4, "micro_batch_size": 2, "precision": precision, "lr": 1e-3,
                  "seed": 7},
        "checkpoint": {"save_at_end": False, **({"save_interval": 2} if save else {})},
        "parallel": {"ep": 2},
        "accelerator": accelerator,
        "kernels": {"moe_grouped_gemm": True},
        "logging": {"tensorboard": False, "console": False},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(r))
    return path


def _run(recipe_path, run_dir, *, steps: int):
    """The job's losses (and what the test checks), and a free port rank 0 picked for the next job's store."""
    import socket

    import loongforge
    import torch.distributed as dist

    job, runtime = loongforge.build_job(loongforge.load_recipe(recipe_path), output_dir=run_dir)
    try:
        start = job.step_index
        metrics = []
        for _ in range(steps):
            metrics.append(job.step())
            every = job.recipe.checkpoint.save_interval
            if every and job.step_index % every == 0 and job.step_index < STEPS:
                job.checkpointer.save(job.step_index)
        keys = list(job.chunks[0].state_dict())
        plans = job.replicas.plans if job.replicas is not None else 0
        port = [None]
        if dist.get_rank() == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port[0] = s.getsockname()[1]
        dist.broadcast_object_list(port, src=0)
        return {"losses": [m["loss"] for m in metrics], "start": start, "keys": keys, "plans": plans,
                "replica_share": [m.get("moe_replica_token_share") for m in metrics],
                "ep_imbalance": [(m.get("moe_ep_imbalance"), m.get("moe_ep_imbalance_replicas")) for m in metrics]}, port[0]
    finally:
        job.close()
        runtime.logger.close()


CONFIGS = {
    "plain": {},
    "k1": {"replica_slots_per_rank": 1, "replica_interval": 2},
    "k2": {"replica_slots_per_rank": 2},
    "overlap": {"overlap_a2a": True},
    "k1_overlap": {"replica_slots_per_rank": 1, "overlap_a2a": True},
}


def _all(*, rank, world, tmp_path, hf, hf_shared=None, accelerator="cpu", precision="fp32", resume=True):
    import os

    # k1 saves at steps 2 and 4; "resumed" goes on from its step 4 without replicas
    kw = dict(accelerator=accelerator, precision=precision)
    runs = [(name, _recipe(tmp_path, hf, name, moe=moe, save=resume and name == "k1", **kw), tmp_path / f"run_{name}",
             STEPS) for name, moe in CONFIGS.items()]
    if resume:
        runs += [("resumed", _recipe(tmp_path, hf, "resumed", **kw), tmp_path / "run_k1", 1)]
    if hf_shared is not None:  # a dense first layer, shared experts computed during megatron's all-to-all
        runs += [("shared_plain", _recipe(tmp_path, hf_shared, "shared_plain", **kw), tmp_path / "run_sp", STEPS),
                 ("shared_k1", _recipe(tmp_path, hf_shared, "shared_k1", moe={"replica_slots_per_rank": 1},
                                       model={"moe_shared_expert_overlap": True}, **kw), tmp_path / "run_sk", STEPS)]
    out = {}
    for name, recipe, run_dir, steps in runs:
        out[name], port = _run(recipe, run_dir, steps=steps)
        # NOTE: a fresh rendezvous store for the next job: a process group made again on the same store can read
        # the last group's address of the peer before the peer writes its new one
        os.environ["MASTER_PORT"] = str(port)
    return out


def _close(a, b):
    return all(abs(x - y) <= RTOL * abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
def test_replicas_and_overlap_train_like_plain_ep2(tmp_path, tiny_hf, ranks):
    hf = tiny_hf("qwen3_moe", tmp_path / "hf")
    got = ranks(_all, world=2, out=tmp_path / "ranks", tmp_path=tmp_path, hf=hf,
                hf_shared=tiny_hf("deepseek_v3", tmp_path / "hf_shared"))
    r0, r1 = got
    plain = r0["plain"]["losses"]
    for name in CONFIGS:
        assert r0[name]["losses"] == r1[name]["losses"], name
        assert _close(r0[name]["losses"], plain), (name, r0[name]["losses"], plain)
    for name in ("k1", "k2", "k1_overlap"):
        shares = r0[name]["replica_share"]
        assert all(s is not None and s > 0 for s in shares), (name, shares)  # tokens really ran on replicas
    assert r0["plain"]["replica_share"] == [None] * STEPS
    # with 2 spare slots every rank can serve every expert: the computed tokens are nearly level (routed: up to 0.2)
    routed, computed = zip(*r0["k2"]["ep_imbalance"], strict=True)
    assert max(computed) < 0.05 and sum(computed) < sum(routed), r0["k2"]["ep_imbalance"]
    assert r0["k1"]["plans"] == 2  # re-planned at steps 2 and 4 from the live loads
    # a checkpoint saved with replicas loads without them and goes on with the same losses
    assert r0["resumed"]["start"] == 4
    assert _close(r0["resumed"]["losses"], plain[4:]), (r0["resumed"]["losses"], plain[4:])
    assert r0["k1"]["keys"] == r0["plain"]["keys"]  # replicas are never in the state dict
    shared = r0["shared_plain"]["losses"]
    assert _close(r0["shared_k1"]["losses"], shared), (r0["shared_k1"]["losses"], shared)
    assert all(s > 0 for s in r0["shared_k1"]["replica_share"])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_replicas_and_overlap_on_two_gpus(tmp_path, tiny_hf, ranks):
    """The same configurations on 2 GPUs (NCCL, bf16 grouped_mm, the overlapped all-to-all on a side stream): the
    plain run's losses to bf16 rounding, replicas used."""
    hf = tiny_hf("qwen3_moe", tmp_path / "hf")
    r0, r1 = ranks(_all, world=2, out=tmp_path / "ranks", timeout_s=600, tmp_path=tmp_path, hf=hf,
                   accelerator="cuda", precision="bf16", resume=False)
    plain = r0["plain"]["losses"]
    for name in CONFIGS:
        assert r0[name]["losses"] == r1[name]["losses"], name
        assert r0[name]["losses"] == pytest.approx(plain, rel=5e-3), (name, r0[name]["losses"], plain)
    for name in ("k1", "k2", "k1_overlap"):
        assert all(s is not None and s > 0 for s in r0[name]["replica_share"]), name


def test_slot_routing_splits_an_experts_tokens_by_share():
    from loongforge_megatron.layers.expert_replicas import SlotRouting

    # 2 ranks x 3 slots (2 home + 1 spare); expert 0 also on rank 1's spare slot with share 0.25
    slot_expert = np.array([[0, 1, 3], [2, 3, 0]])
    slot_share = np.array([[0.75, 1.0, 0.5], [1.0, 0.5, 0.25]])
    routing = SlotRouting.from_plan(slot_expert, slot_share, num_experts=4, device=torch.device("cpu"))
    tokens = 8
    routing_map = torch.zeros(tokens, 4, dtype=torch.bool)
    routing_map[:, 0] = True
    routing_map[::2, 3] = True
    probs = torch.rand(tokens, 4) * routing_map
    slot_probs, slot_map = routing.apply(probs, routing_map)
    assert slot_map.sum(1).tolist() == routing_map.sum(1).tolist()  # every routed pair lands in one slot
    assert slot_map[:, 0].sum() == 6 and slot_map[:, 5].sum() == 2  # expert 0: 3/4 home, 1/4 replica
    assert slot_map[:, 2].sum() == 2 and slot_map[:, 4].sum() == 2  # expert 3: halves
    torch.testing.assert_close(slot_probs.sum(1), probs.sum(1))


REFUSED = [
    (["model.moe.replica_slots_per_rank=3"], "model.moe.replica_slots_per_rank", "allowed 1 .. 2"),
    (["model.moe.replica_interval=0"], "model.moe.replica_interval", "greater than or equal to 1"),
    (["model.moe.replica_slots_per_rank=1", "parallel.ep=1"], "model.moe.replica_slots_per_rank", "parallel.ep is 1"),
    (["model.moe.overlap_a2a=true", "parallel.ep=1"], "model.moe.overlap_a2a", "parallel.ep is 1"),
]


def test_recipe_refuses_impossible_values(tmp_path, tiny_hf, capsys):
    """K too large, an interval <= 0, replicas / overlap without ep > 1: one line each, exit code 2."""
    from loongforge.cli import main

    path = _recipe(tmp_path, tiny_hf("qwen3_moe", tmp_path / "hf"), "r")
    capsys.readouterr()
    for over, key, words in REFUSED:
        assert main(["validate", str(path), *over]) == 2, over
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and key in err and words in err, err
    assert main(["validate", str(path), "model.moe.replica_slots_per_rank=2", "model.moe.overlap_a2a=true"]) == 0
