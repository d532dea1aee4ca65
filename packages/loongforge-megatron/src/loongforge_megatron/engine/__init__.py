"""The megatron engine: process groups, model, optimizer and one training step on megatron-core.

We wrap megatron-core's building blocks (GPTModel, DDP, the distributed optimizer, the pipeline schedules);
we do not fork its training loop. Heavy imports happen inside the functions.
"""

from __future__ import annotations

from loongforge_megatron.engine.batch import cp_slice
from loongforge_megatron.engine.eval import evaluate
from loongforge_megatron.engine.model import build_chunks, build_model, wrap_ddp
from loongforge_megatron.engine.optimizer import build_optimizer, build_scheduler
from loongforge_megatron.engine.parallel_state import destroy, initialize
from loongforge_megatron.engine.step import forward_step, train_step
from loongforge_megatron.layers.megatron_layers import TorchNorm, layer_spec, local_layer_spec

__all__ = [
    "TorchNorm",
    "build_chunks",
    "build_model",
    "build_optimizer",
    "build_scheduler",
    "cp_slice",
    "destroy",
    "evaluate",
    "forward_step",
    "initialize",
    "layer_spec",
    "local_layer_spec",
    "train_step",
    "wrap_ddp",
]
