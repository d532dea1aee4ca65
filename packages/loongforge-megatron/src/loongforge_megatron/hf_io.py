"""Online HF checkpoints for a running job: load an HF directory into this rank's shards, export HF safetensors.

Both go through the conversion package's name maps and split/merge rules, so the offline converter and
training share one definition of every layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from loongforge.errors import CheckpointError

if TYPE_CHECKING:
    from loongforge_megatron.job import MegatronJob


def _ranks():
    from megatron.core import parallel_state as mpu

    return dict(
        tp_rank=mpu.get_tensor_model_parallel_rank(),
        pp_rank=mpu.get_pipeline_model_parallel_rank(),
        ep_rank=mpu.get_expert_model_parallel_rank(),
    )


def _module_shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in module.state_dict().items() if not k.endswith("_extra_state")}


def load_hf_into(job: MegatronJob, hf_dir: str | Path) -> None:
    """Load ``hf_dir`` into every model chunk of this rank; each rank reads only the tensors it holds."""
    from loongforge_megatron.conversion import shard_state_dict_for_rank
    from loongforge_megatron.job import VOCAB_DIVISIBLE_BY, unwrapped

    plan = job.plan
    for vpp_rank, module in enumerate(unwrapped(job)):
        dtype = next(module.parameters()).dtype
        sd = shard_state_dict_for_rank(
            hf_dir, tp_size=plan.tp, pp_size=plan.pp, ep_size=plan.ep, etp_size=plan.etp, vpp_rank=vpp_rank,
            vpp_size=plan.vpp, make_vocab_size_divisible_by=VOCAB_DIVISIBLE_BY, expected_shapes=_module_shapes(module),
            dtype=dtype, **_ranks(),
        )
        missing, unexpected = module.load_state_dict(sd, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise CheckpointError(f"{hf_dir}: missing {missing[:3]} unexpected {unexpected[:3]} after loading")
    if job.log:
        job.log.info(f"[checkpoint] loaded HF weights from {hf_dir}")


def export_hf(job: MegatronJob, out_dir: str | Path) -> Path | None:
    """Write the model (LoRA merged) as an HF directory on rank 0: config.json, safetensors + index, tokenizer.

    NOTE: shards travel to rank 0 with ``gather_object`` — simple and layout-agnostic, fine up to a few billion
    parameters; larger models should export offline from a checkpoint (``loongforge convert``).
    """
    from megatron.core import parallel_state as mpu

    from loongforge_megatron.conversion import gather_to_hf_dir
    from loongforge_megatron.job import VOCAB_DIVISIBLE_BY, unwrapped
    from loongforge_megatron.lora import merged_state_dict
    from loongforge_megatron.models.translate import hf_config

    plan = job.plan
    mine = None
    if mpu.get_data_parallel_rank() == 0 and mpu.get_context_parallel_rank() == 0:
        r = _ranks()
        mine = {}
        for vpp_rank, module in enumerate(unwrapped(job)):
            sd = merged_state_dict(module)
            key = (r["tp_rank"], r["pp_rank"], r["ep_rank"], vpp_rank)
            mine[key] = {k: v.detach().cpu() for k, v in sd.items() if not k.endswith("_extra_state")}
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    out = None
    if dist.get_rank() == 0:
        state_dicts = {}
        for part in gathered:
            if part:
                state_dicts.update(part)
        dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[job.config.params_dtype]
        tok_dir = None
        from loongforge_megatron.data.prepare import tokenizer_dir

        tok_dir = tokenizer_dir(job.recipe)
        out = gather_to_hf_dir(
            state_dicts, out_dir, hf_config=hf_config(job.arch, torch_dtype=dtype), family=job.arch.family,
            tp=plan.tp, pp=plan.pp, vpp=plan.vpp, ep=plan.ep, etp=plan.etp,
            make_vocab_size_divisible_by=VOCAB_DIVISIBLE_BY, assets_from=tok_dir, force=True,
        )
        if job.log:
            job.log.info(f"[checkpoint] HF export -> {out}")
    dist.barrier()
    return out
