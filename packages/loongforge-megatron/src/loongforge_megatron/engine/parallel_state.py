"""Process groups and RNG seeding for a run, from a core :class:`ParallelPlan`.

``initialize`` creates the default process group (if the job has not: core's ``runtime.init_distributed``), megatron-core's model-parallel
groups and its model-parallel RNG states; ``destroy`` tears the model-parallel state down so one process can
run several layouts (tests do).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from loongforge.runtime import free_port  # noqa: F401  NOTE: core's one free_port, still imported by the test harness

if TYPE_CHECKING:
    from loongforge.accelerator.base import Accelerator
    from loongforge.parallel.plan import ParallelPlan


def initialize(plan: ParallelPlan, *, accelerator: Accelerator, seed: int) -> None:
    """Create process groups for ``plan`` and seed every RNG megatron uses.

    On a non-CUDA device call this inside the device adaptations (``with adapted(accelerator):``): seeding
    goes through megatron's RNG tracker, which the adaptations move off CUDA.
    """
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.tensor_parallel import random as mrandom

    if accelerator.device_type == "cpu" and mrandom.CudaRNGStatesTracker.__name__ == "CudaRNGStatesTracker":
        raise RuntimeError(
            "engine.initialize on the CPU must run inside the device adaptations: "
            "`with loongforge_megatron.device_adapters.adapted(accelerator): ...`"
        )
    if not dist.is_initialized():
        from loongforge.runtime import init_distributed

        # NOTE: core's one way (torchrun's env:// for a launched rank, a private store for a lone process);
        # nothing is written into os.environ
        accelerator.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        init_distributed(accelerator, rank=int(os.environ.get("RANK", "0")),
                         world_size=int(os.environ.get("WORLD_SIZE", "1")))
    if dist.get_world_size() != plan.world_size:
        raise ValueError(
            f"parallel plan is for {plan.world_size} processes but the world has {dist.get_world_size()}"
        )
    if mpu.model_parallel_is_initialized():
        destroy()
    from loongforge_megatron.engine.encoder_ranks import initialize_model_parallel, rank_sets

    sets = rank_sets(plan)
    if sets is not None:  # NOTE: an encoder on ranks of its own: each rank set gets its own layout's groups
        initialize_model_parallel(sets)
    else:
        mpu.initialize_model_parallel(
            tensor_model_parallel_size=plan.tp,
            pipeline_model_parallel_size=plan.pp,
            virtual_pipeline_model_parallel_size=plan.vpp if plan.vpp > 1 else None,
            context_parallel_size=plan.cp,
            expert_model_parallel_size=plan.ep,
            expert_tensor_parallel_size=plan.etp,
        )
    # NOTE: megatron-LM offsets the seed per pipeline stage so stages do not share dropout streams.
    stage_seed = seed + 100 * mpu.get_pipeline_model_parallel_rank()
    accelerator.manual_seed(stage_seed)
    model_parallel_cuda_manual_seed(stage_seed, force_reset_rng=True)


def destroy(*, process_group: bool = False) -> None:
    """Tear down megatron's model-parallel state (and the default process group if ``process_group``)."""
    from megatron.core import parallel_state as mpu

    from loongforge_megatron.engine.component_groups import release

    release()
    mpu.destroy_model_parallel()
    if process_group and dist.is_initialized():
        dist.destroy_process_group()


def data_parallel_size(*, with_context_parallel: bool = True) -> int:
    """Size of the group over which the loss and the global batch are spread."""
    from megatron.core import parallel_state as mpu

    return mpu.get_data_parallel_world_size(with_context_parallel=with_context_parallel)


def device_of(module: torch.nn.Module) -> torch.device:
    """The device a model chunk computes on (its first parameter's)."""
    return next(module.parameters()).device
