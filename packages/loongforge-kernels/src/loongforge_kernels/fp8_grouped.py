"""FP8 grouped GEMMs for MoE experts: ``y[rows of e] = x[rows of e] @ W[e].T`` for every expert through torch's
rowwise-scaled ``torch._scaled_grouped_mm`` (CUTLASS, Hopper), forward and both backward GEMMs.

torch's FP8 grouped kernel on Hopper takes E4M3 operands with one fp32 decode scale per row of each operand along
its contraction (``ScalingType.RowWise``), K-major operands (the right operand column-major), contraction and
output dims that are multiples of 16, and int32 cumulative group ends ``offs``. So, whatever ``train.fp8.recipe``
says, the experts' GEMMs are rowwise E4M3 (gradients too):

- forward ``y = x @ W[e].T`` (2-D x 3-D, groups along M): x per token row, ``W`` per (expert, output row);
- input grad ``dx = dy @ W[e]`` (2-D x 3-D): dy per token row, ``W[e].T`` per (expert, input column), i.e. each
  expert's weight transposed and quantized along its output dim;
- weight grad ``dW[e] = dy_e.T @ x_e`` (2-D x 2-D, groups along the contraction): ``dy.T`` and ``x.T`` per feature
  (one scale per column over all tokens, shared by the experts). torch's TMA loads need every group's token count
  to be a multiple of 16 here, so the rows are first scattered into groups padded with zero rows (sizes rounded
  up to 16, on the device: no host sync; zero rows add nothing to ``dW``).

``gemms`` (fwd, dgrad, wgrad) picks which GEMMs run in FP8 (the adaptive policy's answer); the others run bf16
``grouped_mm``. :func:`grouped_fp8_unavailable_reason` says why a process cannot run them at all.
:class:`Fp8GroupedLinears` is the kernel registry's ``fp8_grouped_linear`` op: these GEMMs with the quantization
pinned to the provider that serves it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from loongforge_kernels.fp8_quant import fp8_quantize

ALIGN = 16  # contraction / output dims, and the weight grad's per-group token counts (16 bytes of FP8)
ALL_FP8 = (True, True, True)
_E4M3 = torch.float8_e4m3fn


def grouped_fp8_unavailable_reason(device: Any = None) -> str | None:
    """None when this process can run FP8 grouped GEMMs on ``device`` (default the current GPU), else why."""
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"torch {torch.__version__} has no torch._scaled_grouped_mm (FP8 grouped GEMMs need torch >= 2.8)"
    if not torch.cuda.is_available():
        return "FP8 grouped GEMMs need a CUDA GPU; this process sees no CUDA GPU"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        name = torch.cuda.get_device_name(device)
        return (f"torch's rowwise FP8 grouped GEMM has a kernel on Hopper (9.0) only; {name} is {major}.{minor} "
                "(the experts stay bf16)")
    return None


def grouped_shape_ok(n: int, k: int) -> bool:
    """Whether experts of weight ``[E, n, k]`` can take FP8 grouped GEMMs (both dims multiples of 16)."""
    return n > 0 and k > 0 and n % ALIGN == 0 and k % ALIGN == 0


def _rowwise(t2d: torch.Tensor, impl: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise E4M3 of a 2-D tensor: ``(q, s)`` with ``s`` 1-D (one decode scale per row)."""
    q, s = fp8_quantize(t2d, "row", _E4M3, layout="n", check_finite=False, impl=impl)
    return q, s.view(-1)


def quantize_expert_weight(weight: torch.Tensor, *, plain: bool, transposed: bool, impl: str | None = None):
    """Rowwise E4M3 copies of the experts' weight ``[E, N, K]``: ``plain`` -> ``(q [E, N, K], s [E, N])``
    (scales along K, the forward's operand), ``transposed`` -> ``(qt [E, K, N], st [E, K])`` (each expert's
    ``W.T``, scales along N, the input grad's operand). Returns ``(q, s, qt, st)`` with None for what is not asked."""
    e, n, k = weight.shape
    q = s = qt = st = None
    if plain:
        q, s = _rowwise(weight.reshape(e * n, k), impl)
        q, s = q.view(e, n, k), s.view(e, n)
    if transposed:
        qt, st = _rowwise(weight.transpose(1, 2).contiguous().view(e * k, n), impl)
        qt, st = qt.view(e, k, n), st.view(e, k)
    return q, s, qt, st


def padded_groups(offs: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Each group's rows moved to a start that is a multiple of 16: ``(dest, padded_offs, padded_rows)``; row
    ``i`` goes to ``dest[i]``, group ``g`` ends at ``padded_offs[g]``, and ``padded_rows`` (a static bound, so no
    host sync) holds them all."""
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    padded = (counts + ALIGN - 1) // ALIGN * ALIGN
    padded_offs = torch.cumsum(padded, 0, dtype=torch.int32)
    shift = (padded_offs - padded) - (offs - counts)  # padded start - start, per group
    dest = torch.arange(rows, device=offs.device) + torch.repeat_interleave(shift.long(), counts.long(),
                                                                             output_size=rows)
    n_groups = offs.numel()
    padded_rows = -(-(rows + (ALIGN - 1) * n_groups) // ALIGN) * ALIGN
    return dest, padded_offs, padded_rows


def _transposed_padded(t2d: torch.Tensor, dest: torch.Tensor, padded_rows: int, n_groups: int,
                       impl: str | None = None):
    """``t2d`` [M, C]'s rows scattered into zero-padded groups, transposed and quantized per column over all
    tokens: ``(qt [C, padded_rows], st [n_groups * C])`` (the scales repeated per group, as the kernel reads them)."""
    padded = t2d.new_zeros(padded_rows, t2d.shape[1]).index_copy_(0, dest, t2d)
    qt, st = fp8_quantize(padded, "row", _E4M3, layout="t", check_finite=False, impl=impl)
    return qt, st.view(1, -1).expand(n_groups, -1).reshape(-1)


def _sgmm(a, sa, b, sb, offs, fast_accum):
    return torch._scaled_grouped_mm(a, b, sa, sb, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=fast_accum)


class Fp8GroupedLinear(torch.autograd.Function):
    """Grouped ``x [M, K] @ weight[e].T`` (``weight [E, N, K]``) with the flagged GEMMs in FP8 (module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, offs, gemms, impl):
        fwd8, dgrad8, wgrad8 = gemms
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        q, s, wtq, wts = quantize_expert_weight(weight, plain=fwd8, transposed=need_dx and dgrad8, impl=impl)
        if fwd8:
            xq, xs = _rowwise(x, impl)
            y = _sgmm(xq, xs, q.transpose(-2, -1), s, offs, True)
        else:
            y = F.grouped_mm(x, weight.transpose(-2, -1), offs=offs)
        xtq = xts = dest = poffs = None
        ctx.padded_rows = 0
        if need_dw and wgrad8:
            dest, poffs, ctx.padded_rows = padded_groups(offs, x.shape[0])
            xtq, xts = _transposed_padded(x, dest, ctx.padded_rows, weight.shape[0], impl)
        x_hp = x if need_dw and not wgrad8 else None
        w_hp = weight if need_dx and not dgrad8 else None
        ctx.gemms, ctx.w_dtype, ctx.impl = gemms, weight.dtype, impl
        ctx.save_for_backward(wtq, wts, xtq, xts, dest, poffs, x_hp, w_hp, offs)
        return y

    @staticmethod
    def backward(ctx, dy):
        wtq, wts, xtq, xts, dest, poffs, x_hp, w_hp, offs = ctx.saved_tensors
        _, dgrad8, wgrad8 = ctx.gemms
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dy = dy.contiguous()  # NOTE: an expanded gradient (a sum()'s) has no 16-byte strides
        dx = dw = None
        if need_dx:
            if dgrad8:
                dyq, dys = _rowwise(dy, ctx.impl)
                dx = _sgmm(dyq, dys, wtq.transpose(-2, -1), wts, offs, False)
            else:
                dx = F.grouped_mm(dy, w_hp.to(dy.dtype), offs=offs)
        if need_dw:
            if wgrad8:
                dytq, dyts = _transposed_padded(dy, dest, ctx.padded_rows, offs.numel(), ctx.impl)
                dw = _sgmm(dytq, dyts, xtq.t(), xts, poffs, False)
            else:
                dw = F.grouped_mm(dy.t(), x_hp, offs=offs)
            dw = dw.to(ctx.w_dtype)
        return dx, dw, None, None, None


def fp8_grouped_linear(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
                       gemms: tuple[bool, bool, bool] = ALL_FP8, *, impl: str | None = None) -> torch.Tensor:
    """Grouped ``x @ weight[e].T`` over the expert-sorted rows of ``x`` (bf16, CUDA) with FP8 GEMMs where
    ``gemms`` says and the shape allows, bf16 ``grouped_mm`` elsewhere; ``impl`` picks the quantization kernels."""
    n, k = weight.shape[1:]
    if not any(gemms) or not grouped_shape_ok(n, k) or x.dtype != torch.bfloat16:
        return F.grouped_mm(x, weight.transpose(-2, -1), offs=offs)
    return Fp8GroupedLinear.apply(x, weight, offs.to(torch.int32), tuple(gemms), impl)


class Fp8GroupedLinears:
    """The kernel registry's ``fp8_grouped_linear`` op: FP8 grouped GEMMs for MoE experts (rowwise E4M3), the
    quantization pinned to ``impl`` (the serving provider's). ``device_type``: the tensors the GEMMs run on."""

    device_type = "cuda"

    def __init__(self, *, impl: str | None = None):
        self.impl = impl

    def unavailable_reason(self, device: Any = None) -> str | None:
        """None when ``device`` (default the current GPU) can run FP8 grouped GEMMs, else why (one line)."""
        return grouped_fp8_unavailable_reason(device)

    def shape_ok(self, n: int, k: int) -> bool:
        """Whether experts of weight ``[E, n, k]`` can take FP8 grouped GEMMs."""
        return grouped_shape_ok(n, k)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
               gemms: tuple[bool, bool, bool] = ALL_FP8) -> torch.Tensor:
        """:func:`fp8_grouped_linear` (autograd included)."""
        return fp8_grouped_linear(x, weight, offs, gemms, impl=self.impl)

    def gemms(self, x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor,
              offs: torch.Tensor) -> dict[str, Callable[[], Any]]:
        """The three FP8 grouped GEMMs of one expert projection run alone, quantization and the weight grad's
        group padding included (what ``loongforge fp8 profile`` times)."""
        impl, e, m = self.impl, weight.shape[0], x.shape[0]

        def fwd8():
            q, s, _, _ = quantize_expert_weight(weight, plain=True, transposed=False, impl=impl)
            return _sgmm(*_rowwise(x, impl), q.transpose(-2, -1), s, offs, True)

        def dgrad8():
            _, _, qt, st = quantize_expert_weight(weight, plain=False, transposed=True, impl=impl)
            return _sgmm(*_rowwise(dy, impl), qt.transpose(-2, -1), st, offs, False)

        def wgrad8():
            dest, poffs, rows = padded_groups(offs, m)
            a, sa = _transposed_padded(dy, dest, rows, e, impl)
            b, sb = _transposed_padded(x, dest, rows, e, impl)
            return _sgmm(a, sa, b.t(), sb, poffs, False)

        return {"fwd": fwd8, "dgrad": dgrad8, "wgrad": wgrad8}


__all__ = ["ALIGN", "Fp8GroupedLinear", "Fp8GroupedLinears", "fp8_grouped_linear", "grouped_fp8_unavailable_reason",
           "grouped_shape_ok", "padded_groups", "quantize_expert_weight"]
