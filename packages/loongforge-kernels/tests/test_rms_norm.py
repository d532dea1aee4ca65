from __future__ import annotations

import pytest
import torch
from loongforge_kernels import RMSNorm, rms_norm
from loongforge_kernels.references import rms_norm_ref

from .conftest import assert_close, run_both

# (x dtype, weight dtype): megatron keeps an fp32 weight with bf16 activations.
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)]


@pytest.mark.parametrize("shape", [(1, 1000), (4, 3, 64), (5, 4001), (2, 2048)])
@pytest.mark.parametrize("dtypes", DTYPES, ids=lambda d: f"{str(d[0])[6:]}-{str(d[1])[6:]}")
@pytest.mark.parametrize("zero_centered", [False, True])
def test_rms_norm_matches_reference(triton_cpu, shape, dtypes, zero_centered):
    xd, wd = dtypes
    torch.manual_seed(0)
    x = torch.randn(shape).to(xd)
    w = (torch.randn(shape[-1]) * 0.1 + (0.0 if zero_centered else 1.0)).to(wd)
    (out_t, out_r), grads = run_both(
        lambda a, b: rms_norm(a, b, 1e-5, zero_centered_gamma=zero_centered, impl="triton"),
        lambda a, b: rms_norm_ref(a, b, 1e-5, zero_centered_gamma=zero_centered),
        [x, w],
    )
    assert out_t.dtype == xd
    assert_close(out_t, out_r, xd, name="y")
    (dx_t, dx_r), (dw_t, dw_r) = grads
    assert dx_t.dtype == xd and dw_t.dtype == wd
    assert_close(dx_t, dx_r, xd, scale=2, name="dx")
    # dw sums over rows: allow for the reduction order and, for a bf16 weight, its rounding
    assert_close(dw_t, dw_r, wd, scale=10, name="dw")


def test_rms_norm_module(triton_cpu):
    m = RMSNorm(96, eps=1e-6, impl="triton")
    x = torch.randn(3, 96, requires_grad=True)
    m(x).sum().backward()
    assert m.weight.grad is not None and x.grad is not None
    assert_close(m(x), rms_norm_ref(x, m.weight, 1e-6), torch.float32)
