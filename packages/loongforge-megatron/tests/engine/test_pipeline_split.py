"""Our uneven pipeline split (``loongforge.parallel.layers``, used by checkpoint conversion) places every layer where
megatron-core builds it: same layer count and offset for every (pp rank, vpp chunk)."""

from __future__ import annotations

import itertools

import torch
from loongforge.errors import ParallelPlanError
from loongforge.parallel.layers import chunk_layer_counts, layer_ranges


def _cases():
    for num_layers, pp, vpp in itertools.product((4, 6, 8, 12, 61), (2, 3, 4, 16), (1, 2)):
        for first, last in itertools.product((None, 1, 2, 4), (None, 1, 2)):
            if first is None and last is None:
                continue
            try:
                chunk_layer_counts(num_layers, pp=pp, vpp=vpp, first=first, last=last)
            except ParallelPlanError:
                continue
            yield num_layers, pp, vpp, first, last


def test_split_matches_megatron():
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    cases = list(_cases())
    assert len(cases) > 30 and (61, 16, 1, 4, 1) in cases
    for num_layers, pp, vpp, first, last in cases:
        config = TransformerConfig(
            num_layers=num_layers, hidden_size=8, num_attention_heads=2, pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None, num_layers_in_first_pipeline_stage=first,
            num_layers_in_last_pipeline_stage=last, pipeline_dtype=torch.float32, use_cpu_initialization=True,
        )
        ranges = layer_ranges(chunk_layer_counts(num_layers, pp=pp, vpp=vpp, first=first, last=last))
        for pp_rank, vpp_rank in itertools.product(range(pp), range(vpp)):
            vp = vpp_rank if vpp > 1 else None
            n = get_num_layers_to_build(config, vp_stage=vp, pp_rank=pp_rank)
            offset = get_transformer_layer_offset(config, vp_stage=vp, pp_rank=pp_rank)
            where = (num_layers, pp, vpp, first, last, pp_rank, vpp_rank)
            assert ranges[(pp_rank, vpp_rank)] == range(offset, offset + n), where
