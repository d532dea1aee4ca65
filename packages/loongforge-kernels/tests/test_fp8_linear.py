"""FP8 linear: the GEMM plumbing (which operand, layout and scale each GEMM gets) on CPU through an emulated
``torch._scaled_mm`` (dequantize, then matmul), for every recipe and per-GEMM FP8 choice; ``test_gpu_fp8.py`` runs
the real scaled-mm kernels."""

from __future__ import annotations

import pytest
import torch
from loongforge_kernels import fp8_linear as fl


def _expand(s: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A decode-scale tensor of any granularity broadcast to [rows, cols]."""
    if s.dim() == 0 or s.numel() == 1:
        return s.reshape(1, 1).expand(rows, cols)
    if s.shape == (rows, 1):
        return s.expand(rows, cols)
    br = 1 if s.shape[0] == rows else 128
    return s.repeat_interleave(br, 0)[:rows].repeat_interleave(128, 1)[:, :cols]


def _emulated(a, sa, b, sb, out_dtype, fast_accum, out=None):
    deq_a = a.float() * _expand(sa, *a.shape)
    deq_b = b.float() * _expand(sb, *b.shape)
    y = (deq_a @ deq_b.t()).to(out_dtype)
    return y if out is None else out.copy_(y)


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(fl, "_scaled_mm", _emulated)


@pytest.mark.parametrize("recipe,grad", [("tensorwise", "e4m3"), ("tensorwise", "e5m2"), ("rowwise", "e4m3"),
                                         ("blockwise", "e4m3")])
@pytest.mark.parametrize("gemms", [(True, True, True), (True, False, True), (False, True, False)])
def test_fp8_linear_matches_fp32(emulated, recipe, grad, gemms):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 128, 256, generator=gen).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(384, 256, generator=gen) / 16).to(torch.bfloat16).requires_grad_()
    b = torch.randn(384, generator=gen).to(torch.bfloat16).requires_grad_()
    g = torch.randn(2, 128, 384, generator=gen).to(torch.bfloat16)
    y = fl.fp8_linear(x, w, b, recipe=fl.Fp8Recipe(recipe, grad), gemms=gemms)
    y.backward(g)
    got = (y, x.grad, w.grad, b.grad)
    xr, wr, br = (t.detach().float().requires_grad_() for t in (x, w, b))
    yr = torch.nn.functional.linear(xr, wr, br)
    yr.backward(g.float())
    tol = {"e4m3": 0.08, "e5m2": 0.15}
    for name, a, r, fp8 in (("y", y, yr, gemms[0]), ("dx", got[1], xr.grad, gemms[1]),
                            ("dw", got[2], wr.grad, gemms[2]), ("db", got[3], br.grad, False)):
        err = ((a.float() - r).norm() / r.norm()).item()
        limit = (tol["e4m3"] if name == "y" else tol[grad]) if fp8 else 0.01
        assert err < limit, (name, err)
        assert a.dtype == torch.bfloat16


def test_real_tensorwise_scaled_mm_on_cpu():
    """torch's CPU _scaled_mm runs tensorwise: the unpatched path gives the same as the emulation."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 128, generator=gen).to(torch.bfloat16)
    w = (torch.randn(32, 128, generator=gen) / 11).to(torch.bfloat16)
    r = fl.Fp8Recipe("tensorwise")
    try:
        y = fl.fp8_matmul(x, w, r)
    except RuntimeError as exc:  # a torch build without the CPU kernel
        pytest.skip(str(exc).splitlines()[0])
    fl_em = fl._scaled_mm
    try:
        fl._scaled_mm = _emulated
        y_em = fl.fp8_matmul(x, w, r)
    finally:
        fl._scaled_mm = fl_em
    torch.testing.assert_close(y.float(), y_em.float(), atol=2e-2, rtol=2e-2)


def test_unaligned_shapes_run_bf16(emulated):
    x = torch.randn(5, 100, dtype=torch.bfloat16)
    w = torch.randn(24, 100, dtype=torch.bfloat16)
    torch.testing.assert_close(fl.fp8_matmul(x, w, fl.Fp8Recipe("rowwise")), x @ w.t())
    x = torch.randn(64, 256, dtype=torch.bfloat16)  # 64 tokens: not a multiple of 128 for blockwise
    w = torch.randn(128, 256, dtype=torch.bfloat16)
    torch.testing.assert_close(fl.fp8_matmul(x, w, fl.Fp8Recipe("blockwise")), x @ w.t())


def test_convert_to_fp8_swaps_eligible_linears():
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 100),
                                torch.nn.Linear(512, 256))
    model[3] = torch.nn.Linear(512, 256)
    swapped = fl.convert_to_fp8(model, fl.Fp8Recipe("tensorwise"), skip=lambda name, m: name == "3")
    assert swapped == ["0"]  # "2" has 100 outputs (not a multiple of 16), "3" is skipped
    assert isinstance(model[0], fl.Fp8Linear) and type(model[2]) is torch.nn.Linear
    x = torch.randn(3, 256)
    torch.testing.assert_close(model[0](x), torch.nn.functional.linear(x, model[0].weight, model[0].bias))
    assert set(model.state_dict()) == {f"{i}.{p}" for i in (0, 2, 3) for p in ("weight", "bias")}


def test_recipe_and_availability_errors(monkeypatch):
    with pytest.raises(ValueError, match="allowed: tensorwise, rowwise, blockwise"):
        fl.Fp8Recipe("delayed")
    with pytest.raises(ValueError, match="e4m3"):
        fl.Fp8Recipe("blockwise", "e5m2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "no CUDA GPU" in fl.fp8_unavailable_reason("tensorwise")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100")
    assert "8.9 or newer; NVIDIA A100 is 8.0" in fl.fp8_unavailable_reason("rowwise")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 9))
    assert "Hopper" in fl.fp8_unavailable_reason("blockwise")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    assert fl.fp8_unavailable_reason("blockwise") is None or "CUDA 12.9" in fl.fp8_unavailable_reason("blockwise")


def test_weight_cache_quantizes_each_weight_once_per_step(emulated, monkeypatch):
    """With the cache on, micro-batches after the first reuse the weight's FP8 copies until invalidate(). The
    cache is the FP8 op's own (``Fp8Linears.weight_cache``): another op, or a plain call, never sees it."""
    calls = []
    real = fl.fp8_quantize
    monkeypatch.setattr(fl, "fp8_quantize", lambda t, *a, **k: calls.append(tuple(t.shape)) or real(t, *a, **k))
    w = (torch.randn(64, 32) / 8).to(torch.bfloat16).requires_grad_()
    ops = fl.Fp8Linears("tensorwise", impl="torch")
    cache = ops.weight_cache
    assert not cache.enabled and not hasattr(fl, "WEIGHT_CACHE")
    cache.enabled = True
    for _ in range(3):
        ops.linear(torch.randn(16, 32).to(torch.bfloat16), w).sum().backward()
    assert calls.count((64, 32)) == 1 and len(cache) == 1
    fl.fp8_linear(torch.randn(16, 32).to(torch.bfloat16), w, recipe=ops.scaling).sum().backward()
    assert calls.count((64, 32)) == 2 and len(fl.Fp8Linears("tensorwise").weight_cache) == 0
    ref = w.grad.clone()
    cache.invalidate()
    w.grad = None
    with torch.no_grad():
        w.mul_(2)
    ops.linear(torch.ones(16, 32).to(torch.bfloat16), w).sum().backward()
    assert calls.count((64, 32)) == 3 and not torch.equal(ref, w.grad)


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
@pytest.mark.parametrize("wgrad8", [True, False])
def test_weight_grad_into_main_grad(emulated, recipe, wgrad8):
    """With ``main_grad`` the weight grad lands there: written over a buffer that holds nothing yet (accumulate
    False; the stale values must not survive), added otherwise; both equal the plain ``dw``."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(128, 256, generator=gen).to(torch.bfloat16)
    w = (torch.randn(128, 256, generator=gen) / 16).to(torch.bfloat16)
    dy = torch.randn(128, 128, generator=gen).to(torch.bfloat16)
    r, gemms = fl.Fp8Recipe(recipe), (True, True, wgrad8)
    _, saved = fl.fp8_forward(x, w, r, gemms, need_dx=False, need_dw=True)
    _, dw = fl.fp8_backward(dy, saved, r, gemms, need_dx=False, need_dw=True, w_dtype=torch.bfloat16)
    main_grad = torch.full(w.shape, 7.0)
    out = fl.fp8_backward(dy, saved, r, gemms, need_dx=False, need_dw=True, w_dtype=torch.bfloat16,
                          main_grad=main_grad, accumulate=not wgrad8)  # NOTE: bf16 wgrad always accumulates
    assert out == (None, None)
    first = main_grad - (7.0 if not wgrad8 else 0.0)
    torch.testing.assert_close(first, dw.float(), atol=2e-2, rtol=2e-2)
    fl.fp8_backward(dy, saved, r, gemms, need_dx=False, need_dw=True, w_dtype=torch.bfloat16, main_grad=main_grad,
                    accumulate=True)
    torch.testing.assert_close(main_grad - (7.0 if not wgrad8 else 0.0), 2 * dw.float(), atol=4e-2, rtol=2e-2)


def test_weight_grad_without_fp32_output_adds(emulated, monkeypatch):
    """A scaled-mm that refuses fp32 output (some torch builds, for some scale modes): the grad is added in bf16
    instead, and the refusal is remembered for the recipe."""
    def no_fp32(a, sa, b, sb, out_dtype, fast_accum, out=None):
        if out_dtype == torch.float32:
            raise RuntimeError("fp32 output not supported")
        return _emulated(a, sa, b, sb, out_dtype, fast_accum)

    monkeypatch.setattr(fl, "_scaled_mm", no_fp32)
    monkeypatch.setattr(fl, "_FP32_OUT", {})
    x, w = torch.randn(64, 32).to(torch.bfloat16), (torch.randn(48, 32) / 8).to(torch.bfloat16)
    dy = torch.randn(64, 48).to(torch.bfloat16)
    r = fl.Fp8Recipe("rowwise")
    _, saved = fl.fp8_forward(x, w, r, fl.ALL_FP8, need_dx=False, need_dw=True)
    _, dw = fl.fp8_backward(dy, saved, r, fl.ALL_FP8, need_dx=False, need_dw=True, w_dtype=torch.bfloat16)
    main_grad = torch.zeros(48, 32)
    fl.fp8_backward(dy, saved, r, fl.ALL_FP8, need_dx=False, need_dw=True, w_dtype=torch.bfloat16,
                    main_grad=main_grad, accumulate=False)
    assert torch.equal(main_grad, dw.float())
    assert fl._FP32_OUT == {"rowwise": False}
