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


def _comm_device() -> torch.device:
    """Where point-to-point buffers live for the default process group's backend."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def export_hf(job: MegatronJob, out_dir: str | Path) -> Path | None:
    """Write the model (LoRA merged) as an HF directory on rank 0: config.json, safetensors + index, tokenizer.

    Streams: rank 0 walks the HF tensors in order and every other rank sends each shard it owns point-to-point
    the moment the writer needs it, so rank 0 holds one tensor group at a time (plus its own shards). All
    ranks walk the same order (``hf_params`` x ``shard_sources``), which pairs every send with its receive.
    Each ``(tp, pp, ep, vpp)`` shard comes from the lowest global rank holding it (a data-parallel replica
    holds the same values).

    NOTE: if rank 0 fails mid-export the other ranks wait in ``send`` until the process-group timeout.
    """
    import json

    from loongforge_megatron.conversion.convert import copy_assets
    from loongforge_megatron.conversion.engine import MegatronSource, hf_params, key_of, to_hf_dir
    from loongforge_megatron.conversion.families import get_family
    from loongforge_megatron.conversion.layout import MegatronLayout
    from loongforge_megatron.data.prepare import tokenizer_dir
    from loongforge_megatron.job import VOCAB_DIVISIBLE_BY, unwrapped
    from loongforge_megatron.lora import merged_state_dict
    from loongforge_megatron.models.translate import hf_config

    plan, me = job.plan, dist.get_rank()
    dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[job.config.params_dtype]
    config = hf_config(job.arch, torch_dtype=dtype)
    layout = MegatronLayout(get_family(job.arch.family, hf_config=config).name, config, tp=plan.tp, pp=plan.pp,
                            vpp=plan.vpp, ep=plan.ep, etp=plan.etp, make_vocab_size_divisible_by=VOCAB_DIVISIBLE_BY)
    r = _ranks()
    mine = {}
    for vpp_rank, module in enumerate(unwrapped(job)):
        sd = merged_state_dict(module)
        mine[(r["tp_rank"], r["pp_rank"], r["ep_rank"], vpp_rank)] = {
            k: v.detach() for k, v in sd.items() if not k.endswith("_extra_state")}
    shapes = {key: {k: (v.dtype, tuple(v.shape)) for k, v in sd.items()} for key, sd in mine.items()}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, shapes)
    owner, specs = {}, {}
    for rank, held in enumerate(everyone):
        for key, spec in held.items():
            if key not in owner:
                owner[key], specs[key] = rank, spec
    device = _comm_device()
    out = None
    if me == 0:
        def read(rank, name):
            if owner[rank] == 0:
                return mine[rank][name].cpu()
            dt, shape = specs[rank][name]
            buf = torch.empty(shape, dtype=dt, device=device)
            dist.recv(buf, src=owner[rank])
            return buf.cpu()

        def spec(rank, name):
            try:
                return specs[rank][name]
            except KeyError:
                raise CheckpointError(f"rank {rank}: the model has no tensor '{name}'") from None

        tok_dir = tokenizer_dir(job.recipe)

        def put_assets(staging: Path) -> None:
            if tok_dir is not None:
                copy_assets(Path(tok_dir), staging)
            (staging / "config.json").write_text(json.dumps(config, indent=2))

        out = Path(out_dir)
        to_hf_dir(MegatronSource(layout, read=read, spec=spec), layout, out, max_shard_bytes=5 * 2**30,
                  force=True, assets=put_assets)
        if job.log:
            job.log.info(f"[checkpoint] HF export -> {out}")
    else:
        # NOTE: mirrors the reads of rank 0's MegatronSource.get, in the same order.
        by_key = {key_of(p): p for p in layout.params() if p.export}
        for p in hf_params(layout):
            src = by_key[key_of(p)]
            for rank in layout.shard_sources(src):
                if owner.get(rank) == me:
                    dist.send(mine[rank][src.megatron].to(device).contiguous(), dst=0)
    dist.barrier()
    return out
