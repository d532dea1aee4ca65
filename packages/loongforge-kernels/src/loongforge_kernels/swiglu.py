"""SwiGLU on megatron's fused fc1 output: x = [..., 2F] -> silu(x[..., :F]) * x[..., F:].

Triton kernel -> autograd Function -> ``SwiGLU`` module. Math in fp32, output in the input dtype; the
backward recomputes silu instead of saving it (one read of x, one write of dx).
"""

from __future__ import annotations

import torch
from torch import nn

from loongforge_kernels._dispatch import jit, next_pow2, resolve, tl
from loongforge_kernels.references import swiglu_ref


@jit
def _swiglu_fwd_kernel(X, Y, stride_x, stride_y, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    a = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(X + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    y = a * tl.sigmoid(a) * b
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@jit
def _swiglu_bwd_kernel(DY, X, DX, stride_dy, stride_x, stride_dx, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(X + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(a)
    silu = a * s
    da = dy * b * s * (1.0 + a * (1.0 - s))
    db = dy * silu
    tl.store(DX + row * stride_dx + cols, da.to(DX.dtype.element_ty), mask=mask)
    tl.store(DX + row * stride_dx + n_cols + cols, db.to(DX.dtype.element_ty), mask=mask)


def _grid(n_rows: int, n_cols: int, device: torch.device) -> tuple[tuple[int, int], int, int]:
    # NOTE: the interpreter pays per program, so CPU runs take whole rows.
    block = min(next_pow2(n_cols), 1024 if device.type == "cuda" else 16384)
    num_warps = 4 if block <= 1024 else 8
    return (n_rows, -(-n_cols // block)), block, num_warps


class SwiGLUFunction(torch.autograd.Function):
    """Autograd wrapper of the SwiGLU kernels; saves only the input."""

    @staticmethod
    def forward(ctx, x):
        if x.shape[-1] % 2:
            raise ValueError(f"swiglu: last dim must be even (2 * ffn), got {x.shape[-1]}")
        x2 = x.reshape(-1, x.shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        n_rows, n_cols = x2.shape[0], x2.shape[1] // 2
        y = torch.empty(n_rows, n_cols, dtype=x.dtype, device=x.device)
        grid, block, warps = _grid(n_rows, n_cols, x.device)
        if n_rows and n_cols:
            _swiglu_fwd_kernel[grid](x2, y, x2.stride(0), y.stride(0), n_cols, BLOCK=block, num_warps=warps)
        ctx.save_for_backward(x2)
        ctx.in_shape = x.shape
        return y.view(*x.shape[:-1], n_cols)

    @staticmethod
    def backward(ctx, dy):
        (x2,) = ctx.saved_tensors
        n_rows, n_cols = x2.shape[0], x2.shape[1] // 2
        dy2 = dy.reshape(n_rows, n_cols)
        if dy2.stride(-1) != 1:
            dy2 = dy2.contiguous()
        dx = torch.empty_like(x2)
        grid, block, warps = _grid(n_rows, n_cols, x2.device)
        if n_rows and n_cols:
            _swiglu_bwd_kernel[grid](
                dy2, x2, dx, dy2.stride(0), x2.stride(0), dx.stride(0), n_cols, BLOCK=block, num_warps=warps
            )
        return dx.view(ctx.in_shape)


def swiglu(x: torch.Tensor, *, impl: str | None = None) -> torch.Tensor:
    """silu(x[..., :F]) * x[..., F:]; ``impl``: ``auto`` (None), ``torch`` or ``triton``."""
    if resolve(impl, x) == "triton":
        return SwiGLUFunction.apply(x)
    return swiglu_ref(x)


class SwiGLU(nn.Module):
    """SwiGLU activation on a fused [..., 2F] input (no parameters); ``impl`` as :func:`swiglu`'s."""

    def __init__(self, *, impl: str | None = None):
        super().__init__()
        self.impl = impl

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x, impl=self.impl)
