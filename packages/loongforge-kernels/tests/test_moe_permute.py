from __future__ import annotations

import pytest
import torch
from loongforge_kernels import moe_permute, moe_unpermute
from loongforge_kernels.references import moe_row_id_map, moe_unpermute_ref

from .conftest import assert_close, run_both


def _routing(n_tok: int, n_exp: int, topk: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(n_exp, generator=gen)[:topk] for _ in range(n_tok)])
    probs = torch.rand(n_tok, topk, generator=gen)
    return idx, probs / probs.sum(-1, keepdim=True)


def test_permute_sorts_by_expert_stably():
    idx = torch.tensor([[2, 0], [0, 1], [2, 1]])
    tokens = torch.arange(3.0)[:, None].expand(3, 4).contiguous()
    out, row_id, per_exp = moe_permute(tokens, idx, num_experts=4, impl="torch")
    assert out[:, 0].tolist() == [
        0.0,
        1.0,
        1.0,
        2.0,
        0.0,
        2.0,
    ]  # expert 0: t0 t1, expert 1: t1 t2, expert 2: t0 t2
    assert per_exp.tolist() == [2, 2, 2, 0]
    assert torch.equal(row_id, moe_row_id_map(idx))


@pytest.mark.parametrize("n_tok,hidden,n_exp,topk", [(1, 64, 4, 1), (9, 100, 4, 2), (13, 1000, 8, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_permute_matches_reference(triton_cpu, n_tok, hidden, n_exp, topk, dtype):
    idx, _ = _routing(n_tok, n_exp, topk)
    tokens = torch.randn(n_tok, hidden).to(dtype)
    (out_t, out_r), [(dx_t, dx_r)] = run_both(
        lambda t: moe_permute(t, idx, num_experts=n_exp, impl="triton")[0],
        lambda t: moe_permute(t, idx, num_experts=n_exp, impl="torch")[0],
        [tokens],
    )
    assert torch.equal(out_t, out_r)  # a pure copy
    assert_close(dx_t, dx_r, dtype, name="dtokens")


@pytest.mark.parametrize("n_tok,hidden,n_exp,topk", [(1, 64, 4, 1), (9, 100, 4, 2), (13, 1000, 8, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_probs", [True, False])
def test_unpermute_matches_reference(triton_cpu, n_tok, hidden, n_exp, topk, dtype, with_probs):
    idx, probs = _routing(n_tok, n_exp, topk)
    row_id = moe_row_id_map(idx)
    permuted = torch.randn(n_tok * topk, hidden).to(dtype)
    inputs = [permuted, probs] if with_probs else [permuted]
    (out_t, out_r), grads = run_both(
        lambda p, *q: moe_unpermute(p, row_id, q[0] if q else None, impl="triton"),
        lambda p, *q: moe_unpermute_ref(p, row_id, q[0] if q else None),
        inputs,
    )
    assert_close(out_t, out_r, dtype, name="out")
    assert_close(grads[0][0], grads[0][1], dtype, name="dpermuted")
    if with_probs:
        assert grads[1][0].dtype == probs.dtype
        assert_close(grads[1][0], grads[1][1], torch.float32, scale=100, name="dprobs")


def test_roundtrip_is_identity(triton_cpu):
    idx, probs = _routing(7, 6, 2)
    tokens = torch.randn(7, 33)
    out, row_id, _ = moe_permute(tokens, idx, num_experts=6, impl="triton")
    back = moe_unpermute(out, row_id, probs, impl="triton")  # probs sum to 1 per token
    assert_close(back, tokens, torch.float32)


def _routing_with_drops(n_tok: int, n_exp: int, topk: int, seed: int = 0):
    """Routing where some slots are dropped (index -1), and token 0 routes nowhere at all."""
    idx, probs = _routing(n_tok, n_exp, topk, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    drop = torch.rand(n_tok, topk, generator=gen) < 0.3
    drop[0] = True
    return idx.masked_fill(drop, -1), probs.masked_fill(drop, 0.0)


@pytest.mark.parametrize("n_tok,hidden,n_exp,topk", [(5, 48, 7, 1), (11, 100, 12, 8), (6, 64, 3, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropped_slots_match_reference(triton_cpu, n_tok, hidden, n_exp, topk, dtype):
    idx, probs = _routing_with_drops(n_tok, n_exp, topk)
    tokens = torch.randn(n_tok, hidden).to(dtype)
    (out_t, out_r), [(dx_t, dx_r)] = run_both(
        lambda t: moe_permute(t, idx, num_experts=n_exp, impl="triton")[0],
        lambda t: moe_permute(t, idx, num_experts=n_exp, impl="torch")[0],
        [tokens],
    )
    assert torch.equal(out_t, out_r)
    kept = int((idx >= 0).sum())
    assert torch.count_nonzero(out_t[kept:]) == 0  # the tail rows belong to no slot
    assert_close(dx_t, dx_r, dtype, name="dtokens")
    _, row_id, per_exp = moe_permute(tokens, idx, num_experts=n_exp, impl="triton")
    assert per_exp.sum() == kept and bool((row_id[idx < 0] == -1).all())
    assert per_exp.tolist() == [int((idx == e).sum()) for e in range(n_exp)]
    permuted = torch.randn(n_tok * topk, hidden).to(dtype)
    (u_t, u_r), grads = run_both(
        lambda p, q: moe_unpermute(p, row_id, q, impl="triton"),
        lambda p, q: moe_unpermute_ref(p, row_id, q),
        [permuted, probs],
    )
    assert_close(u_t, u_r, dtype, name="out")
    assert torch.count_nonzero(u_t[0]) == 0  # routed nowhere: no expert output
    assert_close(grads[0][0], grads[0][1], dtype, name="dpermuted")
    assert_close(grads[1][0], grads[1][1], torch.float32, scale=100, name="dprobs")


@pytest.mark.parametrize("topk", [1, 8])
def test_odd_expert_counts_roundtrip(triton_cpu, topk):
    idx, probs = _routing(9, 10, topk, seed=3)  # 10 experts: not a power of two
    tokens = torch.randn(9, 40)
    out, row_id, per_exp = moe_permute(tokens, idx, num_experts=10, impl="triton")
    assert per_exp.sum() == 9 * topk
    assert_close(moe_unpermute(out, row_id, probs, impl="triton"), tokens, torch.float32)
