"""Packed sequences with real cu_seqlens (THD) on the loongforge spec: the per-sample attention equals separate
sequences, samples never see each other, no attention spans more than one sample, context parallelism (2 gloo
ranks) equals one process, and bad boundaries are refused in one line."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from loongforge_megatron.engine.packing import check_cu_seqlens, collate, cp_indices, packed_seq_params
from loongforge_megatron.layers.varlen import varlen_attention

LENGTHS = (12, 20, 8, 24)  # four samples packed into 64 tokens; every length a multiple of 2 * cp = 4
VOCAB = 128


def _dense_block_causal(q, k, v, bounds, *, causal):
    """The reference: one SDPA over the whole pack with a block-diagonal (causal) mask."""
    t = q.shape[0]
    doc = torch.repeat_interleave(torch.arange(len(bounds) - 1), torch.tensor(bounds).diff())
    allowed = doc[:, None] == doc[None, :]
    if causal:
        allowed &= torch.ones(t, t, dtype=torch.bool).tril()
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=allowed, enable_gqa=True)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("causal", [True, False])
def test_segment_attention_equals_block_diagonal_mask(causal):
    g = torch.Generator().manual_seed(0)
    bounds = [0, 5, 12, 16]
    q, k, v = (torch.randn(16, h, 8, generator=g) for h in (4, 2, 2))  # GQA: 4 query heads, 2 key heads
    cu = torch.tensor(bounds, dtype=torch.int32)
    got = varlen_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=7, max_seqlen_k=7, causal=causal)
    torch.testing.assert_close(got, _dense_block_causal(q, k, v, bounds, causal=causal), rtol=1e-6, atol=1e-6)


def test_short_causal_query_segment_is_aligned_to_the_end_of_its_keys():
    """A query chunk of a sample (context parallelism) sees the keys up to its own positions."""
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(8, 2, 8, generator=g), torch.randn(8, 2, 8, generator=g), torch.randn(8, 2, 8, generator=g)
    full = _dense_block_causal(q, k, v, [0, 8], causal=True)
    cu_q, cu_k = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 8], dtype=torch.int32)
    last3 = varlen_attention(q[5:], k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=3, max_seqlen_k=8,
                             causal=True)
    torch.testing.assert_close(last3, full[5:], rtol=1e-6, atol=1e-6)


def test_bad_cu_seqlens_are_one_line_errors():
    for bad, match in (([1, 4], "must start at 0"), ([0, 6, 3], "non-decreasing"), ([0, 4, 8], "holds 10 tokens"),
                       (torch.tensor([0.0, 10.0]), "integer tensor")):
        with pytest.raises(ValueError, match=match) as info:
            check_cu_seqlens(bad, total=10)
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="sample length 6 is not a multiple of 4"):
        packed_seq_params([0, 4, 10, 12], multiple_of=4)
    from loongforge_megatron.engine.batch import cp_slice

    batch = collate([{"tokens": torch.zeros(12, dtype=torch.long), "cu_seqlens": torch.tensor([0, 6, 12])}])
    with pytest.raises(ValueError, match="not a multiple of 4"):
        cp_slice(batch, cp_size=2, cp_rank=0)


def test_collate_makes_one_thd_row_and_cp_keeps_each_samples_mirrored_chunks():
    rows = [{"tokens": torch.arange(8), "position_ids": torch.tensor([0, 1, 2, 3, 0, 1, 2, 3]),
             "cu_seqlens": torch.tensor([0, 4, 8]), "num_tokens": torch.tensor(7)},
            {"tokens": torch.arange(8, 16), "position_ids": torch.arange(8), "cu_seqlens": torch.tensor([0, 8]),
             "num_tokens": torch.tensor(8)}]
    batch = collate(rows)
    assert batch["tokens"].shape == (1, 16) and batch["real_tokens"] == 15
    params = batch["packed_seq_params"]
    assert params.qkv_format == "thd" and params.cu_seqlens_q.tolist() == [0, 4, 8, 16] and params.max_seqlen_q == 8
    parts = [cp_indices([0, 4, 8, 16], cp_size=2, cp_rank=r).tolist() for r in (0, 1)]
    assert parts == [[0, 3, 4, 7, 8, 9, 14, 15], [1, 2, 5, 6, 10, 11, 12, 13]]


# ---------------------------------------------------------------- the model, in ranks
def _packed_gpt(*, rank: int, world: int) -> dict[str, Any]:
    """Per-token losses and gradients of a packed batch on a 4-layer GPT of the loongforge spec (cp = world)."""
    import torch.distributed as dist
    from loongforge.accelerator.cpu import CpuAccelerator
    from loongforge.parallel.plan import resolve_plan
    from loongforge_megatron import engine
    from loongforge_megatron.device_adapters import adapted
    from loongforge_megatron.engine.model import build_chunks
    from loongforge_megatron.engine.step import model_inputs
    from loongforge_megatron.engine.weights import seeded_init
    from loongforge_megatron.layers import loongforge_layer_spec, prepare_config

    from .test_parallel_layouts import transformer_config

    acc, total = CpuAccelerator(), sum(LENGTHS)
    plan = resolve_plan(world_size=world, cp=world)
    bounds = [0]
    for n in LENGTHS:
        bounds.append(bounds[-1] + n)
    with adapted(acc):
        engine.initialize(plan, accelerator=acc, seed=7)
        config = prepare_config(transformer_config(plan, kind="dense"))
        config.context_parallel_size = plan.cp
        model = build_chunks(transformer_config=config, layer_spec=loongforge_layer_spec(accelerator=acc),
                             vocab_size=VOCAB, max_sequence_length=total)[0]
        seeded_init([model], config=config, seed=5)
        g = torch.Generator().manual_seed(3)
        tokens, labels = torch.randint(0, VOCAB, (total,), generator=g), torch.randint(0, VOCAB, (total,), generator=g)
        positions = torch.cat([torch.arange(n) for n in LENGTHS])

        def losses(tok, lab, *, packed=True, backward=False):
            n = tok.numel()
            batch = {"tokens": tok[None], "labels": lab[None], "loss_mask": torch.ones(1, n),
                     "position_ids": positions[None] if packed else torch.arange(n)[None]}
            if packed:
                batch["packed_seq_params"] = packed_seq_params(bounds, total=n)
            batch = model_inputs(batch, model)
            out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                        packed_seq_params=batch.get("packed_seq_params"))
            if backward:
                out.sum().backward()
            return out.detach()[0]

        seen: list[int] = []  # the longest sequence any SDPA call attended over
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def spy(q, k, v, *args, **kwargs):
            seen.append(max(q.shape[-2], k.shape[-2]))
            return sdpa(q, k, v, *args, **kwargs)

        torch.nn.functional.scaled_dot_product_attention = spy
        try:
            local = losses(tokens, labels, backward=True)
        finally:
            torch.nn.functional.scaled_dot_product_attention = sdpa
        out: dict[str, Any] = {"longest_attention": max(seen)}
        grads = {name: p.grad.clone() for name, p in model.named_parameters()
                 if name.endswith(("linear_qkv.weight", "linear_fc1.weight"))}
        index = cp_indices(bounds, cp_size=world, cp_rank=rank)
        full = torch.zeros(total).index_copy_(0, index, local)
        if world > 1:
            dist.all_reduce(full)  # every rank's tokens in their global places
            for gr in grads.values():
                dist.all_reduce(gr)  # each rank's gradient is its tokens' part
        out["losses"], out["grads"] = full, grads
        if world == 1:
            with torch.no_grad():
                separate = []
                for a, b in zip(bounds, bounds[1:], strict=False):
                    separate.append(losses(tokens[a:b], labels[a:b], packed=False))
                out["separate"] = torch.cat(separate)
                perturbed = tokens.clone()
                perturbed[bounds[2] : bounds[3]] = (perturbed[bounds[2] : bounds[3]] + 1) % VOCAB  # sample 2 only
                out["perturbed"] = losses(perturbed, labels)
        engine.destroy(process_group=True)
    return out


@pytest.fixture(scope="module")
def packed_runs(tmp_path_factory, ranks):
    tmp = tmp_path_factory.mktemp("varlen")
    return {"one": ranks(_packed_gpt, world=1, out=tmp / "one")[0], "cp2": ranks(_packed_gpt, world=2, out=tmp / "cp2")}


def test_packed_losses_equal_separate_samples(packed_runs):
    one = packed_runs["one"]
    torch.testing.assert_close(one["losses"], one["separate"], rtol=1e-5, atol=1e-5)
    # no attention call spans more than one sample (no mask over the whole pack)
    assert one["longest_attention"] == max(LENGTHS)


def test_perturbing_one_sample_leaves_the_others_unchanged(packed_runs):
    one = packed_runs["one"]
    bounds = torch.tensor((0, *LENGTHS)).cumsum(0).tolist()
    inside = torch.zeros(bounds[-1], dtype=torch.bool)
    inside[bounds[2] : bounds[3]] = True
    assert torch.equal(one["perturbed"][~inside], one["losses"][~inside])
    assert not torch.allclose(one["perturbed"][inside], one["losses"][inside])


def test_cp2_packed_equals_one_process(packed_runs):
    one = packed_runs["one"]
    for rank, got in enumerate(packed_runs["cp2"]):
        torch.testing.assert_close(got["losses"], one["losses"], rtol=1e-5, atol=1e-5, msg=f"rank {rank} losses")
        for name, grad in one["grads"].items():
            torch.testing.assert_close(got["grads"][name], grad, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")
        # a CP rank's query chunk attends at most the keys of its own sample
        assert got["longest_attention"] <= max(LENGTHS)
