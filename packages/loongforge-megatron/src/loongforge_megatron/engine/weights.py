"""Whole-model weights for this rank's (TP/PP/VPP/EP-sharded) GPTModel chunks: load an unsharded state dict, or
draw a seeded initial model that does not depend on the layout.

The full state dict uses the names of a single-process GPTModel (``decoder.layers.<global layer>``,
``...local_experts.<global expert>``). Each rank renames its local layers/experts to global ones and takes its
tensor-parallel slice using the attributes megatron puts on every parameter (``partition_dim``,
``partition_stride``; expert parameters carry ``allreduce=False`` and use the expert-TP group).

NOTE: megatron's stride-2 layout (SwiGLU ``linear_fc1`` = [gate; up]) splits the full weight into
``tp * stride`` pieces and gives rank r pieces r, r+tp, ...: each rank holds [gate_r; up_r]. The fused QKV
weight is grouped per query group, so a plain dim-0 split is already correct.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from loongforge_megatron.engine.model import unwrap

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def _global_name(name: str, *, layer_offset: int, expert_offset: int) -> str:
    name = _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + layer_offset}.", name, count=1)
    return _EXPERT.sub(lambda m: f".local_experts.{int(m.group(1)) + expert_offset}.", name, count=1)


def tp_shard(full: torch.Tensor, param: Any, *, rank: int, size: int, split: bool | None = None) -> torch.Tensor:
    """This tensor-parallel rank's slice of ``full`` for ``param`` (unchanged when not tensor-parallel; ``split``:
    whether it is, when not its ``tensor_model_parallel``)."""
    split = getattr(param, "tensor_model_parallel", False) if split is None else split
    if size == 1 or not split:
        return full
    dim = param.partition_dim
    stride = getattr(param, "partition_stride", 1)
    pieces = torch.split(full, full.shape[dim] // (size * stride), dim=dim)
    return torch.cat(pieces[rank::size], dim=dim)


def load_full_state_dict(model_chunks: list[torch.nn.Module], state_dict: dict[str, torch.Tensor]) -> None:
    """Copy the matching slice of every tensor in ``state_dict`` into ``model_chunks`` (in place).

    Raises ``KeyError`` naming the first local tensor with no counterpart in ``state_dict``.
    """
    from megatron.core import parallel_state as mpu
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    tp_rank, tp_size = mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()
    etp_rank, etp_size = mpu.get_expert_tensor_parallel_rank(), mpu.get_expert_tensor_parallel_world_size()
    ep_rank, ep_size = mpu.get_expert_model_parallel_rank(), mpu.get_expert_model_parallel_world_size()
    for chunk in model_chunks:
        model = unwrap(chunk)
        config = model.config
        layer_offset = get_transformer_layer_offset(config, vp_stage=getattr(model, "vp_stage", None))
        num_local_experts = (config.num_moe_experts or 0) // ep_size
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, tensor in model.state_dict(keep_vars=True).items():
                if tensor is None or name.endswith("_extra_state"):
                    continue
                key = _global_name(name, layer_offset=layer_offset, expert_offset=ep_rank * num_local_experts)
                if (
                    key == "output_layer.weight"
                    and key not in state_dict
                    and model.share_embeddings_and_output_weights
                ):
                    # NOTE: tied embeddings: the last pipeline stage keeps its own copy of the word embeddings.
                    key = "embedding.word_embeddings.weight"
                if key not in state_dict:
                    raise KeyError(f"{name} (global {key}) is not in the state dict")
                param = params.get(name, tensor)
                is_expert = not getattr(param, "allreduce", True)
                rank, size = (etp_rank, etp_size) if is_expert else (tp_rank, tp_size)
                shard = tp_shard(state_dict[key], param, rank=rank, size=size)
                if shard.shape != tensor.shape:
                    raise ValueError(f"{name}: shard {tuple(shard.shape)} != local {tuple(tensor.shape)}")
                tensor.data.copy_(shard)


def _name_seed(seed: int, name: str) -> int:
    import zlib

    return zlib.crc32(f"{seed}:{name}".encode()) & 0x7FFFFFFF


def _draw(init, full: torch.Tensor, seed: int) -> None:
    """``init(full)`` from a generator seeded by ``seed`` alone (torch's init functions take one)."""
    g = torch.Generator(device=full.device).manual_seed(seed)
    try:
        init(full, generator=g)
    except TypeError:  # NOTE: an init function without a generator argument: seed the global RNG around it
        with torch.random.fork_rng(devices=[full.device] if full.device.type == "cuda" else []):
            torch.manual_seed(seed)
            init(full)


def _init_tensors(model: torch.nn.Module):
    """(state-dict name, tensor) of every parameter, as each module's own ``_save_to_state_dict`` names it: a module
    that stores its weights fused (grouped experts: one stacked tensor) hands out per-expert views under the
    names of the unfused layout, so they draw what the unfused module would (buffers are left alone)."""
    for mname, module in model.named_modules():
        if not any(True for _ in module.parameters(recurse=False)):
            continue
        prefix = f"{mname}." if mname else ""
        buffers = {prefix + n for n, _ in module.named_buffers(recurse=False)}
        out: dict[str, torch.Tensor] = {}
        module._save_to_state_dict(out, prefix, keep_vars=True)
        yield from ((n, t) for n, t in out.items() if n not in buffers and t is not None
                    and not n.endswith("_extra_state") and isinstance(t, torch.Tensor))


@torch.no_grad()
def seeded_init(model_chunks: list[torch.nn.Module], *, config: Any, seed: int) -> None:
    """Redraw every randomly initialised parameter of this rank's GPTModel chunks from a generator seeded by
    ``seed`` and the parameter's *global* name, whole, then keep this rank's slice: the same recipe and seed give
    the same initial model at any tp / pp / vpp / ep / etp (megatron draws per stage, in build order, from
    ``seed + 100 * pp_rank``).

    The distributions are megatron's own: ``config.output_layer_init_method`` for the layers it uses it for
    (``linear_proj``, ``linear_fc2``), ``config.init_method`` for the other weights. Parameters megatron sets to a
    constant (biases 0, norm weights 1) stay as they are.
    """
    from megatron.core import parallel_state as mpu
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    tp_rank, tp_size = mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()
    etp_rank, etp_size = mpu.get_expert_tensor_parallel_rank(), mpu.get_expert_tensor_parallel_world_size()
    ep_rank, ep_size = mpu.get_expert_model_parallel_rank(), mpu.get_expert_model_parallel_world_size()
    for chunk in model_chunks:
        model = unwrap(chunk)
        layer_offset = get_transformer_layer_offset(config, vp_stage=getattr(model, "vp_stage", None))
        num_local_experts = (config.num_moe_experts or 0) // ep_size
        for name, param in _init_tensors(model):
            flat = param.detach().reshape(-1)
            if flat.numel() and bool((flat == flat[0]).all()):
                continue  # a constant init (zeros / ones)
            key = _global_name(name, layer_offset=layer_offset, expert_offset=ep_rank * num_local_experts)
            if key == "output_layer.weight" and getattr(model, "share_embeddings_and_output_weights", False):
                key = "embedding.word_embeddings.weight"  # NOTE: the last stage's copy of the tied embedding
            is_expert = not getattr(param, "allreduce", True)
            rank, size = (etp_rank, etp_size) if is_expert else (tp_rank, tp_size)
            split = getattr(param, "tensor_model_parallel", False)
            if getattr(param, "component_shard", None) is not None:  # a component on a tp group of its own
                (rank, size), split = param.component_shard, True
            shape = list(param.shape)
            if size > 1 and split:
                shape[param.partition_dim] *= size
            out_layer = name.endswith(("linear_proj.weight", "linear_fc2.weight"))
            init = config.output_layer_init_method if out_layer else config.init_method
            full = torch.empty(shape, dtype=torch.float32, device=param.device)
            _draw(init, full, _name_seed(seed, key))
            param.copy_(tp_shard(full, param, rank=rank, size=size, split=split))
