from __future__ import annotations

import pytest
import torch
from loongforge_kernels import moe_router_topk
from loongforge_kernels.references import moe_router_topk_ref

from .conftest import assert_close

# (tokens, experts, topk, score function, pre_softmax, groups, group_topk, scaling, expert bias)
CASES = [
    (7, 6, 1, "softmax", False, None, None, None, False),  # top-1, 6 experts
    (33, 12, 8, "softmax", False, None, None, None, False),  # top-8 of 12 (not a power of two)
    (9, 10, 3, "softmax", True, None, None, 1.5, False),  # softmax before the top-k, k = 3
    (17, 10, 4, "sigmoid", False, 5, 2, 2.5, True),  # DeepSeek-style: 5 groups of 2, 2 kept, bias, scaling
    (5, 128, 8, "sigmoid", False, 8, 4, 2.5, True),  # DeepSeek-V3's 256 / 8 / 4 shape, halved
    (3, 24, 1, "sigmoid", False, None, None, None, False),  # sigmoid top-1: not renormalised
]


def _inputs(n_tok, n_exp, with_bias, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n_tok, n_exp, generator=g).to(dtype)
    bias = 0.1 * torch.randn(n_exp, generator=g) if with_bias else None
    return logits, bias


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}E{c[1]}k{c[2]}-{c[3]}{'-pre' if c[4] else ''}"
                         f"{'-g' + str(c[5]) if c[5] else ''}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_matches_reference(triton_cpu, case, dtype):
    n_tok, n_exp, topk, score, pre, groups, gtopk, scale, with_bias = case
    logits, bias = _inputs(n_tok, n_exp, with_bias, dtype)
    kw = dict(topk=topk, score_function=score, pre_softmax=pre, num_groups=groups, group_topk=gtopk,
              scaling_factor=scale, expert_bias=bias)
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    p_t, i_t = moe_router_topk(a, impl="triton", **kw)
    p_r, i_r = moe_router_topk_ref(b, **kw)
    assert torch.equal(i_t, i_r)
    assert p_t.dtype == dtype
    assert_close(p_t, p_r, dtype, name="probs")
    dp = torch.randn(p_r.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    p_t.backward(dp)
    p_r.backward(dp)
    assert_close(a.grad, b.grad, dtype, name="dlogits")


def test_reference_matches_megatron_routing():
    """The reference is megatron-core's own routing (dense output), case by case."""
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    for n_tok, n_exp, topk, score, pre, groups, gtopk, scale, with_bias in CASES:
        logits, bias = _inputs(n_tok, n_exp, with_bias, torch.float32)
        p_m, i_m = topk_routing_with_score_function(logits, topk, use_pre_softmax=pre, num_groups=groups,
                                                    group_topk=gtopk, scaling_factor=scale, score_function=score,
                                                    expert_bias=bias, dense_output=True)
        p_r, i_r = moe_router_topk_ref(logits, topk=topk, score_function=score, pre_softmax=pre, num_groups=groups,
                                       group_topk=gtopk, scaling_factor=scale, expert_bias=bias)
        # NOTE: megatron's group-limited top-k is unsorted; compare as sets per token
        order_m, order_r = i_m.sort(-1), i_r.sort(-1)
        assert torch.equal(order_m.values, order_r.values)
        torch.testing.assert_close(p_m.gather(1, order_m.indices), p_r.gather(1, order_r.indices))


def test_router_rejects_bad_arguments():
    logits = torch.randn(4, 6)
    with pytest.raises(ValueError, match="topk"):
        moe_router_topk(logits, topk=7, impl="torch")
    with pytest.raises(ValueError, match="group"):
        moe_router_topk(logits, topk=2, num_groups=4, group_topk=2, impl="torch")
    with pytest.raises(ValueError, match="expert_bias"):
        moe_router_topk(logits, topk=2, expert_bias=torch.zeros(6), impl="torch")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", [CASES[1], CASES[4], (8192, 128, 8, "softmax", False, None, None, None, False)])
def test_router_cuda_matches_reference(case):
    n_tok, n_exp, topk, score, pre, groups, gtopk, scale, with_bias = case
    logits, bias = _inputs(n_tok, n_exp, with_bias, torch.float32)
    logits, bias = logits.cuda(), (bias.cuda() if bias is not None else None)
    kw = dict(topk=topk, score_function=score, pre_softmax=pre, num_groups=groups, group_topk=gtopk,
              scaling_factor=scale, expert_bias=bias)
    p_t, i_t = moe_router_topk(logits, impl="triton", **kw)
    p_r, i_r = moe_router_topk_ref(logits, **kw)
    assert torch.equal(i_t, i_r)
    assert_close(p_t, p_r, torch.float32, name="probs")
