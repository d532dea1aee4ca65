"""An accelerator plugin replaces the FP8 linear: its ``kernel_overrides()`` entry for the registry's ``fp8_linear``
op wins over every provider, and both backends then run their FP8 GEMMs through it (here a test-local device whose
"FP8" is emulated on the CPU: operands rounded to E4M3 with one scale per tensor, then a float matmul)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from loongforge.accelerator.cpu import CpuAccelerator
from loongforge.recipe.schema import Fp8Config

ALL = (True, True, True)


def _e4m3(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded through E4M3 with one scale per tensor (what a device's FP8 GEMM would see)."""
    scale = t.detach().abs().amax().float().clamp(min=1e-12) / 448.0
    return (t.float() / scale).to(torch.float8_e4m3fn).float() * scale


class _Emulated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, ops):
        y, saved = ops.forward(x.reshape(-1, x.shape[-1]), weight, ALL, need_dx=True, need_dw=True)
        ctx.ops, ctx.shape, ctx.w_dtype = ops, x.shape, weight.dtype
        ctx.save_for_backward(*saved)
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        dx, dw = ctx.ops.backward(dy.reshape(-1, dy.shape[-1]), ctx.saved_tensors, ALL, need_dx=True, need_dw=True,
                                  w_dtype=ctx.w_dtype)
        return dx.view(ctx.shape), dw, None


class EmulatedFp8Linears:
    """The device's own ``fp8_linear`` op: the methods the backends call (see ``loongforge.kernels.OPS``)."""

    device_type = "cpu"

    def __init__(self, recipe: str = "tensorwise", grad_dtype: str = "e4m3"):
        self.recipe, self.grad_dtype = recipe, grad_dtype
        self.calls: Counter[str] = Counter()

    def unavailable_reason(self, device=None) -> str | None:
        return None

    def shape_ok(self, *dims: int) -> bool:
        return all(d > 0 and d % 16 == 0 for d in dims)

    def forward(self, x2d, weight, gemms, *, need_dx, need_dw):
        self.calls["forward"] += 1
        return (_e4m3(x2d) @ _e4m3(weight).t()).to(x2d.dtype), [x2d, weight]

    def backward(self, dy, saved, gemms, *, need_dx, need_dw, w_dtype, main_grad=None, accumulate=True):
        self.calls["backward"] += 1
        x, w = saved
        dx = (_e4m3(dy) @ _e4m3(w)).to(dy.dtype) if need_dx else None
        dw = (_e4m3(dy).t() @ _e4m3(x)) if need_dw else None
        if dw is not None and main_grad is not None:
            main_grad.add_(dw) if accumulate else main_grad.copy_(dw)
            return dx, None
        return dx, None if dw is None else dw.to(w_dtype)

    def linear(self, x, weight, bias=None, gemms=ALL):
        y = _Emulated.apply(x, weight, self)
        return y if bias is None else y + bias

    def convert(self, model, *, skip=lambda name, module: False, gemms_for=lambda name, module: ALL):
        swapped = []
        for name, mod in model.named_modules():
            if type(mod) is torch.nn.Linear and not skip(name, mod) and self.shape_ok(*mod.weight.shape):
                mod.forward = lambda x, m=mod: self.linear(x, m.weight, m.bias)
                swapped.append(name)
        return swapped


class Fp8Device(CpuAccelerator):
    """A hardware plugin (test-local) that brings its own FP8 linear."""

    name = "fp8dev"

    def __init__(self):
        super().__init__()
        self.made: list[EmulatedFp8Linears] = []

    def kernel_overrides(self):
        def fp8_linear(recipe, grad_dtype="e4m3"):
            self.made.append(EmulatedFp8Linears(recipe, grad_dtype))
            return self.made[-1]

        return {"fp8_linear": fp8_linear}


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_the_override_wins_over_every_provider():
    from loongforge.kernels import select

    acc = Fp8Device()
    for provider in ("auto", "torch"):
        who, make = select("fp8_linear", provider=provider, device_type="cpu", accelerator=acc)
        assert who == "accelerator:fp8dev" and isinstance(make("rowwise"), EmulatedFp8Linears)


def test_embodied_fp8_runs_the_plugins_linear():
    pytest.importorskip("loongforge_embodied")
    from loongforge_embodied.kernels import fp8_linear

    acc = Fp8Device()
    ops = fp8_linear(Fp8Config(recipe="rowwise"), provider="auto", device_type="cpu", accelerator=acc)
    assert ops is acc.made[-1] and ops.unavailable_reason(torch.device("cpu")) is None
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    x = torch.randn(8, 32)
    ref = model(x)
    ref.square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    assert ops.convert(model) == ["0", "2"]
    y = model(x)
    y.square().mean().backward()
    assert ops.calls == {"forward": 2, "backward": 2}
    assert _close(y, ref) < 0.1
    errs = [_close(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True)]
    assert max(errs) < 0.25, errs  # NOTE: E4M3 keeps 3 mantissa bits of both operands of every GEMM


def test_megatron_fp8_runs_the_plugins_linear():
    """The megatron TP linear's FP8 path (``layers.fp8``) calls the plugin's forward / backward, weight grad into
    ``main_grad`` included."""
    pytest.importorskip("loongforge_megatron")
    from loongforge_megatron.layers.fp8 import Fp8Kernels, _Fp8TPLinear

    acc = Fp8Device()
    kernels = Fp8Kernels.select(Fp8Config(recipe="tensorwise"), provider="auto", device_type="cpu", accelerator=acc)
    assert kernels.linear is acc.made[-1]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 16, generator=gen, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(48, 16, generator=gen) / 4)
    y = _Fp8TPLinear.apply(x, w, None, False, False, False, None, kernels.linear, ALL)
    g = torch.randn(32, 48, generator=gen)
    y.backward(g)
    assert kernels.linear.calls == {"forward": 1, "backward": 1}
    assert _close(y, x @ w.t()) < 0.1 and _close(x.grad, g @ w) < 0.1 and _close(w.grad, g.t() @ x) < 0.1
    plain, w.grad = w.grad.clone(), None
    w.main_grad, w.grad_added_to_main_grad = torch.full(w.shape, 3.0), False
    _Fp8TPLinear.apply(x, w, None, True, False, False, None, kernels.linear, ALL).backward(g)
    torch.testing.assert_close(w.main_grad, plain)  # written over the stale buffer: DDP had just zeroed it
    assert w.grad_added_to_main_grad
