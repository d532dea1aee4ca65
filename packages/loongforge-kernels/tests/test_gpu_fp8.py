"""FP8 quantize kernels and FP8 linears on a CUDA GPU (SM >= 8.9; blockwise on Hopper): kernels bit-identical
to the reference, linear outputs and grads within stated error of an fp32 reference."""

from __future__ import annotations

import pytest
import torch
from loongforge_kernels import fp8_linear as fl
from loongforge_kernels.fp8_quant import GRANULARITIES, fp8_quantize

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs an FP8 GPU")]


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("shape", [(8192, 4096), (1000, 4001), (1, 129)])
def test_quantize_cuda_matches_reference(granularity, dtype, shape):
    x = (torch.randn(*shape, device="cuda") * torch.logspace(-6, 3, shape[1], device="cuda")).to(torch.bfloat16)
    got = fp8_quantize(x, granularity, dtype, layout="nt", impl="triton")
    want = fp8_quantize(x, granularity, dtype, layout="nt", impl="torch")
    for a, b in zip(got, want, strict=True):
        if a.dtype == dtype:
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        else:
            assert torch.equal(a, b)


@pytest.mark.parametrize("recipe,grad", [("tensorwise", "e4m3"), ("tensorwise", "e5m2"), ("rowwise", "e4m3"),
                                         ("rowwise", "e5m2"), ("blockwise", "e4m3")])
def test_fp8_linear_cuda(recipe, grad):
    reason = fl.fp8_unavailable_reason(recipe)
    if reason:
        pytest.skip(reason)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, 2048, 4096, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(6144, 4096, device="cuda", generator=gen) / 64).to(torch.bfloat16).requires_grad_()
    g = torch.randn(2, 2048, 6144, device="cuda", generator=gen).to(torch.bfloat16)
    y = fl.fp8_linear(x, w, recipe=fl.Fp8Recipe(recipe, grad))
    y.backward(g)
    xr, wr = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    yr = xr @ wr.t()
    yr.backward(g.float())
    limit = {"e4m3": 0.08, "e5m2": 0.15}
    for name, a, r, lim in (("y", y, yr, 0.08), ("dx", x.grad, xr.grad, limit[grad]), ("dw", w.grad, wr.grad, limit[grad])):
        err = ((a.float() - r).norm() / r.norm()).item()
        print(f"{recipe}/{grad} {name} relative error {err:.4f}")
        assert err < lim, (name, err)
