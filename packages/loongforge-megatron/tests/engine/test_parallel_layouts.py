"""TP / SP / PP / VPP / DP + distributed optimizer / EP reproduce the single-process losses (CPU, gloo, fp32).

One single-process run per model kind (dense, MoE, tied embeddings) gives the reference losses and the initial
weights; then one 2-process launch trains every layout in turn from those weights (sharded per layout) on the
same global batch. A single-process bf16 run checks the mixed-precision optimizer path on the CPU.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.slow

STEPS = 5
GLOBAL_BATCH, MICRO_BATCH, SEQ, VOCAB = 8, 2, 32, 128
# NOTE: fp32 with a different reduction order per layout; observed differences are ~1e-7 relative.
LOSS_RTOL = 1e-5
GRAD_NORM_RTOL = 1e-4

# name -> (ParallelPlan keywords for 2 ranks, model kind)
LAYOUTS: dict[str, tuple[dict[str, Any], str]] = {
    "tp2_sp": ({"tp": 2, "sp": True}, "dense"),
    "pp2": ({"pp": 2}, "dense"),
    "pp2_vpp2": ({"pp": 2, "vpp": 2}, "dense"),
    "pp2_uneven": ({"pp": 2, "first_stage_layers": 1}, "dense"),  # 1 + 3 layers
    "dp2_distopt": ({"distributed_optimizer": True}, "dense"),
    "ep2_moe": ({"ep": 2}, "moe"),
    "pp2_tied": ({"pp": 2}, "tied"),
}
REFERENCES: dict[str, tuple[dict[str, Any], str]] = {k: ({}, k) for k in ("dense", "moe", "tied", "bf16")}


def transformer_config(plan: Any, *, kind: str):
    from megatron.core.transformer import TransformerConfig

    kw: dict[str, Any] = dict(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=True,
        params_dtype=torch.bfloat16 if kind == "bf16" else torch.float32,
        pipeline_dtype=torch.bfloat16 if kind == "bf16" else torch.float32,
        bf16=kind == "bf16",
        calculate_per_token_loss=True,
        tensor_model_parallel_size=plan.tp,
        pipeline_model_parallel_size=plan.pp,
        virtual_pipeline_model_parallel_size=plan.vpp if plan.vpp > 1 else None,
        num_layers_in_first_pipeline_stage=plan.first_stage_layers,
        num_layers_in_last_pipeline_stage=plan.last_stage_layers,
        sequence_parallel=plan.sp,
        expert_model_parallel_size=plan.ep,
        expert_tensor_parallel_size=plan.etp,
    )
    if kind == "moe":
        kw.update(
            num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64, moe_token_dispatcher_type="alltoall"
        )
    return TransformerConfig(**kw)


def micro_batches(*, dp_rank: int, dp_size: int):
    """This data-parallel rank's micro-batches of the same global batches, step after step."""
    per_rank = GLOBAL_BATCH // dp_size
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 + step)
        seqs = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
        mask = (torch.rand(GLOBAL_BATCH, SEQ, generator=g) > 0.2).float()  # uneven token counts
        mine = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        seqs, mask = seqs[mine], mask[mine]
        for i in range(0, per_rank, MICRO_BATCH):
            t = seqs[i : i + MICRO_BATCH]
            yield {
                "tokens": t[:, :-1],
                "labels": t[:, 1:],
                "loss_mask": mask[i : i + MICRO_BATCH],
                "position_ids": torch.arange(SEQ).expand(MICRO_BATCH, SEQ),
            }


def train(plan: Any, *, kind: str, weights: dict[str, torch.Tensor] | None) -> dict[str, Any]:
    """Train STEPS steps in layout ``plan`` (already inside the device adaptations)."""
    from loongforge.accelerator.cpu import CpuAccelerator
    from loongforge_megatron import engine
    from loongforge_megatron.engine.model import unwrap
    from loongforge_megatron.engine.weights import load_full_state_dict
    from megatron.core import parallel_state as mpu

    engine.initialize(plan, accelerator=CpuAccelerator(), seed=1234)
    try:
        model = engine.build_model(
            transformer_config=transformer_config(plan, kind=kind),
            layer_spec=engine.local_layer_spec(num_experts=4 if kind == "moe" else None),
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
            share_embeddings_and_output_weights=kind == "tied",
            vpp=plan.vpp,
            use_distributed_optimizer=plan.distributed_optimizer,
        )
        initial = None
        if weights is None:
            initial = {
                k: v.detach().clone() for k, v in unwrap(model[0]).state_dict().items() if v is not None
            }
        else:
            load_full_state_dict(model, weights)
        opt = engine.build_optimizer(
            model,
            lr=1e-2,
            weight_decay=0.1,
            clip_grad=1.0,
            bf16=kind == "bf16",
            use_distributed_optimizer=plan.distributed_optimizer,
        )
        sched = engine.build_scheduler(
            opt, lr=1e-2, min_lr=1e-3, warmup_steps=1, decay_steps=STEPS, global_batch_size=8
        )
        dp = mpu.get_data_parallel_world_size()
        data = micro_batches(dp_rank=mpu.get_data_parallel_rank(), dp_size=dp)
        metrics = [
            engine.train_step(
                model_chunks=model,
                optimizer=opt,
                scheduler=sched,
                data_iterator=data,
                num_microbatches=GLOBAL_BATCH // (MICRO_BATCH * dp),
                seq_length=SEQ,
                micro_batch_size=MICRO_BATCH,
            )
            for _ in range(STEPS)
        ]
        return {"metrics": metrics, "initial": initial}
    finally:
        engine.destroy()


def run_layouts(
    *, rank: int, world: int, layouts: dict[str, tuple[dict[str, Any], str]], weights: dict
) -> dict:
    from loongforge.accelerator.cpu import CpuAccelerator
    from loongforge.parallel.plan import resolve_plan
    from loongforge_megatron.device_adapters import adapted
    from loongforge_megatron.engine import destroy

    out = {}
    with adapted(CpuAccelerator()):
        for name, (plan_kw, kind) in layouts.items():
            plan = resolve_plan(world_size=world, **plan_kw)
            out[name] = train(plan, kind=kind, weights=weights.get(kind))
        destroy(process_group=True)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory, ranks) -> dict[str, Any]:
    run_ranks = ranks
    tmp: Path = tmp_path_factory.mktemp("layouts")
    ref = run_ranks(run_layouts, world=1, out=tmp / "ref", layouts=REFERENCES, weights={})[0]
    weights = {kind: ref[kind]["initial"] for kind in REFERENCES}
    per_rank = run_ranks(run_layouts, world=2, out=tmp / "par", layouts=LAYOUTS, weights=weights)
    return {"ref": ref, "ranks": per_rank}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(results: dict[str, Any], layout: str) -> None:
    kind = LAYOUTS[layout][1]
    ref = [m["loss"] for m in results["ref"][kind]["metrics"]]
    ref_norm = [m["grad_norm"] for m in results["ref"][kind]["metrics"]]
    for rank, res in enumerate(results["ranks"]):
        metrics = res[layout]["metrics"]
        losses = [m["loss"] for m in metrics]
        assert losses == pytest.approx(ref, rel=LOSS_RTOL), f"rank {rank}: {losses} vs single-process {ref}"
        norms = [m["grad_norm"] for m in metrics]
        assert all(n is not None and math.isfinite(n) for n in norms), norms
        assert norms == pytest.approx(ref_norm, rel=GRAD_NORM_RTOL), (
            f"rank {rank}: grad norms {norms} vs {ref_norm}"
        )
        assert not any(m["skipped"] for m in metrics)
    assert len(set(ref)) == STEPS, "losses should change every step (the model trains)"


def test_bf16_trains_on_cpu(results: dict[str, Any]) -> None:
    """The bf16 mixed-precision optimizer (fp32 main params) runs on the CPU and tracks the fp32 run."""
    bf16 = [m["loss"] for m in results["ref"]["bf16"]["metrics"]]
    fp32 = [m["loss"] for m in results["ref"]["dense"]["metrics"]]
    assert all(math.isfinite(x) for x in bf16)
    assert bf16 == pytest.approx(fp32, rel=2e-2)
