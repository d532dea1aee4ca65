"""The gated delta rule and its causal convolution (torch path) equal transformers' torch fallback, and packed
samples equal each sample run alone (state and convolution window reset at every boundary)."""

from __future__ import annotations

import torch
from loongforge_megatron.layers.gated_delta import causal_conv1d, gated_delta_rule


def _inputs(t: int, *, seed: int = 0, hk: int = 2, hv: int = 4, dk: int = 8, dv: int = 6):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, t, hk, dk, generator=g) for _ in range(2))
    v = torch.randn(1, t, hv, dv, generator=g)
    decay = -torch.rand(1, t, hv, generator=g)
    beta = torch.rand(1, t, hv, generator=g)
    return q, k, v, decay, beta


def test_rule_equals_transformers_chunked_and_recurrent():
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    q, k, v, decay, beta = _inputs(150)  # NOTE: more than two chunks of 64, the last one partial
    ours = gated_delta_rule(q, k, v, g=decay, beta=beta)
    ref, _ = torch_chunk_gated_delta_rule(q, k, v, g=decay, beta=beta, use_qk_l2norm_in_kernel=True)
    rec, _ = torch_recurrent_gated_delta_rule(q, k, v, g=decay, beta=beta, use_qk_l2norm_in_kernel=True)
    assert torch.equal(ours, ref)
    torch.testing.assert_close(ours, rec, rtol=1e-4, atol=1e-5)


def test_packed_samples_equal_each_alone():
    lengths = [70, 5, 1, 40]
    parts = [_inputs(n, seed=i) for i, n in enumerate(lengths)]
    packed = [torch.cat([p[j] for p in parts], dim=1) for j in range(5)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    q, k, v, decay, beta = packed
    out = gated_delta_rule(q, k, v, g=decay, beta=beta, cu_seqlens=cu)
    alone = torch.cat([gated_delta_rule(p[0], p[1], p[2], g=p[3], beta=p[4]) for p in parts], dim=1)
    torch.testing.assert_close(out, alone, rtol=0, atol=0)
    x = torch.randn(1, sum(lengths), 12)
    w = torch.randn(12, 4)
    conv = causal_conv1d(x, w, cu_seqlens=cu)
    bounds = cu.tolist()
    conv_alone = torch.cat([causal_conv1d(x[:, a:b], w) for a, b in zip(bounds, bounds[1:], strict=False)], dim=1)
    assert torch.equal(conv, conv_alone)


def test_conv_equals_transformers():
    from transformers.models.qwen3_next.modeling_qwen3_next import causal_conv1d_fn

    x, w = torch.randn(2, 9, 12), torch.randn(12, 4)
    ref = causal_conv1d_fn(x.transpose(1, 2), w, None, activation="silu").transpose(1, 2)
    assert torch.equal(causal_conv1d(x, w), ref)
