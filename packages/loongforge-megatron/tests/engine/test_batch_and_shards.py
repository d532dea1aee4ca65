"""Single-process helpers: context-parallel slicing, tensor-parallel shards, the sequence-parallel norm."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from loongforge_megatron.engine.batch import cp_slice
from loongforge_megatron.engine.weights import tp_shard
from loongforge_megatron.layers.megatron_layers import TorchNorm, local_layer_spec


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_cp_slice_is_load_balanced_and_complete(cp: int) -> None:
    b, s = 2, 16
    tokens = torch.arange(b * s).view(b, s)
    batch = {
        "tokens": tokens,
        "labels": tokens + 1,
        "loss_mask": torch.ones(b, s),
        "position_ids": torch.arange(s).expand(b, s),
        "attention_mask": torch.ones(b, 1, s, s, dtype=torch.bool),
        "meta": "kept",
    }
    chunk = s // (2 * cp)
    pieces = {}
    for r in range(cp):
        part = cp_slice(batch, cp_size=cp, cp_rank=r)
        assert part["tokens"].shape == (b, s // cp) and part["attention_mask"].shape == (b, 1, s // cp, s)
        assert part["meta"] == "kept"
        # rank r holds chunks r and 2cp-1-r (early + late tokens: equal causal-attention work)
        pieces[r], pieces[2 * cp - 1 - r] = part["position_ids"][0, :chunk], part["position_ids"][0, chunk:]
        assert torch.equal(part["labels"], part["tokens"] + 1)
    assert torch.equal(torch.cat([pieces[i] for i in range(2 * cp)]), torch.arange(s))


def test_cp_slice_rejects_indivisible_sequence() -> None:
    with pytest.raises(ValueError, match="2 \\* cp"):
        cp_slice({"tokens": torch.zeros(1, 6)}, cp_size=2, cp_rank=0)


def test_tp_shard_follows_megatron_partition_attributes() -> None:
    full = torch.arange(8.0).view(8, 1)
    col = SimpleNamespace(tensor_model_parallel=True, partition_dim=0, partition_stride=1)
    assert tp_shard(full, col, rank=1, size=2).flatten().tolist() == [4, 5, 6, 7]
    gated = SimpleNamespace(tensor_model_parallel=True, partition_dim=0, partition_stride=2)  # [gate; up]
    assert tp_shard(full, gated, rank=0, size=2).flatten().tolist() == [0, 1, 4, 5]
    assert tp_shard(full, gated, rank=1, size=2).flatten().tolist() == [2, 3, 6, 7]
    row = SimpleNamespace(tensor_model_parallel=True, partition_dim=1, partition_stride=1)
    assert tp_shard(full.T, row, rank=1, size=4).flatten().tolist() == [2, 3]
    assert tp_shard(full, SimpleNamespace(), rank=1, size=2) is full


def test_torch_norm_marks_sequence_parallel_weights() -> None:
    cfg = SimpleNamespace(
        normalization="RMSNorm",
        sequence_parallel=True,
        params_dtype=torch.float32,
        layernorm_zero_centered_gamma=False,
    )
    norm = TorchNorm(config=cfg, hidden_size=8, eps=1e-6)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.weight.sequence_parallel is True
    cfg.normalization = "LayerNorm"
    assert isinstance(TorchNorm(config=cfg, hidden_size=8), torch.nn.LayerNorm)


def test_local_spec_uses_torch_norm() -> None:
    spec = local_layer_spec(qk_layernorm=True)
    sub = spec.submodules
    assert sub.input_layernorm is TorchNorm and sub.pre_mlp_layernorm is TorchNorm
    assert sub.self_attention.submodules.q_layernorm is TorchNorm
    moe = local_layer_spec(num_experts=4).submodules
    assert moe.pre_mlp_layernorm is TorchNorm
