from __future__ import annotations

import pytest
import torch
from loongforge.checkpoint import (
    ColumnParallel,
    Expert,
    FusedQKV,
    GatedMLP,
    Replicated,
    RowParallel,
    Shared,
    VocabParallel,
    check_shapes,
    padded_vocab_size,
)
from loongforge.errors import CheckpointError


def _roundtrip(rule, hf, tp):
    shards = [rule.to_megatron(hf, tp_rank=r, tp_size=tp) for r in range(tp)]
    back = rule.to_hf(shards)
    assert back.keys() == hf.keys()
    for k in hf:
        assert torch.equal(back[k], hf[k])
    return shards


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_simple_rules_roundtrip_and_shapes(tp):
    w = torch.randn(8, 12)
    assert all(s.shape == (8, 12) for s in _roundtrip(Replicated(), {"t": w}, tp))
    assert all(s.shape == (8 // tp, 12) for s in _roundtrip(ColumnParallel(), {"t": w}, tp))
    assert all(s.shape == (8, 12 // tp) for s in _roundtrip(RowParallel(), {"t": w}, tp))
    shards = _roundtrip(GatedMLP(), {"gate": w, "up": w + 1}, tp)
    assert torch.equal(shards[0], torch.cat([w[: 8 // tp], (w + 1)[: 8 // tp]]))


@pytest.mark.parametrize("tp", [1, 2])
def test_shared_holds_one_copy_and_refuses_copies_that_differ(tp):
    w = torch.randn(6, 4)
    rule = Shared(copies=3)
    assert rule.roles == ("0", "1", "2")
    shards = _roundtrip(rule, {r: w.clone() for r in rule.roles}, tp)
    assert all(torch.equal(s, w) for s in shards)
    assert rule.shard_shape({r: (6, 4) for r in rule.roles}, tp_size=tp) == (6, 4)
    with pytest.raises(CheckpointError, match="copy 2 differs from copy 0"):
        rule.to_megatron({"0": w, "1": w, "2": w + 1e-6}, tp_rank=0, tp_size=tp)


def test_vocab_parallel_pads_and_strips():
    w = torch.randn(100, 4)
    rule = VocabParallel(vocab_size=100, divisible_by=16)
    assert padded_vocab_size(100, divisible_by=16, tp_size=2) == 128
    shards = _roundtrip(rule, {"t": w}, 2)
    assert [s.shape[0] for s in shards] == [64, 64]
    assert torch.equal(shards[1][36:], torch.zeros(28, 4))
    assert rule.shard_shape({"t": (100, 4)}, tp_size=4) == (64 // 2, 4)


@pytest.mark.parametrize("tp", [1, 2])
def test_fused_qkv_gqa_interleave(tp):
    heads, groups, d, hidden = 4, 2, 3, 5
    q = torch.arange(heads * d * hidden, dtype=torch.float32).reshape(heads * d, hidden)
    k = -torch.arange(groups * d * hidden, dtype=torch.float32).reshape(groups * d, hidden) - 1
    v = k - 1000
    rule = FusedQKV(num_heads=heads, num_query_groups=groups, head_dim=d)
    shards = _roundtrip(rule, {"q": q, "k": k, "v": v}, tp)
    full = torch.cat(shards)
    # group 0 = [q heads 0,1 ; k head 0 ; v head 0], group 1 = [q heads 2,3 ; k1 ; v1]
    expect = torch.cat([q[0:6], k[0:3], v[0:3], q[6:12], k[3:6], v[3:6]])
    assert torch.equal(full, expect)
    # biases (1-D) work the same way
    _roundtrip(rule, {"q": q[:, 0], "k": k[:, 0], "v": v[:, 0]}, tp)


def test_fused_qkv_rejects_bad_shapes():
    rule = FusedQKV(num_heads=4, num_query_groups=2, head_dim=3)
    with pytest.raises(CheckpointError, match="k has shape"):
        rule.to_megatron({"q": torch.zeros(12, 5), "k": torch.zeros(3, 5), "v": torch.zeros(6, 5)},
                         tp_rank=0, tp_size=1)
    with pytest.raises(CheckpointError, match="groups % tp"):
        rule.to_megatron({"q": torch.zeros(12, 5), "k": torch.zeros(6, 5), "v": torch.zeros(6, 5)},
                         tp_rank=0, tp_size=4)


def test_expert_placement():
    rule = Expert(GatedMLP(), num_experts=8)
    assert rule.roles == ("gate", "up")
    assert [rule.locate(e, ep_size=4) for e in (0, 1, 2, 7)] == [(0, 0), (0, 1), (1, 0), (3, 1)]
    assert rule.global_index(1, ep_rank=3, ep_size=4) == 7
    with pytest.raises(CheckpointError, match="not divisible by ep=3"):
        rule.locate(0, ep_size=3)


def test_uneven_split_is_an_error():
    with pytest.raises(CheckpointError, match="not divisible by 2"):
        ColumnParallel().to_megatron({"t": torch.zeros(3, 2)}, tp_rank=0, tp_size=2)


def test_check_shapes_names_the_tensor():
    exp = {"a": (1,), "b": (2, 2)}
    with pytest.raises(CheckpointError, match="missing tensor 'b'"):
        check_shapes(exp, {"a": (1,)})
    with pytest.raises(CheckpointError, match="unexpected tensor 'c'"):
        check_shapes(exp, {"a": (1,), "b": (2, 2), "c": (3,)})
    with pytest.raises(CheckpointError, match=r"tensor 'b' has shape \(2, 3\)"):
        check_shapes(exp, {"a": (1,), "b": (2, 3)})


@pytest.mark.parametrize("etp", [1, 2])
def test_fused_experts_split_per_expert_and_back_in_either_orientation(etp):
    """transformers' fused experts: gate_up [E, 2I, H] (its modules' layout) or [E, H, 2I] (the published
    checkpoints') -> each expert's [gate ; up] over ETP; down [E, H, I] / [E, I, H] -> RowParallel. Export writes
    the [in, out] layout, and a square expert [out, in] (the only one transformers 5 reads it as)."""
    from loongforge.checkpoint import FusedExperts, NameMap
    from loongforge.checkpoint.name_map import Entry

    e, h, i = 4, 8, 6
    gate_up, down = torch.randn(e, 2 * i, h), torch.randn(e, h, i)
    fc1 = FusedExperts(GatedMLP(), e, out_features=2 * i, in_features=h)
    fc2 = FusedExperts(RowParallel(), e, out_features=h, in_features=i)
    for fused, rule, inner in ((gate_up, fc1, GatedMLP()), (down, fc2, RowParallel())):
        for hf in (fused, fused.transpose(1, 2).contiguous()):
            rows = []
            for x in range(e):
                bound = rule.for_expert(x)
                shards = [bound.to_megatron({"t": hf}, tp_rank=r, tp_size=etp) for r in range(etp)]
                parts = torch.chunk(fused[x], len(inner.roles))
                want = [inner.to_megatron(dict(zip(inner.roles, parts, strict=True)), tp_rank=r, tp_size=etp)
                        for r in range(etp)]
                assert all(torch.equal(a, b) for a, b in zip(shards, want, strict=True))
                rows.append(bound.to_hf(shards)["t"])
            assert torch.equal(torch.cat(rows), fused.transpose(1, 2))  # the published [in, out] layout
    with pytest.raises(CheckpointError, match=r"expected \[4, 12, 8\] or \[4, 8, 12\]"):
        fc1.for_expert(0).to_megatron({"t": torch.randn(e, 12, 9)}, tp_rank=0, tp_size=1)
    square = FusedExperts(GatedMLP(), e, out_features=h, in_features=h).for_expert(1)
    w = torch.randn(e, h, h)
    assert torch.equal(square.to_hf([square.to_megatron({"t": w}, tp_rank=0, tp_size=1)])["t"][0], w[1])
    # the name map: one HF name per layer (no expert wildcard), the experts in contiguous blocks over EP
    nm = NameMap([Entry("l.*.experts.*.fc1", "m.*.experts.gate_up_proj", fc1)])
    params = list(nm.expand(num_layers=1, num_experts=e, ep=2))
    assert [(p.megatron, p.hf["t"], p.where.ep_rank, p.rule.hf_row) for p in params] == [
        (f"l.0.experts.{x % 2}.fc1", "m.0.experts.gate_up_proj", x // 2, x) for x in range(e)]
