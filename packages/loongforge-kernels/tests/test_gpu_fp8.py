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


@pytest.mark.parametrize("gemms", [(True, True, True), (False, True, True)])
def test_fp8_grouped_linear_cuda(gemms):
    """The experts' FP8 grouped GEMMs (Qwen3-30B-A3B's fc1 shape, uneven routing with an empty expert) against an
    fp32 per-expert reference, next to bf16 grouped_mm's own error: relative error < 0.08 (rowwise E4M3)."""
    from loongforge_kernels import fp8_grouped as fg

    reason = fg.grouped_fp8_unavailable_reason()
    if reason:
        pytest.skip(reason)
    gen = torch.Generator(device="cuda").manual_seed(0)
    counts = torch.randint(0, 1024, (16,), device="cuda", generator=gen)
    counts[3] = 0
    offs = torch.cumsum(counts, 0).to(torch.int32)
    m = int(offs[-1])
    x = torch.randn(m, 2048, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(16, 1536, 2048, device="cuda", generator=gen) / 45).to(torch.bfloat16).requires_grad_()
    g = torch.randn(m, 1536, device="cuda", generator=gen).to(torch.bfloat16)
    y = fg.fp8_grouped_linear(x, w, offs, gemms)
    y.backward(g)
    got = (y, x.grad, w.grad)
    x.grad = w.grad = None
    yb = torch.nn.functional.grouped_mm(x, w.transpose(-2, -1), offs=offs)
    yb.backward(g)
    bf16 = (yb, x.grad, w.grad)
    xr, wr = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    split = counts.tolist()
    yr = torch.cat([xe @ wr[e].T for e, xe in enumerate(xr.split(split))])
    yr.backward(g.float())
    for name, a, b, r, fp8 in zip(("y", "dx", "dw"), got, bf16, (yr, xr.grad, wr.grad), gemms, strict=True):
        err = ((a.float() - r).norm() / r.norm()).item()
        err16 = ((b.float() - r).norm() / r.norm()).item()
        print(f"grouped {gemms} {name} relative error fp8 {err:.4f} bf16 {err16:.4f}")
        assert err < (0.08 if fp8 else 0.01), (name, err)
    assert torch.count_nonzero(got[2][3]) == 0


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_fp8_weight_grad_into_main_grad_cuda(recipe):
    """The weight grad written into / added to an fp32 ``main_grad`` (gradient-accumulation fusion) equals the
    plain bf16 ``dw`` up to its bf16 rounding; prints whether the scaled-mm wrote fp32 directly for the recipe."""
    reason = fl.fp8_unavailable_reason(recipe)
    if reason:
        pytest.skip(reason)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2048, 1024, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(1536, 1024, device="cuda", generator=gen) / 32).to(torch.bfloat16)
    dy = torch.randn(2048, 1536, device="cuda", generator=gen).to(torch.bfloat16)
    r = fl.Fp8Recipe(recipe)
    _, saved = fl.fp8_forward(x, w, r, fl.ALL_FP8, need_dx=False, need_dw=True)
    _, dw = fl.fp8_backward(dy, saved, r, fl.ALL_FP8, need_dx=False, need_dw=True, w_dtype=torch.bfloat16)
    main_grad = torch.full(w.shape, 3.0, device="cuda")
    fl.fp8_backward(dy, saved, r, fl.ALL_FP8, need_dx=False, need_dw=True, w_dtype=torch.bfloat16,
                    main_grad=main_grad, accumulate=False)
    first = ((main_grad - dw.float()).norm() / dw.float().norm()).item()
    fl.fp8_backward(dy, saved, r, fl.ALL_FP8, need_dx=False, need_dw=True, w_dtype=torch.bfloat16,
                    main_grad=main_grad, accumulate=True)
    second = ((main_grad - 2 * dw.float()).norm() / (2 * dw.float()).norm()).item()
    print(f"{recipe}: fp32 output {fl._FP32_OUT.get(recipe)}, main_grad vs bf16 dw {first:.2e} / {second:.2e}")
    assert first < 1e-2 and second < 1e-2
