"""Hybrid LMs under parallelism and packing (CPU, gloo, fp32): tp 2 + sp, pp 2, ep 2 and cp 2 each train the losses of
one process over 5 steps from the same HF checkpoint, and samples
packed back to back (THD, ``cu_seqlens``) give the logits each sample gets alone, through the DeltaNet's varlen
path and the attention's."""

from __future__ import annotations

import loongforge
import pytest
import torch
import yaml

STEPS = 5
LAYOUTS = {"tp2_sp": {"tp": 2, "sp": True}, "pp2": {"pp": 2}, "ep2": {"ep": 2}, "cp2": {"cp": 2}}


def _recipe(path, hf_dir, parallel):
    r = {
        "backend": "megatron",
        "model": {"hf": str(hf_dir)},
        "parallel": parallel,
        "data": {"format": "synthetic", "seq_length": 16},
        "train": {"stage": "cpt", "steps": STEPS, "global_batch_size": 4, "micro_batch_size": 1,
                  "precision": "fp32", "lr": 1e-3, "seed": 7},
        "checkpoint": {"load": str(hf_dir), "save_at_end": False},
        "accelerator": "cpu",
        "logging": {"tensorboard": False},
    }
    path.write_text(yaml.safe_dump(r))
    return path


def _train(*, rank, world, recipe, run_dir):
    job, _ = loongforge.build_job(loongforge.load_recipe(recipe), output_dir=run_dir)
    try:
        return [job.step()["loss"] for _ in range(STEPS)]
    finally:
        job.close()


@pytest.fixture(scope="module")
def one_process(hybrid_hf, tmp_path_factory):
    """(checkpoint, the losses of one process)."""
    from rank_harness import run_ranks

    tmp = tmp_path_factory.mktemp("one")
    hf_dir = hybrid_hf("qwen3_5_moe_even")
    losses = run_ranks(_train, world=1, out=tmp / "r", recipe=_recipe(tmp / "one.yaml", hf_dir, {}),
                       run_dir=tmp / "run")[0]
    assert len(set(losses)) == STEPS  # the weights move every step
    return hf_dir, losses


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_equals_one_process(one_process, tmp_path, ranks, layout):
    hf_dir, ref = one_process
    got = ranks(_train, world=2, out=tmp_path / "r", recipe=_recipe(tmp_path / "r.yaml", hf_dir, LAYOUTS[layout]),
                run_dir=tmp_path / "run")[0]
    assert got == pytest.approx(ref, rel=1e-5), (got, ref)


def _tiny_model(plan):
    from loongforge_megatron.engine.model import build_chunks
    from loongforge_megatron.engine.weights import seeded_init
    from loongforge_megatron.models.gpt.translate import transformer_config
    from loongforge_megatron.models.hybrid.layers import block_spec
    from loongforge_megatron.models.hybrid.qwen3_5 import SPEC

    arch = SPEC.arch(dict(SPEC.presets["qwen3.5-tiny"]))
    config = transformer_config(arch, plan=plan, precision="fp32", cpu_init=True)
    config.attention_output_gate = True
    spec = block_spec(config, layer_types=arch.layers, shape=arch.linear_shape, num_experts=None)
    (model,) = build_chunks(transformer_config=config, layer_spec=spec, vocab_size=arch.vocab_size,
                            max_sequence_length=64, rotary_percent=arch.rotary_percent, rotary_base=arch.rope_theta)
    seeded_init([model], config=config, seed=3)
    return model.eval(), arch


def _packed_batch(lengths, vocab):
    from loongforge_megatron.engine.packing import packed_seq_params

    tokens = torch.randint(0, vocab, (1, sum(lengths)), generator=torch.Generator().manual_seed(0))
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return {"tokens": tokens, "position_ids": positions, "packed_seq_params": packed_seq_params(bounds)}, bounds


def _packed_vs_alone(*, lengths):
    from loongforge.parallel.plan import resolve_plan

    model, arch = _tiny_model(resolve_plan(world_size=1))
    batch, bounds = _packed_batch(lengths, arch.vocab_size)
    tokens = batch["tokens"]
    with torch.no_grad():
        packed = model(tokens, batch["position_ids"], None, packed_seq_params=batch["packed_seq_params"])
        alone = torch.cat([model(tokens[:, a:b], torch.arange(b - a)[None], None)
                           for a, b in zip(bounds, bounds[1:], strict=False)], dim=1)
    return packed, alone


def test_packed_equals_unpacked(in_world, tmp_path):
    packed, alone = in_world(_packed_vs_alone, out=tmp_path / "w", lengths=[9, 3, 20])
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


def _packed_cp(*, rank, world, lengths):
    """This CP rank's global token positions and its logits of the packed stream (cp = world)."""
    from loongforge.accelerator.cpu import CpuAccelerator
    from loongforge.parallel.plan import resolve_plan
    from loongforge_megatron import engine
    from loongforge_megatron.device_adapters import adapted
    from loongforge_megatron.engine.batch import cp_slice
    from loongforge_megatron.engine.packing import cp_indices

    acc = CpuAccelerator()
    plan = resolve_plan(world_size=world, cp=world)
    with adapted(acc):
        engine.initialize(plan, accelerator=acc, seed=1)
        try:
            model, arch = _tiny_model(plan)
            batch, bounds = _packed_batch(lengths, arch.vocab_size)
            local = cp_slice(dict(batch)) if world > 1 else batch
            with torch.no_grad():
                out = model(local["tokens"], local["position_ids"], None, packed_seq_params=local["packed_seq_params"])
            return cp_indices(bounds, cp_size=world, cp_rank=rank), out
        finally:
            engine.destroy(process_group=True)


@pytest.mark.slow
def test_packed_cp2_equals_one_process(ranks, tmp_path):
    """Packed samples over 2 context-parallel ranks (each sample's load-balanced chunks): every rank's logits are
    the one-process logits of its tokens (the DeltaNet's state crosses the ranks' chunks, attention's keys too)."""
    lengths = [8, 20, 4]  # NOTE: multiples of 2 * cp
    _, ref = ranks(_packed_cp, world=1, out=tmp_path / "one", lengths=lengths)[0]
    for index, logits in ranks(_packed_cp, world=2, out=tmp_path / "cp2", lengths=lengths):
        torch.testing.assert_close(logits, ref[:, index], rtol=1e-5, atol=1e-5)
