from __future__ import annotations

import pytest
from loongforge.checkpoint import ColumnParallel, Entry, Expert, GatedMLP, NameMap, PipelineLayout, Replicated
from loongforge.errors import CheckpointError


def test_pipeline_layout_plain_and_interleaved():
    lay = PipelineLayout(8, pp=2)
    assert [lay.locate(i) for i in (0, 3, 4, 7)] == [(0, 0, 0), (0, 0, 3), (1, 0, 0), (1, 0, 3)]
    # vpp=2: 4 chunks of 2 layers; stage 0 holds chunks 0 and 2 (layers 0-1, 4-5)
    lay = PipelineLayout(8, pp=2, vpp=2)
    assert list(lay.layers_of(pp_rank=0, vpp_rank=0)) == [0, 1]
    assert list(lay.layers_of(pp_rank=1, vpp_rank=0)) == [2, 3]
    assert list(lay.layers_of(pp_rank=0, vpp_rank=1)) == [4, 5]
    assert lay.locate(5) == (0, 1, 1)
    assert lay.global_layer(1, pp_rank=1, vpp_rank=1) == 7
    with pytest.raises(CheckpointError, match=r"6 layers, not divisible by pp \* vpp = 4 \* 1"):
        PipelineLayout(6, pp=4)


def _map():
    return NameMap([
        Entry("emb", "model.embed", Replicated(), stage="first"),
        Entry("decoder.layers.*.fc.weight", "model.layers.*.fc.weight", ColumnParallel()),
        Entry("decoder.layers.*.experts.*.fc1", {"gate": "model.layers.*.e.*.g", "up": "model.layers.*.e.*.u"},
              Expert(GatedMLP(), 4), layers=lambda i: i % 2 == 1),
        Entry("head", "lm_head", Replicated(), stage="last"),
        Entry("tied", "model.embed", Replicated(), stage="last_tied", export=False),
    ])


def test_expand_places_layers_and_experts():
    params = list(_map().expand(num_layers=4, num_experts=4, pp=2, ep=2))
    names = [(p.megatron, p.where.pp_rank, p.where.ep_rank) for p in params]
    assert names[0] == ("emb", 0, None)
    assert ("decoder.layers.1.fc.weight", 1, None) in names  # global layer 3 -> stage 1, local 1
    assert ("decoder.layers.1.experts.1.fc1", 0, 1) in names  # layer 1, expert 3 -> ep1 local 1
    expert = next(p for p in params if p.megatron == "decoder.layers.1.experts.1.fc1" and p.where.pp_rank == 0
                  and p.where.ep_rank == 1)
    assert expert.hf == {"gate": "model.layers.1.e.3.g", "up": "model.layers.1.e.3.u"}
    assert not any("experts" in p.megatron and p.hf["gate"].startswith("model.layers.2.") for p in params)
    assert ("tied", 1, None) in names
    # tied copy exists only when the head is on another stage
    assert "tied" not in [p.megatron for p in _map().expand(num_layers=4, num_experts=4)]


def test_for_rank_filters():
    got = _map().for_rank(num_layers=4, num_experts=4, pp=2, ep=2, pp_rank=1, ep_rank=0)
    names = {p.megatron for p in got}
    assert "emb" not in names and "head" in names
    assert {n for n in names if "experts" in n} == {"decoder.layers.1.experts.0.fc1", "decoder.layers.1.experts.1.fc1"}


def test_pipeline_layout_uneven():
    # 6 layers, pp=3, first stage 1, last stage 1: the middle stage holds 4
    lay = PipelineLayout(6, pp=3, first=1, last=1)
    assert [lay.locate(i) for i in (0, 1, 4, 5)] == [(0, 0, 0), (1, 0, 0), (1, 0, 3), (2, 0, 0)]
    assert list(lay.layers_of(pp_rank=1)) == [1, 2, 3, 4]
    params = [p for p in _map().expand(num_layers=4, num_experts=4, pp=2, first_stage_layers=1)
              if p.megatron.endswith("fc.weight")]
    assert [(p.hf[next(iter(p.hf))], p.megatron, p.where.pp_rank) for p in params] == [
        ("model.layers.0.fc.weight", "decoder.layers.0.fc.weight", 0),
        ("model.layers.1.fc.weight", "decoder.layers.0.fc.weight", 1),
        ("model.layers.2.fc.weight", "decoder.layers.1.fc.weight", 1),
        ("model.layers.3.fc.weight", "decoder.layers.2.fc.weight", 1),
    ]
    with pytest.raises(CheckpointError, match="must add up"):
        PipelineLayout(6, pp=2, first=2, last=2)
