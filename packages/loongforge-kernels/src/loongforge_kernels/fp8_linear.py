"""FP8 linear layers with current scaling: the three GEMMs of ``y = x @ W.T`` in FP8 through ``torch._scaled_mm``.

Every GEMM is written ``A [M, Kc] @ B [N, Kc].T`` with both operands quantized along their contraction dim
``Kc`` (``fp8_quantize``; B's scale passed transposed, which is each scaled-mm mode's expected layout):

- forward ``y = x @ W.T``: A = x, B = W (E4M3 both);
- input grad ``dx = dy @ W``: A = dy (``grad_dtype``), B = W.T, i.e. W transpose-quantized;
- weight grad ``dW = dy.T @ x``: A = dy.T, B = x.T (both transpose-quantized).

Recipes (``Fp8Recipe.recipe``): ``tensorwise`` (one scale per tensor; torchao's default), ``rowwise`` (one per
row of each operand along the contraction; torchao's ``rowwise``), ``blockwise`` (DeepSeek-V3: 1x128 tiles of
activations and gradients, 128x128 blocks of weights; cuBLAS has this kernel on Hopper only). The forward
quantizes x and W once in both layouts it needs and saves only the FP8 copies for the backward.

``gemms`` (fwd, dgrad, wgrad) picks which of the three run in FP8 (the adaptive policy's per-GEMM answer); a
GEMM whose shape the FP8 kernel cannot take (dims not multiples of 16, or of 128 for blockwise) runs in bf16.

:class:`Fp8Linears` is the kernel registry's ``fp8_linear`` op: the functions below for one recipe, with the
quantization pinned to the provider that serves it and the weight cache the layers of one job share.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from loongforge_kernels.fp8_quant import fp8_quantize

RECIPES = ("tensorwise", "rowwise", "blockwise")
GRAD_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
# (activation, weight, gradient) granularity per recipe
_GRANULARITY = {
    "tensorwise": ("tensor", "tensor", "tensor"),
    "rowwise": ("row", "row", "row"),
    "blockwise": ("block1x128", "block128x128", "block1x128"),
}
ALL_FP8 = (True, True, True)


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """How the FP8 GEMMs scale: ``recipe`` (tensorwise | rowwise | blockwise) and the gradients' FP8 format."""

    recipe: str = "tensorwise"
    grad_dtype: str = "e4m3"

    def __post_init__(self):
        if self.recipe not in RECIPES:
            raise ValueError(f"fp8 recipe {self.recipe!r}; allowed: {', '.join(RECIPES)}")
        if self.grad_dtype not in GRAD_DTYPES:
            raise ValueError(f"fp8 grad_dtype {self.grad_dtype!r}; allowed: e4m3, e5m2")
        if self.recipe == "blockwise" and self.grad_dtype != "e4m3":
            raise ValueError("fp8 recipe blockwise takes grad_dtype e4m3 (cuBLAS's blockwise GEMMs are E4M3 only)")

    @property
    def granularity(self) -> tuple[str, str, str]:
        return _GRANULARITY[self.recipe]

    @property
    def align(self) -> int:
        """Every dim of every GEMM must be a multiple of this (each dim is some GEMM's contraction)."""
        return 128 if self.recipe == "blockwise" else 16


def fp8_unavailable_reason(recipe: str = "tensorwise", device: Any = None) -> str | None:
    """None when this process can run ``recipe``'s FP8 GEMMs on ``device`` (default the current GPU), else why."""
    if not torch.cuda.is_available():
        return "FP8 GEMMs need a CUDA GPU of compute capability 8.9 or newer; this process sees no CUDA GPU"
    major, minor = torch.cuda.get_device_capability(device)
    name = torch.cuda.get_device_name(device)
    if (major, minor) < (8, 9):
        return f"FP8 GEMMs need compute capability 8.9 or newer; {name} is {major}.{minor}"
    if recipe == "blockwise" and major != 9:
        return f"blockwise FP8 GEMMs (1x128 / 128x128 scales) have a kernel on Hopper (9.0) only; {name} is {major}.{minor}"
    if recipe in ("rowwise", "blockwise") and torch.version.cuda and _version(torch.version.cuda) < (12, 9):
        return f"{recipe} FP8 GEMMs need torch built with CUDA 12.9 or newer (cuBLAS scale modes); this is {torch.version.cuda}"
    return None


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in v.split(".")[:2])


def _scaled_mm(a, sa, b, sb, out_dtype, fast_accum, out=None):
    """``a [M, Kc] @ b [N, Kc].T`` from FP8 operands and their decode scales (b's scale passed transposed),
    written into ``out`` when given."""
    if out is not None:
        return torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb.t(), out_dtype=out_dtype, use_fast_accum=fast_accum,
                                out=out)
    return torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb.t(), out_dtype=out_dtype, use_fast_accum=fast_accum)


# recipe -> whether torch's scaled-mm writes fp32 output for it (learnt at the first weight grad that tries)
_FP32_OUT: dict[str, bool] = {}


def _wgrad_into_main_grad(a, sa, b, sb, recipe: Fp8Recipe, main_grad: torch.Tensor, *, accumulate: bool) -> None:
    """``main_grad (+)= a @ b.T`` for the FP8 weight grad. When ``main_grad`` holds nothing yet (``accumulate``
    False: the first micro-batch after the grad buffer was zeroed) the GEMM writes its fp32 result straight into
    it, so no bf16 grad is written, read back and added; otherwise (and where the scaled-mm kernel has no fp32
    output for this recipe) a bf16 grad is added, as before.

    NOTE: cuBLAS can accumulate (beta = 1) into an fp32 output, TransformerEngine's wgrad does, but
    ``torch._scaled_mm`` does not expose it, so later micro-batches of a step still pay the add."""
    fp32_ok = _FP32_OUT.get(recipe.recipe, True)
    if not accumulate and fp32_ok and main_grad.dtype == torch.float32 and main_grad.is_contiguous():
        try:
            _scaled_mm(a, sa, b, sb, torch.float32, False, out=main_grad)
            _FP32_OUT[recipe.recipe] = True
            return
        except RuntimeError:  # NOTE: argument checks fail before any kernel runs: main_grad is untouched
            _FP32_OUT[recipe.recipe] = False
    main_grad.add_(_scaled_mm(a, sa, b, sb, torch.bfloat16, False))


class Fp8WeightCache:
    """The FP8 copies of weights, reused by every micro-batch (and recompute) of one optimizer step.

    A weight changes only in the optimizer step, so under gradient accumulation each micro-batch would quantize
    the same weights again. When :attr:`enabled`, the first forward of a step quantizes a weight (in the layouts
    it needs) and later ones reuse that; whoever runs the optimizer calls :meth:`invalidate` after each step
    (the megatron job does, when a step has more than one micro-batch). One cache belongs to one
    :class:`Fp8Linears` (``weight_cache``), i.e. to the job that made it, never to the process. Costs one FP8 copy per layout of each
    FP8 weight (1 byte a parameter per layout) between the first forward and the step's end.

    NOTE: keyed by the weight tensor itself, not its version counter: optimizers write parameters through
    ``.data``, which does not bump it."""

    def __init__(self, *, enabled: bool = False, impl: str | None = None):
        self.enabled, self.impl = enabled, impl
        self._entries: dict[tuple[int, str, str], tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = {}

    def quantize(self, weight: torch.Tensor, granularity: str, layout: str) -> tuple[torch.Tensor, ...]:
        if not self.enabled:
            return fp8_quantize(weight, granularity, torch.float8_e4m3fn, layout=layout, check_finite=False,
                                impl=self.impl)
        key = (id(weight), granularity, layout)
        hit = self._entries.get(key)
        if hit is not None and hit[0] is weight:
            return hit[1]
        out = fp8_quantize(weight.detach(), granularity, torch.float8_e4m3fn, layout=layout, check_finite=False,
                           impl=self.impl)
        self._entries[key] = (weight, out)
        return out

    def invalidate(self) -> None:
        """The weights changed (an optimizer step): drop every cached copy."""
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


def shape_ok(recipe: Fp8Recipe, *dims: int) -> bool:
    return all(d > 0 and d % recipe.align == 0 for d in dims)


def fp8_forward(x, weight, recipe: Fp8Recipe, gemms: tuple[bool, bool, bool], *, need_dx: bool, need_dw: bool,
                cache: Fp8WeightCache | None = None, impl: str | None = None):
    """``x [M, K] @ weight [N, K].T`` and what the backward needs: the FP8 transposed copies (or bf16 tensors
    for a backward GEMM that stays bf16). Returns ``(y, saved)``; hand ``saved`` to :func:`fp8_backward`.
    ``cache`` reuses the weight's FP8 copies within a step; ``impl`` picks the quantization kernels."""
    g_act, g_w, _ = recipe.granularity
    fwd8, dgrad8, wgrad8 = gemms
    e4m3 = torch.float8_e4m3fn
    saved: list[torch.Tensor | None] = [None] * 6  # xt, xt scale, wt, wt scale, x (bf16 wgrad), w (bf16 dgrad)
    xs = ws = ()
    lay = ("n" if fwd8 else "") + ("t" if need_dw and wgrad8 else "")
    if lay:
        xs = fp8_quantize(x, g_act, e4m3, layout=lay, check_finite=False, impl=impl)
        if "t" in lay:
            saved[0], saved[1] = xs[-2], xs[-1]
    lay = ("n" if fwd8 else "") + ("t" if need_dx and dgrad8 else "")
    if lay:
        ws = (cache.quantize(weight, g_w, lay) if cache is not None
              else fp8_quantize(weight, g_w, e4m3, layout=lay, check_finite=False, impl=impl))
        if "t" in lay:
            saved[2], saved[3] = ws[-2], ws[-1]
    if fwd8:
        y = _scaled_mm(xs[0], xs[1], ws[0], ws[1], x.dtype, recipe.recipe != "blockwise")
    else:
        y = x @ weight.t().to(x.dtype)
    if need_dw and not wgrad8:
        saved[4] = x
    if need_dx and not dgrad8:
        saved[5] = weight
    return y, saved


def fp8_backward(dy, saved, recipe: Fp8Recipe, gemms: tuple[bool, bool, bool], *, need_dx: bool, need_dw: bool,
                 w_dtype: torch.dtype, main_grad: torch.Tensor | None = None, accumulate: bool = True,
                 impl: str | None = None):
    """``(dx, dw)`` of :func:`fp8_forward` for the output grad ``dy [M, N]`` (None where not needed).

    With ``main_grad`` (megatron's gradient-accumulation fusion: the weight's fp32 grad buffer) the weight grad
    goes into it instead (``dw`` is None): added, or written when ``accumulate`` is False (it holds zeros)."""
    xt, sxt, wt, swt, x_hp, w_hp = saved
    _, dgrad8, wgrad8 = gemms
    dy = dy.contiguous()
    dx = dw = None
    lay = ("n" if need_dx and dgrad8 else "") + ("t" if need_dw and wgrad8 else "")
    gs = fp8_quantize(dy, recipe.granularity[2], GRAD_DTYPES[recipe.grad_dtype], layout=lay,
                      check_finite=False, impl=impl) if lay else ()
    if need_dx:
        dx = _scaled_mm(gs[0], gs[1], wt, swt, dy.dtype, False) if dgrad8 else dy @ w_hp.to(dy.dtype)
    if need_dw and main_grad is not None:
        if wgrad8:
            _wgrad_into_main_grad(gs[-2], gs[-1], xt, sxt, recipe, main_grad, accumulate=accumulate)
        elif main_grad.is_cuda and main_grad.dtype == torch.float32 and dy.dtype in (torch.bfloat16, torch.float16):
            # NOTE: bf16 weight grad (the policy keeps it): cuBLAS accumulates into the fp32 buffer (beta = 1)
            torch.addmm(main_grad, dy.t(), x_hp, out_dtype=torch.float32, out=main_grad)
        else:
            main_grad.add_((dy.t() @ x_hp).to(main_grad.dtype))
    elif need_dw:
        dw = (_scaled_mm(gs[-2], gs[-1], xt, sxt, dy.dtype, False) if wgrad8 else dy.t() @ x_hp).to(w_dtype)
    return dx, dw


class Fp8Matmul(torch.autograd.Function):
    """``x [M, K] @ weight [N, K].T`` with the GEMMs flagged in ``gemms`` (fwd, dgrad, wgrad) in FP8."""

    @staticmethod
    def forward(ctx, x, weight, recipe: Fp8Recipe, gemms: tuple[bool, bool, bool], cache, impl):
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        y, saved = fp8_forward(x, weight, recipe, gemms, need_dx=need_dx, need_dw=need_dw, cache=cache, impl=impl)
        ctx.recipe, ctx.gemms, ctx.w_dtype, ctx.impl = recipe, gemms, weight.dtype, impl
        ctx.save_for_backward(*saved)
        return y

    @staticmethod
    def backward(ctx, dy):
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx, dw = fp8_backward(dy, ctx.saved_tensors, ctx.recipe, ctx.gemms, need_dx=need_dx, need_dw=need_dw,
                              w_dtype=ctx.w_dtype, impl=ctx.impl)
        return dx, dw, None, None, None, None


def fp8_matmul(x2d: torch.Tensor, weight: torch.Tensor, recipe: Fp8Recipe,
               gemms: tuple[bool, bool, bool] = ALL_FP8, *, cache: Fp8WeightCache | None = None,
               impl: str | None = None) -> torch.Tensor:
    """``x2d @ weight.T`` with FP8 GEMMs where ``gemms`` says and the shape allows, bf16 elsewhere."""
    m, k = x2d.shape
    n = weight.shape[0]
    if not any(gemms) or not shape_ok(recipe, m, n, k):
        return x2d @ weight.t().to(x2d.dtype)
    return Fp8Matmul.apply(x2d, weight, recipe, tuple(gemms), cache, impl)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, recipe: Fp8Recipe,
               gemms: tuple[bool, bool, bool] = ALL_FP8, cache: Fp8WeightCache | None = None,
               impl: str | None = None) -> torch.Tensor:
    """``F.linear`` with FP8 GEMMs: any leading dims, bias added in the output dtype."""
    y = fp8_matmul(x.reshape(-1, x.shape[-1]), weight, recipe, gemms, cache=cache, impl=impl).view(
        *x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias.to(y.dtype)


class Fp8Linear(torch.nn.Linear):
    """``nn.Linear`` whose GEMMs run in FP8 (same parameters and state dict); ``from_linear`` swaps in place."""

    fp8_recipe: Fp8Recipe
    fp8_gemms: tuple[bool, bool, bool] = ALL_FP8
    fp8_cache: Fp8WeightCache | None = None
    fp8_impl: str | None = None

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, recipe: Fp8Recipe, gemms: tuple[bool, bool, bool] = ALL_FP8, *,
                    cache: Fp8WeightCache | None = None, impl: str | None = None) -> Fp8Linear:
        linear.__class__ = cls
        linear.fp8_recipe, linear.fp8_gemms, linear.fp8_cache, linear.fp8_impl = recipe, tuple(gemms), cache, impl
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cuda":  # NOTE: CPU forward (export, eval on host) keeps the plain linear
            return F.linear(x, self.weight, self.bias)
        return fp8_linear(x, self.weight, self.bias, recipe=self.fp8_recipe, gemms=self.fp8_gemms,
                          cache=self.fp8_cache, impl=self.fp8_impl)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={self.fp8_recipe.recipe}, gemms={self.fp8_gemms}"


def convert_to_fp8(model: torch.nn.Module, recipe: Fp8Recipe, *, skip=lambda name, module: False,
                   gemms_for=lambda name, module: ALL_FP8, cache: Fp8WeightCache | None = None,
                   impl: str | None = None) -> list[str]:
    """Swap every ``nn.Linear`` of ``model`` (not those ``skip(name, module)`` names, nor ones whose weight
    shape the recipe cannot take) for :class:`Fp8Linear`; returns the swapped names.

    ``gemms_for(name, module)`` gives each layer's (fwd, dgrad, wgrad) FP8 flags (the adaptive policy)."""
    swapped = []
    for name, mod in model.named_modules():
        if type(mod) is not torch.nn.Linear or skip(name, mod):
            continue
        if not shape_ok(recipe, *mod.weight.shape):
            continue
        gemms = tuple(gemms_for(name, mod))
        if any(gemms):
            Fp8Linear.from_linear(mod, recipe, gemms, cache=cache, impl=impl)
            swapped.append(name)
    return swapped


class Fp8Linears:
    """The kernel registry's ``fp8_linear`` op: FP8 linears for one scaling ``recipe`` and gradient format, their
    quantization pinned to ``impl`` (the serving provider's), and the :class:`Fp8WeightCache` they share
    (``weight_cache``, off until its owner turns it on). A backend holds one per job and calls only these
    methods; an accelerator plugin replaces the op with an object of the same methods (``device_type``: the
    tensors its GEMMs run on; others keep the plain linear)."""

    device_type = "cuda"

    def __init__(self, recipe: str = "tensorwise", grad_dtype: str = "e4m3", *, impl: str | None = None):
        self.scaling = Fp8Recipe(recipe, grad_dtype)
        self.recipe, self.grad_dtype, self.impl = recipe, grad_dtype, impl
        self.weight_cache = Fp8WeightCache(impl=impl)

    def unavailable_reason(self, device: Any = None) -> str | None:
        """None when ``device`` (default the current GPU) can run this recipe's FP8 GEMMs, else why (one line)."""
        kind = torch.device(device).type if device is not None else "cuda"
        if kind != "cuda":
            return (f"FP8 GEMMs need CUDA GPUs with FP8 tensor cores (compute capability 8.9+); this run is on "
                    f"{kind}")
        return fp8_unavailable_reason(self.recipe, device)

    def shape_ok(self, *dims: int) -> bool:
        """Whether GEMMs of these dims can run in FP8 (each a multiple of the recipe's alignment)."""
        return shape_ok(self.scaling, *dims)

    def forward(self, x2d: torch.Tensor, weight: torch.Tensor, gemms: tuple[bool, bool, bool], *, need_dx: bool,
                need_dw: bool):
        """:func:`fp8_forward` through this op's weight cache: ``(y, saved)``."""
        return fp8_forward(x2d, weight, self.scaling, gemms, need_dx=need_dx, need_dw=need_dw,
                           cache=self.weight_cache, impl=self.impl)

    def backward(self, dy: torch.Tensor, saved, gemms: tuple[bool, bool, bool], *, need_dx: bool, need_dw: bool,
                 w_dtype: torch.dtype, main_grad: torch.Tensor | None = None, accumulate: bool = True):
        """:func:`fp8_backward`: ``(dx, dw)`` (``dw`` None when it went into ``main_grad``)."""
        return fp8_backward(dy, saved, self.scaling, gemms, need_dx=need_dx, need_dw=need_dw, w_dtype=w_dtype,
                            main_grad=main_grad, accumulate=accumulate, impl=self.impl)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               gemms: tuple[bool, bool, bool] = ALL_FP8) -> torch.Tensor:
        """``F.linear`` with FP8 GEMMs (autograd included)."""
        return fp8_linear(x, weight, bias, recipe=self.scaling, gemms=gemms, cache=self.weight_cache,
                          impl=self.impl)

    def convert(self, model: torch.nn.Module, *, skip=lambda name, module: False,
                gemms_for=lambda name, module: ALL_FP8) -> list[str]:
        """:func:`convert_to_fp8` with this op's recipe, cache and kernels; the swapped layers' names."""
        return convert_to_fp8(model, self.scaling, skip=skip, gemms_for=gemms_for, cache=self.weight_cache,
                              impl=self.impl)

    def gemms(self, x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor) -> dict[str, Callable[[], Any]]:
        """The three FP8 GEMMs of ``y = x @ weight.T`` run alone, each quantizing its own operands in the layout it
        needs (what ``loongforge fp8 profile`` times; the training path fuses the forward's quantizations)."""
        g_act, g_w, g_grad = self.scaling.granularity
        e4m3, gdt = torch.float8_e4m3fn, GRAD_DTYPES[self.grad_dtype]

        def q(t, g, dt, lay):
            return fp8_quantize(t, g, dt, layout=lay, check_finite=False, impl=self.impl)

        fast = self.recipe != "blockwise"
        return {
            "fwd": lambda: _scaled_mm(*q(x, g_act, e4m3, "n"), *q(weight, g_w, e4m3, "n"), torch.bfloat16, fast),
            "dgrad": lambda: _scaled_mm(*q(dy, g_grad, gdt, "n"), *q(weight, g_w, e4m3, "t"), torch.bfloat16, False),
            "wgrad": lambda: _scaled_mm(*q(dy, g_grad, gdt, "t"), *q(x, g_act, e4m3, "t"), torch.bfloat16, False),
        }
