"""Build the language model: one megatron ``GPTModel`` per virtual pipeline chunk; wrap chunks in megatron DDP.

NOTE: GPTModel, not HybridModel. megatron-core 0.19 marks GPTModel deprecated, but HybridModel's only shipped
stack spec is built from TransformerEngine modules (CUDA only) and a layer-pattern string; our ``local`` spec
is a TransformerLayer spec that GPTModel takes directly. Revisit when megatron ships a non-TE HybridStack spec.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from loongforge_megatron.layers.megatron_layers import TorchNorm


def _not_deprecation_notice(record: logging.LogRecord) -> bool:
    return "GPTModel IS DEPRECATED" not in record.getMessage()


def _block_spec(config: Any, layer_spec: Any, vp_stage: int | None) -> Any:
    """The decoder block spec for one chunk: ``layer_spec`` repeated, final norm of the same kind.

    NOTE: given a bare layer spec, megatron picks the final norm itself (TENorm / Apex / WrappedTorchNorm);
    WrappedTorchNorm refuses sequence parallelism, so with our TorchNorm layers we supply the final norm too.
    """
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    if callable(layer_spec) and not isinstance(layer_spec, type) and not hasattr(layer_spec, "module"):
        return layer_spec(vp_stage)  # a per-chunk block spec builder (layers differ, e.g. dense then MoE)
    if getattr(getattr(layer_spec, "submodules", None), "input_layernorm", None) is not TorchNorm:
        return layer_spec
    n = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * n, layer_norm=TorchNorm)


def build_chunks(
    *,
    transformer_config: Any,
    layer_spec: Any,
    vocab_size: int,
    max_sequence_length: int,
    position_embedding_type: str = "rope",
    rotary_base: int = 10000,
    rotary_percent: float = 1.0,
    share_embeddings_and_output_weights: bool = False,
    vpp: int = 1,
    device: torch.device | str | None = None,
    rope_scaling_factor: float | None = None,
    mtp_block_spec: Any = None,
) -> list[torch.nn.Module]:
    """One ``GPTModel`` per virtual pipeline chunk of this rank (a list of length ``vpp``), before DDP.

    Call after :func:`loongforge_megatron.engine.parallel_state.initialize`. ``transformer_config`` must set
    ``calculate_per_token_loss=True``: the engine's loss is a token-weighted mean over micro-batches and
    data-parallel ranks, which is what makes losses identical across parallel layouts.
    """
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.pipeline_parallel.utils import is_vp_first_stage, is_vp_last_stage

    config = transformer_config
    # NOTE: the choice of GPTModel is deliberate (module docstring); its per-build notice is console noise.
    logging.getLogger("megatron.core.models.gpt.gpt_model").addFilter(_not_deprecation_notice)
    if not config.calculate_per_token_loss:
        raise ValueError(
            "transformer_config.calculate_per_token_loss must be True (token-weighted loss over micro-batches "
            "and data-parallel ranks)"
        )
    pp_vpp = mpu.get_virtual_pipeline_model_parallel_world_size() or 1
    if vpp != pp_vpp:
        raise ValueError(f"build_model(vpp={vpp}) but parallel_state was initialized with vpp={pp_vpp}")
    vp_size = vpp if vpp > 1 else None
    chunks: list[torch.nn.Module] = []
    for i in range(vpp):
        vp_stage = i if vpp > 1 else None
        pre = mpu.is_pipeline_first_stage(ignore_virtual=True) and is_vp_first_stage(vp_stage, vp_size)
        post = mpu.is_pipeline_last_stage(ignore_virtual=True) and is_vp_last_stage(vp_stage, vp_size)
        model = GPTModel(
            config=config,
            transformer_layer_spec=_block_spec(config, layer_spec, vp_stage),
            vocab_size=vocab_size,
            max_sequence_length=max_sequence_length,
            pre_process=pre,
            post_process=post,
            share_embeddings_and_output_weights=share_embeddings_and_output_weights,
            position_embedding_type=position_embedding_type,
            rotary_percent=rotary_percent,
            rotary_base=rotary_base,
            rope_scaling=rope_scaling_factor is not None,
            rope_scaling_factor=rope_scaling_factor or 8.0,
            vp_stage=vp_stage,
            mtp_block_spec=mtp_block_spec,
        )
        if device is not None:
            model.to(device)
        chunks.append(model)
    return chunks


def build_model(*, use_distributed_optimizer: bool = False, grad_reduce_in_fp32: bool = True,
                overlap_grad_reduce: bool = False, **kwargs: Any) -> list[torch.nn.Module]:
    """:func:`build_chunks` wrapped in megatron DDP (for callers with no weights to load in between)."""
    chunks = build_chunks(**kwargs)
    return wrap_ddp(chunks, kwargs["transformer_config"], use_distributed_optimizer=use_distributed_optimizer,
                    grad_reduce_in_fp32=grad_reduce_in_fp32, overlap_grad_reduce=overlap_grad_reduce)


def wrap_ddp(
    chunks: list[torch.nn.Module],
    config: Any,
    *,
    use_distributed_optimizer: bool,
    grad_reduce_in_fp32: bool = True,
    overlap_grad_reduce: bool = False,
) -> list[torch.nn.Module]:
    """This rank's model chunks (GPTModel, LLaVAModel, DiTModel), each in megatron's DDP, parameters broadcast
    from data-parallel rank 0. Load initial weights and add LoRA adapters before: DDP sizes its grad buffers for
    the trainable parameters it sees."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32,
        overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    wrapped: list[torch.nn.Module] = [
        DistributedDataParallel(
            config=config,
            ddp_config=ddp_config,
            module=m,
            # NOTE: megatron-LM buckets only the first chunk's grads (later chunks finish backward first).
            disable_bucketing=i > 0,
        )
        for i, m in enumerate(chunks)
    ]
    for m in wrapped:
        m.broadcast_params()
    return wrapped


def unwrap(model_chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside a DDP (or other megatron) wrapper."""
    while hasattr(model_chunk, "module"):
        model_chunk = model_chunk.module
    return model_chunk
