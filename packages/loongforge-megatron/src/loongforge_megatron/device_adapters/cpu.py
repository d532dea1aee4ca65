"""The adaptations that let megatron-core 0.19 train on the CPU (gloo, fp32 or bf16).

Each entry replaces one attribute at the place megatron looks it up and checks, before patching, that the
target still contains the CUDA assumption it was written for (so an upgraded megatron-core fails loudly).
The list is the complete set measured with megatron-core 0.19.2: GPTModel (local spec), TP/SP, PP (also
interleaved), DP, the distributed optimizer, MoE with expert parallelism, grad clipping, recompute.
See README.md next to this file for the why of each entry.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from loongforge.accelerator.adaptation import Adaptation, replace_attr, resolve
from loongforge.errors import AdaptationError

from loongforge_megatron.device_adapters import cpu_rng
from loongforge_megatron.device_adapters.cpu_torch import (
    CpuTorch,
    module_mentions,
    source_mentions,
    tensor_method_adaptations,
    with_cuda_copy_as_identity,
    with_cuda_type_names,
)

# Modules that create tensors with device="cuda" / torch.cuda.current_device() in code we need on the CPU,
# with the text each must still contain for its adaptation to make sense.
CUDA_LITERAL_MODULES: dict[str, tuple[str, ...]] = {
    # total_num_tokens = torch.zeros([], ..., device="cuda") in every schedule
    "megatron.core.pipeline_parallel.schedules": ('device="cuda"',),
    # tensor shapes / receive buffers between pipeline stages
    "megatron.core.pipeline_parallel.p2p_communication": ("torch.cuda.current_device()",),
    # get_default_causal_mask / get_sliding_window_causal_mask (the non-fused softmax's causal mask)
    "megatron.core.transformer.utils": ('device="cuda"',),
    # MoE all-to-all dispatcher: a side CUDA stream for device-to-host copies of the token counts
    "megatron.core.transformer.moe.token_dispatcher": ("torch.cuda.Stream()",),
    # MoE router: moves its weight to the "current" CUDA device on first use; aux-loss accumulators
    "megatron.core.transformer.moe.router": ("device=torch.cuda.current_device()",),
    # shared experts overlapped with the dispatch: a side CUDA stream (the CPU runs them in order)
    "megatron.core.transformer.moe.shared_experts": ("torch.cuda.Stream()",),
    "megatron.core.transformer.moe.moe_layer": ("torch.cuda.current_stream().wait_stream(SharedExpertMLP.stream)",),
    # multi-token prediction: its loss tracker is allocated on the "current" CUDA device
    "megatron.core.transformer.multi_token_prediction": ("torch.cuda.current_device()",),
    # sequence-parallel all-gather / reduce-scatter output buffers
    "megatron.core.tensor_parallel.mappings": ("device=torch.cuda.current_device()",),
    # parallel linear layers: sequence-parallel backward buffers, weights when not use_cpu_initialization
    "megatron.core.tensor_parallel.layers": ("device=torch.cuda.current_device()",),
    # inv_freq moved to the "current" CUDA device on first forward
    "megatron.core.models.common.embeddings.rotary_pos_embedding": ("torch.cuda.current_device()",),
    # MLA's YaRN tables built on the "current" CUDA device when not use_cpu_initialization
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding": ("torch.cuda.current_device()",),
    # DDP's contiguous param / grad buffers
    "megatron.core.distributed.param_and_grad_buffer": ("device=torch.cuda.current_device()",),
    # grad-norm accumulators and the multi-tensor-applier overflow buffer
    "megatron.core.optimizer.clip_grads": ("device='cuda'",),
    # FP32Optimizer / mixed-precision optimizer scale and found-inf tensors
    "megatron.core.optimizer.optimizer": ("device='cuda'",),
    # distributed optimizer: shard buffers
    "megatron.core.optimizer.distrib_optimizer": ("torch.cuda.current_device()",),
    # MIMO optimizer (an encoder on ranks of its own): the rank sets' squared norms and found-inf / success flags
    "megatron.core.models.mimo.optimizer": ('device="cuda"',),
}


def _short(module: str) -> str:
    """The module's name in its adaptation's: its last part (two where an earlier module has that one)."""
    last = module.rsplit(".", 1)[-1]
    earlier = list(CUDA_LITERAL_MODULES)[:list(CUDA_LITERAL_MODULES).index(module)]
    return ".".join(module.rsplit(".", 2)[-2:]) if any(m.rsplit(".", 1)[-1] == last for m in earlier) else last


def _cpu_torch_for(module: str, needles: tuple[str, ...]) -> Adaptation:
    short = _short(module)
    return replace_attr(
        f"cuda-devices:{short}",
        f"{module}.torch",
        CpuTorch,
        description=f"{module} sees a torch whose CUDA devices (device='cuda', torch.cuda.current_device()) are the CPU",
        expect=module_mentions(module, *needles),
    )


def _get_tensor_on_cpu(original: Callable[..., Any]) -> Callable[..., Any]:
    """GlobalMemoryBuffer.get_tensor, allocating on the CPU (same caching by (name, dtype))."""

    @functools.wraps(original)
    def get_tensor(
        self: Any, tensor_shape: Any, dtype: torch.dtype, name: str, mem_alloc_context: Any = None
    ):
        required_len = 1
        for d in tensor_shape:
            required_len *= d
        buf = self.buffer.get((name, dtype))
        if buf is None or buf.numel() < required_len:
            buf = self.buffer[(name, dtype)] = torch.empty(required_len, dtype=dtype, requires_grad=False)
        return buf[0:required_len].view(*tensor_shape)

    return get_tensor


def _l2_norm_on_cpu(_original: Callable[..., Any]) -> Callable[..., Any]:
    """megatron's fallback multi-tensor L2 norm (no Apex / TE), returning its result on the CPU."""

    def multi_tensor_l2_norm(
        chunk_size: int, noop_flag: Any, tensor_lists: Any, per_tensor: bool, *args: Any
    ):
        norms = [torch.norm(t) for tensors in tensor_lists for t in tensors]
        total = torch.norm(torch.stack(norms).float()) if norms else torch.zeros((), dtype=torch.float)
        return total.reshape(1).float(), None

    return multi_tensor_l2_norm


def _host_copy_on_cpu(_original: Callable[..., Any]) -> Callable[..., Any]:
    """moe_utils.maybe_move_tensor_to_cpu for tensors already on the CPU: still honour ``as_numpy``."""

    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.detach().numpy()
        return tensor

    return maybe_move_tensor_to_cpu


def wrap_classmethod(
    name: str,
    target: str,
    wrapper: Callable[[Callable[..., Any]], Callable[..., Any]],
    *,
    description: str,
    expect: Callable[[Any], bool],
) -> Adaptation:
    """Like ``replace_attr`` for a classmethod: wraps its function and restores the exact original object."""

    def check() -> bool:
        owner, attr = resolve(target)
        raw = owner.__dict__.get(attr)
        if not isinstance(raw, classmethod):
            raise AdaptationError(f"adaptation '{name}': {target} is no longer a classmethod")
        if not expect(raw.__func__):
            raise AdaptationError(
                f"adaptation '{name}': {target} no longer matches what this adaptation expects; "
                "the library was probably upgraded — review the adaptation"
            )
        return True

    def apply() -> Callable[[], None]:
        owner, attr = resolve(target)
        raw = owner.__dict__[attr]
        setattr(owner, attr, classmethod(wrapper(raw.__func__)))
        return lambda: setattr(owner, attr, raw)

    return Adaptation(name=name, description=description, apply=apply, check=check)


def _uneven_gather_on_gloo(original: Callable[..., Any]) -> Callable[..., Any]:
    """Uneven all-gathers (an expert-TP MoE dispatch's token counts) as an even one of padded parts: gloo's
    all_gather needs every rank's tensor to have one shape."""

    @functools.wraps(original)
    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or len(set(output_split_sizes)) <= 1 or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        padded = input_.new_zeros((max(output_split_sizes), *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in output_split_sizes]
        torch.distributed.all_gather(parts, padded, group=group)
        return torch.cat([part[:n] for part, n in zip(parts, output_split_sizes, strict=True)])

    return gather


def _uneven_reduce_scatter_on_gloo(original: Callable[..., Any]) -> Callable[..., Any]:
    """Uneven reduce-scatters as an all-reduce of the whole tensor, each rank keeping its rows: gloo has no
    reduce_scatter of a list."""

    @functools.wraps(original)
    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return original(input_, group, input_split_sizes, use_global_buffer)
        total = input_.contiguous().clone()
        torch.distributed.all_reduce(total, group=group)
        start = sum(input_split_sizes[: group.rank()])
        return total[start: start + input_split_sizes[group.rank()]].contiguous()

    return reduce_scatter


@dataclass(frozen=True)
class _Patch:
    """One function-level adaptation: replace ``target`` by ``factory(original)`` when its source has ``needles``."""

    name: str
    target: str
    factory: Callable[[Any], Any]
    needles: tuple[str, ...]
    description: str
    classmethod_: bool = False


_RND = "megatron.core.tensor_parallel.random"
_PATCHES: tuple[_Patch, ...] = (
    _Patch(
        "rng-tracker",
        f"{_RND}.CudaRNGStatesTracker",
        cpu_rng.cpu_tracker_class,
        ("torch.cuda.get_rng_state", "torch.cuda.manual_seed"),
        "model-parallel RNG tracker keeps its named states in the CPU generator",
    ),
    _Patch(
        "rng-get-state",
        f"{_RND}._get_cuda_rng_state",
        lambda _orig: cpu_rng.get_rng_state,
        ("torch.cuda",),
        "activation recompute saves the CPU generator state instead of the CUDA one",
    ),
    _Patch(
        "rng-set-state",
        f"{_RND}._set_cuda_rng_state",
        lambda _orig: cpu_rng.set_rng_state,
        ("torch.cuda",),
        "activation recompute restores the CPU generator state instead of the CUDA one",
    ),
    _Patch(
        "global-memory-buffer",
        "megatron.core.utils.GlobalMemoryBuffer.get_tensor",
        _get_tensor_on_cpu,
        ("torch.cuda.current_device()",),
        "the shared scratch buffer (sequence-parallel all-gather) is allocated on the CPU",
    ),
    _Patch(
        "tied-embedding-sync",
        "megatron.core.models.common.language_module.language_module.LanguageModule.setup_embeddings_and_output_layer",
        with_cuda_copy_as_identity,
        ("weight.data.cuda()",),
        "tied input/output embeddings are synchronised across pipeline stages without .cuda()",
    ),
    _Patch(
        "cp-rotary-slice",
        "megatron.core.models.common.embeddings.rotary_pos_embedding.get_pos_emb_on_this_cp_rank",
        lambda original: _pos_emb_on_this_cp_rank,
        ("pin_memory=True", ").cuda(non_blocking=True)"),
        "context parallelism picks this rank's rotary positions with an index tensor built without .cuda()",
    ),
    _Patch(
        "moe-split-sizes",
        "megatron.core.transformer.moe.token_dispatcher.maybe_move_tensor_to_cpu",
        _host_copy_on_cpu,
        ("tensor.is_cuda", "as_numpy"),
        "the all-to-all dispatcher gets its split sizes as host arrays (it converts only CUDA tensors)",
    ),
    _Patch(
        "uneven-all-gather",
        "megatron.core.tensor_parallel.mappings._gather_along_first_dim",
        _uneven_gather_on_gloo,
        ("torch.distributed.all_gather(output_tensor_list",),
        "uneven sequence-parallel all-gathers (an expert-TP MoE dispatch) pad every part to one shape for gloo",
    ),
    _Patch(
        "uneven-reduce-scatter",
        "megatron.core.tensor_parallel.mappings._reduce_scatter_along_first_dim",
        _uneven_reduce_scatter_on_gloo,
        ("torch.distributed.reduce_scatter(output, input_tensor_list",),
        "uneven reduce-scatters run as an all-reduce, each rank keeping its rows (gloo has no list reduce-scatter)",
    ),
    _Patch(
        "grad-norm",
        "megatron.core.optimizer.clip_grads.l2_norm_impl",
        _l2_norm_on_cpu,
        ('device="cuda"',),
        "the grad-norm fallback kernel (no Apex/TE) returns the norm on the CPU",
    ),
    _Patch(
        "clip-grad-types",
        "megatron.core.optimizer.optimizer.clip_grad_by_total_norm_fp32",
        with_cuda_type_names,
        ("'torch.cuda.FloatTensor'",),
        "grad clipping accepts CPU gradients (it asserts grad.type() == 'torch.cuda.FloatTensor')",
    ),
    _Patch(
        "mimo-clip-grad-types",
        "megatron.core.models.mimo.optimizer.clip_grad_by_total_norm_fp32",
        with_cuda_type_names,
        ("'torch.cuda.FloatTensor'",),
        "the MIMO optimizer's clipping (an encoder on ranks of its own) accepts CPU gradients, as clip-grad-types",
    ),
    _Patch(
        "float16-optimizer-param-types",
        "megatron.core.optimizer.optimizer.Float16OptimizerWithFloat16Params.__init__",
        with_cuda_type_names,
        ("'torch.cuda.FloatTensor'",),
        "the bf16/fp16 optimizer accepts CPU parameters (its type check names CUDA tensor types)",
    ),
    _Patch(
        "distopt-param-types",
        "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer._build_model_and_main_param_groups",
        with_cuda_type_names,
        ("'torch.cuda.FloatTensor'",),
        "the distributed optimizer accepts CPU parameters (its type check names CUDA tensor types)",
        classmethod_=True,
    ),
)

def _pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
    """megatron's ``get_pos_emb_on_this_cp_rank`` without pinned memory and ``.cuda()``: the rotary positions of
    chunks r and 2·cp−1−r of the load-balanced context-parallel layout."""
    import torch

    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    cp_idx = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[(seq_dim + 1) :])
    pos_emb = pos_emb.index_select(seq_dim, cp_idx)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[(seq_dim + 2) :])


TARGETS: dict[str, str] = {"tensor-type-cuda-names": "torch.Tensor.type", "tensor-cuda-identity": "torch.Tensor.cuda"} | {
    p.name: p.target for p in _PATCHES} | {
    f"cuda-devices:{_short(m)}": f"{m}.torch" for m in CUDA_LITERAL_MODULES
}
"""Adaptation name -> the dotted attribute it replaces (for docs and tests)."""


def cpu_adaptations() -> list[Adaptation]:
    """The named adaptations for device type ``cpu`` (see README.md), in the order they are applied."""
    out: list[Adaptation] = tensor_method_adaptations()
    for p in _PATCHES:
        make = wrap_classmethod if p.classmethod_ else replace_attr
        out.append(
            make(p.name, p.target, p.factory, description=p.description, expect=source_mentions(*p.needles))
        )
    out += [_cpu_torch_for(m, needles) for m, needles in CUDA_LITERAL_MODULES.items()]
    return out
