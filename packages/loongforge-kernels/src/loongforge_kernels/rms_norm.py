"""RMSNorm: Triton kernel -> autograd Function -> ``RMSNorm`` module, with the weight gradient.

Math in fp32, output in the input dtype; the weight may be fp32 with bf16 input (megatron's layout).
``zero_centered_gamma`` (megatron) scales by ``w + 1`` so a zero-initialised weight is the identity.
"""

from __future__ import annotations

import torch
from torch import nn

from loongforge_kernels._dispatch import jit, next_pow2, num_warps_for, resolve, sm_count, tl
from loongforge_kernels.references import rms_norm_ref

MAX_FUSED = 65536  # a row must fit in one program's registers


@jit
def _rms_norm_fwd_kernel(
    X, W, Y, RSTD, stride_x, stride_y, n_rows, n_cols, eps, w_offset, BLOCK: tl.constexpr, ROWS: tl.constexpr
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    rmask = rows < n_rows
    mask = rmask[:, None] & (cols < n_cols)[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32) + w_offset
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    tl.store(RSTD + rows, rstd, mask=rmask)
    y = x * rstd[:, None] * w[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@jit
def _rms_norm_bwd_kernel(
    DY,
    X,
    W,
    RSTD,
    DX,
    DW_PART,
    stride_dy,
    stride_x,
    stride_dx,
    n_rows,
    n_cols,
    w_offset,
    rows_per_prog,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Each program owns ``rows_per_prog`` consecutive rows, ROWS at a time, and writes one dw partial row."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    cmask = cols < n_cols
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32) + w_offset
    dw = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    row0 = pid.to(tl.int64) * rows_per_prog
    row_end = tl.minimum(row0 + rows_per_prog, n_rows)
    for i in range(0, rows_per_prog, ROWS):
        rows = row0 + i + tl.arange(0, ROWS)
        rmask = rows < row_end
        mask = rmask[:, None] & cmask[None, :]
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
        xhat = x * rstd[:, None]
        wdy = w[None, :] * dy
        c = tl.sum(xhat * wdy, axis=1) / n_cols
        dx = (wdy - xhat * c[:, None]) * rstd[:, None]
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
    tl.store(DW_PART + pid.to(tl.int64) * n_cols + cols, tl.sum(dw, axis=0), mask=cmask)


# Launch shape, swept on an H200 (benchmarks/tools/tune_rms_norm.py): rows per program step (elements per tile
# <= TILE) and backward programs per multiprocessor. All settings land within ~10% (3.1-3.5 TB/s fwd+bwd);
# this one was at or above torch.compile's GPU time at hidden 2048 and 4096.
TILE = {"fwd": 4096, "bwd": 2048}
BWD_PROGRAMS_PER_SM = 8


def _rows_per_tile(block: int, which: str) -> int:
    return max(1, TILE[which] // block)


class RMSNormFunction(torch.autograd.Function):
    """Autograd wrapper of the Triton kernels; saves x and the fp32 1/rms per row."""

    @staticmethod
    def forward(ctx, x, weight, eps, zero_centered_gamma):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        n_rows, n_cols = x2.shape
        block = next_pow2(n_cols)
        if block > MAX_FUSED:
            raise ValueError(f"rms_norm: hidden size {n_cols} exceeds the fused limit {MAX_FUSED}")
        weight_c = weight.contiguous()
        y = torch.empty_like(x2)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        offset = 1.0 if zero_centered_gamma else 0.0
        if n_rows:
            rows = _rows_per_tile(block, "fwd")
            _rms_norm_fwd_kernel[(-(-n_rows // rows),)](
                x2,
                weight_c,
                y,
                rstd,
                x2.stride(0),
                y.stride(0),
                n_rows,
                n_cols,
                eps,
                offset,
                BLOCK=block,
                ROWS=rows,
                num_warps=num_warps_for(block * rows),
            )
        ctx.save_for_backward(x2, weight_c, rstd)
        ctx.offset = offset
        ctx.block = block
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        n_rows, n_cols = x2.shape
        dy2 = dy.reshape(-1, n_cols)
        if dy2.stride(-1) != 1:
            dy2 = dy2.contiguous()
        dx = torch.empty_like(x2)
        n_progs = max(min(n_rows, sm_count(x2.device) * BWD_PROGRAMS_PER_SM), 1)
        rows_per_prog = -(-n_rows // n_progs) if n_rows else 0
        dw_part = torch.empty(n_progs, n_cols, dtype=torch.float32, device=x2.device)
        if n_rows:
            rows = _rows_per_tile(ctx.block, "bwd")
            _rms_norm_bwd_kernel[(n_progs,)](
                dy2,
                x2,
                weight,
                rstd,
                dx,
                dw_part,
                dy2.stride(0),
                x2.stride(0),
                dx.stride(0),
                n_rows,
                n_cols,
                ctx.offset,
                rows_per_prog,
                BLOCK=ctx.block,
                ROWS=rows,
                num_warps=num_warps_for(ctx.block * rows),
            )
        else:
            dw_part.zero_()
        dw = dw_part.sum(0).to(weight.dtype)
        return dx.view(dy.shape), dw, None, None


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    zero_centered_gamma: bool = False,
    impl: str | None = None,
) -> torch.Tensor:
    """RMS-normalise the last dim of ``x`` and scale by ``weight``; ``impl``: ``auto`` (None), ``torch`` or ``triton``."""
    if resolve(impl, x) == "triton":
        return RMSNormFunction.apply(x, weight, eps, zero_centered_gamma)
    return rms_norm_ref(x, weight, eps, zero_centered_gamma=zero_centered_gamma)


class RMSNorm(nn.Module):
    """RMSNorm layer over the last dim; the weight starts at 1 (0 with ``zero_centered_gamma``); ``impl`` as
    :func:`rms_norm`'s."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        *,
        zero_centered_gamma: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        impl: str | None = None,
    ):
        super().__init__()
        self.eps, self.impl = eps, impl
        self.zero_centered_gamma = zero_centered_gamma
        init = torch.zeros if zero_centered_gamma else torch.ones
        self.weight = nn.Parameter(init(hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, zero_centered_gamma=self.zero_centered_gamma, impl=self.impl)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma}"
