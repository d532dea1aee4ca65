"""The layers of a gated-DeltaNet hybrid LM on megatron's TransformerLayer: the gated DeltaNet token mixer (heads
split over TP), the zero-centred RMSNorm (weight applied as ``1 + w``), and the per-layer block spec that puts a
DeltaNet or a gated full attention (megatron's ``attention_output_gate``, partial RoPE) in each layer."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from loongforge_megatron.layers.gated_delta import causal_conv1d, gated_delta_rule

LINEAR = "linear_attention"
FULL = "full_attention"


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm in fp32 scaled by ``1 + weight`` (weight starts at 0), cast back to the input's dtype.

    Built like a megatron norm; marks its weight ``sequence_parallel`` so megatron all-reduces its gradient over TP
    under sequence parallelism."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-6, **_: Any):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


@dataclasses.dataclass(frozen=True)
class LinearShape:
    """A gated DeltaNet's heads: key heads (q / k), value heads (a multiple of them), head dims, conv width."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_width: int

    @property
    def ratio(self) -> int:
        return self.value_heads // self.key_heads


class GatedDeltaNet(torch.nn.Module):
    """Gated DeltaNet token mixer in megatron's self-attention slot (``forward`` returns ``(out, bias)``).

    Parameters, grouped per key head so a plain dim-0 split gives each TP rank whole groups (``rules.Regrouped``
    maps HF's layouts onto them)::

        in_proj_qkvz [Hk * (2 dk + 2 r dv), h]   per group [q ; k ; v ; z]          (column parallel)
        in_proj_ba   [Hk * 2 r, h]               per group [beta ; alpha]           (column parallel)
        conv1d.weight [Hk * (2 dk + r dv), 1, w] per group [q ; k ; v]              (depthwise, split like them)
        A_log, dt_bias [Hv]; norm.weight [dv] (replicated); out_proj [h, Hv dv]     (row parallel)

    Packed samples (``packed_seq_params``, THD) restart the convolution window and the recurrent state at every
    ``cu_seqlens`` boundary. Under context parallelism every rank gathers the projections of the whole stream in
    sequence order, runs it, and keeps its own tokens (the state is recomputed, not handed over).
    """

    def __init__(self, config: Any, submodules: Any = None, layer_number: int | None = None,
                 pg_collection: Any = None, *, shape: LinearShape, **_: Any):
        super().__init__()
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear

        from loongforge_megatron.layers.megatron_layers import row_parallel_linear

        self.config, self.shape = config, shape
        tp_group = pg_collection.tp if pg_collection is not None else None
        tp = tp_group.size() if tp_group is not None else config.tensor_model_parallel_size
        if shape.key_heads % tp:
            raise ValueError(f"linear_num_key_heads {shape.key_heads} does not split over tp {tp}")
        self.tp_group = tp_group
        self.cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        self.hk = shape.key_heads // tp
        self.hv = shape.value_heads // tp
        s = shape
        dtype = config.params_dtype
        col = dict(config=config, init_method=config.init_method, bias=False, gather_output=False,
                   skip_bias_add=False, tp_group=tp_group)
        self.in_proj_qkvz = ColumnParallelLinear(config.hidden_size, s.key_heads * (2 * s.key_dim + 2 * s.ratio * s.value_dim), **col)
        self.in_proj_ba = ColumnParallelLinear(config.hidden_size, s.key_heads * 2 * s.ratio, **col)
        channels = self.hk * (2 * s.key_dim + s.ratio * s.value_dim)
        self.conv1d = torch.nn.Conv1d(channels, channels, kernel_size=s.conv_width, groups=channels, bias=False,
                                      padding=s.conv_width - 1, dtype=dtype)
        self.A_log = torch.nn.Parameter(torch.log(torch.linspace(1.0, 16.0, self.hv, dtype=torch.float32)).to(dtype))
        self.dt_bias = torch.nn.Parameter(torch.ones(self.hv, dtype=dtype))
        for p in (self.conv1d.weight, self.A_log, self.dt_bias):
            p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, 0, 1
        self.norm = torch.nn.Module()
        self.norm.weight = torch.nn.Parameter(torch.ones(s.value_dim, dtype=dtype))
        self.eps = config.layernorm_epsilon
        self.out_proj = row_parallel_linear()(s.value_heads * s.value_dim, config.hidden_size, config=config,
                                             init_method=config.output_layer_init_method, bias=False,
                                             input_is_parallel=True, skip_bias_add=True, tp_group=tp_group)

    def _norm_weight(self) -> torch.Tensor:
        # NOTE: every TP rank normalizes other heads with the same weight: the gradient is the sum over ranks
        # (an all-reduce in backward, which megatron does only for sequence-parallel norms)
        if self.tp_group is not None and self.tp_group.size() > 1:
            from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

            return copy_to_tensor_model_parallel_region(self.norm.weight, group=self.tp_group)
        return self.norm.weight

    def _cp_order(self, packed_seq_params: Any, tokens: int) -> tuple[list[int], list[torch.Tensor]] | None:
        """Under context parallelism: the global sample boundaries and every CP rank's global token positions."""
        if self.cp_group is None or self.cp_group.size() == 1:
            return None
        from loongforge_megatron.engine.packing import bounds_of, cp_indices

        cp = self.cp_group.size()
        bounds = bounds_of(packed_seq_params) if packed_seq_params is not None else [0, tokens * cp]
        return bounds, [cp_indices(bounds, cp_size=cp, cp_rank=r) for r in range(cp)]

    def forward(self, hidden_states: torch.Tensor, attention_mask: Any = None, packed_seq_params: Any = None,
                **_: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        s = self.shape
        qkvz, _ = self.in_proj_qkvz(hidden_states)  # [t, b, ...] (sequence gathered under SP)
        ba, _ = self.in_proj_ba(hidden_states)
        order = self._cp_order(packed_seq_params, qkvz.shape[0])
        if order is not None:
            # NOTE: context parallelism: the recurrence needs every earlier token of its sample, which the other CP
            # ranks hold (megatron's load-balanced chunks); gather the projections in sequence order, run the whole
            # stream on every rank and keep this rank's tokens (the gather's backward sums the ranks' gradients)
            qkvz, ba = self._cp_gather(qkvz, order[1]), self._cp_gather(ba, order[1])
        qkvz, ba = qkvz.transpose(0, 1), ba.transpose(0, 1)
        b, t = qkvz.shape[:2]
        qkvz = qkvz.reshape(b, t, self.hk, -1)
        conv_in = qkvz[..., : 2 * s.key_dim + s.ratio * s.value_dim].reshape(b, t, -1)
        z = qkvz[..., 2 * s.key_dim + s.ratio * s.value_dim:].reshape(b, t, self.hv, s.value_dim)
        beta, alpha = torch.split(ba.reshape(b, t, self.hk, 2 * s.ratio), [s.ratio, s.ratio], dim=-1)
        beta, alpha = beta.reshape(b, t, self.hv), alpha.reshape(b, t, self.hv)
        cu, bounds = None, None
        if order is not None and packed_seq_params is not None:
            bounds = order[0]
            cu = torch.tensor(bounds, dtype=torch.int32, device=conv_in.device)
        elif packed_seq_params is not None:
            cu = packed_seq_params.cu_seqlens_q_padded
            cu = packed_seq_params.cu_seqlens_q if cu is None else cu
            bounds = None if conv_in.is_cuda else [int(x) for x in cu.tolist()]
        x = causal_conv1d(conv_in, self.conv1d.weight.squeeze(1), cu_seqlens=cu, bounds=bounds)
        q, k, v = torch.split(x.reshape(b, t, self.hk, -1), [s.key_dim, s.key_dim, s.ratio * s.value_dim], dim=-1)
        v = v.reshape(b, t, self.hv, s.value_dim)
        g = -self.A_log.float().exp() * F.softplus(alpha.float() + self.dt_bias)
        o = gated_delta_rule(q, k, v, g=g, beta=beta.sigmoid(), cu_seqlens=cu, bounds=bounds)
        # gated RMSNorm (fp32 statistics, weight in the input dtype, SiLU gate)
        dtype = o.dtype
        y = o.float()
        y = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        y = (self._norm_weight() * y) * F.silu(z.float())
        y = y.to(dtype).reshape(b, t, -1).transpose(0, 1)
        if order is not None:
            rank = torch.distributed.get_rank(self.cp_group)
            y = y.index_select(0, order[1][rank].to(y.device))
        return self.out_proj(y.contiguous())

    def _cp_gather(self, x: torch.Tensor, positions: list[torch.Tensor]) -> torch.Tensor:
        """``[t_local, b, c]`` of every CP rank -> ``[t, b, c]`` in global sequence order (autograd: backward sums
        each rank's gradient into its own part)."""
        from loongforge_megatron.layers.attention import _gather_ranks

        gathered = _gather_ranks(x, self.cp_group)
        order = torch.argsort(torch.cat(positions)).to(x.device)
        return gathered.index_select(0, order)


def layer_specs(*, layer_types: list[str], shape: LinearShape, num_experts: int | None, grouped_experts: bool):
    """(full-attention layer spec, gated-DeltaNet layer spec): megatron's local layer with zero-centred norms, SDPA
    core attention (packed samples through its varlen path) and our row-parallel linears."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    from loongforge_megatron.layers.attention import SDPAttention
    from loongforge_megatron.layers.megatron_layers import (
        TorchNorm,
        local_layer_spec,
        with_own_group_row_linears,
    )

    spec = local_layer_spec(num_experts=num_experts, qk_layernorm=True)
    if grouped_experts and num_experts:
        from loongforge_megatron.layers.grouped_experts import with_grouped_experts

        spec = with_grouped_experts(spec)
    sub = spec.submodules
    norm = ZeroCenteredRMSNorm
    attn = sub.self_attention
    attn_sub = dataclasses.replace(attn.submodules, core_attention=SDPAttention, q_layernorm=norm, k_layernorm=norm)
    changes = {f.name: norm for f in dataclasses.fields(sub) if getattr(sub, f.name) is TorchNorm}
    full = dataclasses.replace(spec, submodules=dataclasses.replace(
        sub, self_attention=dataclasses.replace(attn, submodules=attn_sub), **changes))
    full = with_own_group_row_linears(full)
    mixer = ModuleSpec(module=GatedDeltaNet, params={"shape": shape})
    linear = dataclasses.replace(full, submodules=dataclasses.replace(full.submodules, self_attention=mixer))
    return full, linear


def block_spec(config: Any, *, layer_types: list[str], shape: LinearShape, num_experts: int | None,
               grouped_experts: bool = False):
    """A per-chunk block spec builder (``engine.model.build_chunks`` takes it): each layer's kind from
    ``layer_types`` at its global index, and the zero-centred final norm."""
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    full, linear = layer_specs(layer_types=layer_types, shape=shape, num_experts=num_experts,
                               grouped_experts=grouped_experts)

    def block(vp_stage: int | None):
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
        n = get_num_layers_to_build(config, vp_stage=vp_stage)
        layers = [linear if layer_types[offset + i] == LINEAR else full for i in range(n)]
        return TransformerBlockSubmodules(layer_specs=layers, layer_norm=ZeroCenteredRMSNorm)

    block.mtp_layer = full  # NOTE: a multi-token-prediction layer is a full-attention one (engine/mtp.py)
    return block
