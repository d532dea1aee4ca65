"""The optimizer step with the gradient clipping folded into the fused Adam kernel (``engine/optimizer.py``) equals
megatron's own step (clip pass, then Adam), with and without the distributed optimizer; a step whose gradient is
NaN on one rank changes no weight on any rank and is reported as non-finite.

On CPU, torch's fused AdamW is switched on by hand (the GPU build does it itself, ``use_fused_torch_adam``), so the
folded path runs here exactly as on the GPU.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

STEPS, GLOBAL_BATCH, MICRO_BATCH, SEQ, VOCAB = 3, 8, 2, 16, 64


def _config(plan: Any):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, use_cpu_initialization=True,
        params_dtype=torch.float32, calculate_per_token_loss=True, tensor_model_parallel_size=plan.tp,
        pipeline_model_parallel_size=plan.pp)


def _batches(step: int, *, dp_rank: int, dp_size: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + step)
    seqs = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    per = GLOBAL_BATCH // dp_size
    seqs = seqs[dp_rank * per:(dp_rank + 1) * per]
    return [{"tokens": seqs[i:i + MICRO_BATCH, :-1], "labels": seqs[i:i + MICRO_BATCH, 1:],
             "loss_mask": torch.ones(MICRO_BATCH, SEQ), "position_ids": torch.arange(SEQ).expand(MICRO_BATCH, SEQ)}
            for i in range(0, per, MICRO_BATCH)]


def _train(*, distributed: bool, fused: bool, nan_step: int | None, rank: int, world: int) -> dict[str, Any]:
    from loongforge.accelerator.cpu import CpuAccelerator
    from loongforge.parallel.plan import resolve_plan
    from loongforge_megatron import engine
    from loongforge_megatron.engine.model import unwrap
    from loongforge_megatron.engine.optimizer import folds_clip, inner_optimizers
    from megatron.core import parallel_state as mpu

    plan = resolve_plan(world_size=world, distributed_optimizer=distributed)
    engine.initialize(plan, accelerator=CpuAccelerator(), seed=7)
    try:
        model = engine.build_model(transformer_config=_config(plan), layer_spec=engine.local_layer_spec(),
                                   vocab_size=VOCAB, max_sequence_length=SEQ, use_distributed_optimizer=distributed)
        opt = engine.build_optimizer(model, lr=1e-2, weight_decay=0.1, clip_grad=0.5,
                                     use_distributed_optimizer=distributed)
        if fused:
            for inner in inner_optimizers(opt):
                for group in inner.param_groups:
                    group["fused"], group["foreach"] = True, False
        sched = engine.build_scheduler(opt, lr=1e-2, decay_steps=STEPS, decay_style="constant",
                                       global_batch_size=GLOBAL_BATCH)
        dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
        params = list(unwrap(model[0]).parameters())
        metrics, unchanged = [], None
        for step in range(STEPS):
            hook = None
            if step == nan_step:
                before = [p.detach().clone() for p in params]
                if rank == 0:  # NOTE: one rank's gradient only; the other ranks must skip as well
                    hook = params[-1].register_hook(lambda g: g * float("nan"))
            out = engine.train_step(model_chunks=model, optimizer=opt, scheduler=sched,
                                    data_iterator=iter(_batches(step, dp_rank=dp_rank, dp_size=dp)),
                                    num_microbatches=GLOBAL_BATCH // (MICRO_BATCH * dp), seq_length=SEQ,
                                    micro_batch_size=MICRO_BATCH)
            if hook is not None:
                hook.remove()
            if step == nan_step:
                unchanged = all(torch.equal(a, p.detach()) for a, p in zip(before, params, strict=True))
            metrics.append(out)
        return {"metrics": metrics, "folds": folds_clip(opt), "unchanged": unchanged,
                "weights": [p.detach().clone() for p in params]}
    finally:
        engine.destroy()


def _run(*, rank: int, world: int) -> dict[str, Any]:
    from loongforge.accelerator.cpu import CpuAccelerator
    from loongforge_megatron.device_adapters import adapted
    from loongforge_megatron.engine import destroy

    out = {}
    with adapted(CpuAccelerator()):
        for distributed in (False, True):
            for fused in (False, True):
                out[distributed, fused] = _train(distributed=distributed, fused=fused, nan_step=None, rank=rank,
                                                 world=world)
        out["nan"] = _train(distributed=True, fused=True, nan_step=1, rank=rank, world=world)
        destroy(process_group=True)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory, ranks) -> list[dict[str, Any]]:
    tmp: Path = tmp_path_factory.mktemp("folded_clip")
    return ranks(_run, world=2, out=tmp)


@pytest.mark.parametrize("distributed", [False, True], ids=["ddp", "distributed_optimizer"])
def test_folded_clip_equals_megatrons_clip_then_adam(results, distributed: bool) -> None:
    for res in results:
        ref, folded = res[distributed, False], res[distributed, True]
        assert not ref["folds"] and folded["folds"]
        for a, b in zip(ref["metrics"], folded["metrics"], strict=True):
            assert b["grad_norm"] > 0.5, "the clipping must be active for the comparison to mean anything"
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
            assert not b["skipped"] and not b["nonfinite"]
        for x, y in zip(ref["weights"], folded["weights"], strict=True):
            torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6)
        assert len({m["loss"] for m in folded["metrics"]}) == STEPS  # it trains


def test_a_nan_gradient_on_one_rank_changes_no_weight_anywhere(results) -> None:
    for rank, res in enumerate(results):
        nan = res["nan"]
        assert nan["folds"]
        step = nan["metrics"][1]
        assert step["nonfinite"] and step["skipped"], f"rank {rank}: {step}"
        assert nan["unchanged"], f"rank {rank}: a weight moved in the non-finite step"
        last = nan["metrics"][2]
        assert not last["skipped"] and math.isfinite(last["loss"]) and math.isfinite(last["grad_norm"])
