"""The compiled Triton kernels on a CUDA device at training-like shapes (skipped without CUDA)."""

from __future__ import annotations

import loongforge_kernels as lk
import pytest
import torch
from loongforge_kernels import references as ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# (atol, rtol) on GPU: bf16 grads of long reductions get a wider band.
BF16 = dict(atol=3e-2, rtol=3e-2)


def _grads(fn, inputs, *, seed=0):
    leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out = fn(*leaves)
    g = torch.randn(out.shape, device=out.device, generator=torch.Generator(out.device).manual_seed(seed))
    out.backward(g.to(out.dtype))
    return out, [x.grad for x in leaves if x.grad is not None]


def _check(fn_t, fn_r, inputs, *, ref_fp32=False, **tol):
    """Kernel vs reference, outputs and input grads; ``ref_fp32`` runs the reference on fp32 copies of the
    inputs (for references whose own bf16 backward accumulates in bf16, e.g. index_select's index_add)."""
    out_t, g_t = _grads(fn_t, inputs)
    ref_inputs = [x.float() if ref_fp32 and x.is_floating_point() else x for x in inputs]
    out_r, g_r = _grads(fn_r, ref_inputs)
    torch.testing.assert_close(out_t.float(), out_r.float(), **tol)
    for a, b in zip(g_t, g_r, strict=True):
        torch.testing.assert_close(a.float(), b.float(), **tol)


@pytest.mark.parametrize("hidden", [2048, 4096, 4001])
def test_rms_norm_gpu(hidden):
    x = torch.randn(4096, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(hidden, device="cuda") + 0.5
    _check(lambda a, b: lk.rms_norm(a, b, impl="triton"), ref.rms_norm_ref, [x, w], atol=5e-2, rtol=2e-2)


@pytest.mark.parametrize("ffn", [8192, 14336, 1000])
def test_swiglu_gpu(ffn):
    x = torch.randn(2048, 2 * ffn, device="cuda", dtype=torch.bfloat16)
    _check(lambda a: lk.swiglu(a, impl="triton"), ref.swiglu_ref, [x], **BF16)


def test_rope_gpu():
    x = torch.randn(1024, 2, 32, 128, device="cuda", dtype=torch.bfloat16)
    freqs = torch.rand(1024, 1, 1, 64, device="cuda") * 100
    _check(lambda a: lk.apply_rope(a, freqs, impl="triton"), lambda a: ref.rope_ref(a, freqs), [x], **BF16)
    cu = torch.tensor([0, 100, 1100, 2048], device="cuda", dtype=torch.int32)
    xt = x.view(2048, 32, 128)
    _check(
        lambda a: lk.apply_rope(a, freqs, cu_seqlens=cu, impl="triton"),
        lambda a: ref.rope_ref(a, freqs, cu_seqlens=cu),
        [xt],
        **BF16,
    )


def test_flce_gpu():
    h = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(32000, 1024, device="cuda", dtype=torch.bfloat16) / 32
    labels = torch.randint(0, 32000, (2048,), device="cuda")
    labels[::7] = -100
    _check(
        lambda a, b: lk.fused_linear_cross_entropy(a, b, labels, impl="triton"),
        lambda a, b: ref.linear_cross_entropy_ref(a, b, labels),
        [h, w],
        atol=2e-2,
        rtol=5e-2,
    )


def test_moe_gpu():
    t = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
    idx = torch.rand(4096, 64, device="cuda").topk(8, dim=-1).indices
    probs = torch.rand(4096, 8, device="cuda").softmax(-1)
    _check(
        lambda a: lk.moe_permute(a, idx, num_experts=64, impl="triton")[0],
        lambda a: lk.moe_permute(a, idx, num_experts=64, impl="torch")[0],
        [t],
        ref_fp32=True,
        **BF16,
    )
    _, row_id, _ = lk.moe_permute(t, idx, num_experts=64)
    p = torch.randn(4096 * 8, 2048, device="cuda", dtype=torch.bfloat16)
    _check(
        lambda a, b: lk.moe_unpermute(a, row_id, b, impl="triton"),
        lambda a, b: ref.moe_unpermute_ref(a, row_id, b),
        [p, probs],
        **BF16,
    )
