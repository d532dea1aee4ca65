"""A vocabulary that tensor parallelism does not divide (101 at tp 2: one padded output row): the padded row takes
no probability mass, so the first-step loss is transformers' at tp 1 and tp 2, training at tp 2 follows tp 1 over
5 steps, and the HF export has exactly the real rows (tiny Llama saved by transformers, fp32, CPU, gloo).

NOTE: every megatron job here runs in a rank (``ranks``), never in pytest's own process."""

from __future__ import annotations

import loongforge
import pytest
import yaml

VOCAB = 101  # odd: padded to 102 at tp 2, unpadded at tp 1
STEPS = 5


def _recipe(tmp_path, hf_dir, *, tp: int, layers: str):
    r = {
        "backend": "megatron",
        "model": {"hf": str(hf_dir)},
        "parallel": {"tp": tp},
        "data": {"format": "synthetic", "seq_length": 32},
        "train": {"stage": "cpt", "steps": STEPS, "global_batch_size": 4, "micro_batch_size": 2,
                  "precision": "fp32", "lr": 1e-2, "warmup_steps": 0, "seed": 7},
        "checkpoint": {"load": str(hf_dir), "save_at_end": False, "save_format": ["hf"]},
        "kernels": {"layers": layers},
        "accelerator": "cpu",
        "logging": {"tensorboard": False, "console": False},
    }
    path = tmp_path / f"tp{tp}-{layers}.yaml"
    path.write_text(yaml.safe_dump(r))
    return path


def _next_rendezvous() -> None:
    """Agree on a fresh port for the next job's process group while this one is up (a closed job destroys it)."""
    import os
    import socket

    import torch.distributed as dist

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = [sock.getsockname()[1]]
    dist.broadcast_object_list(port, src=0)
    os.environ["MASTER_PORT"] = str(port[0])


def _train(*, rank, world, recipes, run_dir):
    """Each recipe in turn on this world: (step 1's micro-batches, the losses and grad norms of every step); the
    first recipe's run is exported to HF at the end."""
    import torch

    out = []
    for i, path in enumerate(recipes):
        job, runtime = loongforge.build_job(loongforge.load_recipe(path), output_dir=run_dir / str(i))
        try:
            batches = job.schedule.microbatches(0, device=torch.device("cpu"))
            steps = [job.step() for _ in range(STEPS)]
            if i == 0:
                job.checkpointer.save(job.step_index, final=True)
            _next_rendezvous()
        finally:
            job.close()
            runtime.logger.close()
        out.append((batches, [(s["loss"], s["grad_norm"]) for s in steps]))
    return out


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    import torch
    import transformers as tf

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("hf")
    tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                       tie_word_embeddings=False)).save_pretrained(out)
    return out


def test_odd_vocab_loss_is_transformers_and_tp_invariant(tmp_path, hf_dir, reference_loss, ranks):
    from safetensors.torch import load_file

    # NOTE: one launch of 2 ranks: tp 2 with the fused cross-entropy, tp 2 with megatron's logits path, tp 1 (dp 2)
    recipes = [_recipe(tmp_path, hf_dir, tp=2, layers="loongforge"), _recipe(tmp_path, hf_dir, tp=2, layers="local"),
               _recipe(tmp_path, hf_dir, tp=1, layers="loongforge")]
    runs = ranks(_train, world=2, out=tmp_path / "ranks", recipes=recipes, run_dir=tmp_path / "run")[0]
    ref = reference_loss(hf_dir, runs[0][0])  # NOTE: tp 2 (dp 1): this rank holds the whole global batch
    tp1 = runs[2][1]
    for name, (_, got) in zip(("tp2 fused", "tp2 logits"), runs[:2], strict=True):
        assert got[0][0] == pytest.approx(ref, rel=1e-5), (name, got[0][0], ref)
        for step, ((loss, norm), (loss1, norm1)) in enumerate(zip(got, tp1, strict=True), 1):
            assert loss == pytest.approx(loss1, rel=1e-5), (name, step, loss, loss1)
            assert norm == pytest.approx(norm1, rel=1e-4), (name, step, norm, norm1)
    assert tp1[0][0] == pytest.approx(ref, rel=1e-5)
    assert tp1[-1][0] < tp1[0][0]  # it trains
    hf = {}
    for f in (tmp_path / "run" / "0" / "hf").glob("*.safetensors"):
        hf.update(load_file(f))
    assert hf["model.embed_tokens.weight"].shape[0] == hf["lm_head.weight"].shape[0] == VOCAB
