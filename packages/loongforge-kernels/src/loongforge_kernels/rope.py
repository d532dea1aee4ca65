"""Rotary position embedding in megatron's layouts: Triton kernel -> autograd Function -> ``apply_rope``.

Semantics are megatron-core's ``_apply_rotary_pos_emb_bshd`` / ``_apply_rotary_pos_emb_thd`` with
``rotary_interleaved=False`` (rotate-half) and a context-parallel size of 1:
``out = t * cos(f) + rotate_half(t) * sin(f)`` on the first ``rot_dim = freqs.shape[-1]`` channels; the
rest pass through. cos / sin are computed in fp32 inside the kernel (no cached tables to keep in sync).
"""

from __future__ import annotations

import torch

from loongforge_kernels._dispatch import jit, next_pow2, resolve, tl
from loongforge_kernels.references import rope_ref


@jit
def _rope_kernel(
    X,
    FREQS,
    CU,
    Y,
    stride_xr,
    stride_xh,
    stride_yr,
    stride_yh,
    stride_fs,
    stride_fb,
    batch,
    n_seqs,
    n_heads,
    head_dim,
    half,
    POS_MODE: tl.constexpr,
    BACKWARD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    BLOCK_SEQ: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    if POS_MODE == 0:  # sbhd: row r is (s, b) = (r // batch, r % batch)
        f_row = FREQS + (r // batch) * stride_fs + (r % batch) * stride_fb
    elif POS_MODE == 1:  # THD: position within the sequence; its start is the last cu_seqlens entry <= r
        k = tl.arange(0, BLOCK_SEQ)
        starts = tl.load(CU + k, mask=k < n_seqs, other=0).to(tl.int64)
        f_row = FREQS + (r - tl.max(tl.where(starts <= r, starts, 0), axis=0)) * stride_fs
    else:  # THD with one freqs row per packed token
        f_row = FREQS + r * stride_fs
    j = tl.arange(0, BLOCK_HALF)
    jm = j < half
    f1 = tl.load(f_row + j, mask=jm, other=0.0).to(tl.float32)
    f2 = tl.load(f_row + half + j, mask=jm, other=0.0).to(tl.float32)
    c1 = tl.cos(f1)[None, :]
    s1 = tl.sin(f1)[None, :]
    c2 = tl.cos(f2)[None, :]
    s2 = tl.sin(f2)[None, :]
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = h < n_heads
    m = hm[:, None] & jm[None, :]
    xp = X + r * stride_xr + h[:, None] * stride_xh + j[None, :]
    yp = Y + r * stride_yr + h[:, None] * stride_yh + j[None, :]
    x1 = tl.load(xp, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(xp + half, mask=m, other=0.0).to(tl.float32)
    if BACKWARD:  # the transpose of the rotation: dx1 = dy1 c1 + dy2 s2, dx2 = dy2 c2 - dy1 s1
        o1 = x1 * c1 + x2 * s2
        o2 = x2 * c2 - x1 * s1
    else:
        o1 = x1 * c1 - x2 * s1
        o2 = x2 * c2 + x1 * s2
    tl.store(yp, o1.to(Y.dtype.element_ty), mask=m)
    tl.store(yp + half, o2.to(Y.dtype.element_ty), mask=m)
    if BLOCK_PASS > 0:  # partial rotary: copy the untouched tail
        p = tl.arange(0, BLOCK_PASS)
        pm = hm[:, None] & (p < head_dim - 2 * half)[None, :]
        tail = tl.load(X + r * stride_xr + h[:, None] * stride_xh + 2 * half + p[None, :], mask=pm, other=0.0)
        tl.store(Y + r * stride_yr + h[:, None] * stride_yh + 2 * half + p[None, :], tail, mask=pm)


def _launch(x3, freqs2, cu_seqlens, *, batch: int, pos_mode: int, backward: bool):
    """x3: [R, h, d] (last dim contiguous); freqs2: [S, B_f, rot] fp32; pos_mode as in the kernel."""
    n_rows, n_heads, head_dim = x3.shape
    rot = freqs2.shape[-1]
    half = rot // 2
    y = torch.empty_like(x3)
    n_seqs = cu_seqlens.numel() - 1 if cu_seqlens is not None else 1
    block_half = next_pow2(half)
    block_pass = next_pow2(head_dim - rot) if head_dim > rot else 0
    block_h = min(next_pow2(n_heads), max(1, 4096 // block_half))
    if x3.device.type == "cpu":  # the interpreter pays per program
        block_h = next_pow2(n_heads)
    grid = (n_rows, -(-n_heads // block_h))
    if n_rows and n_heads:
        _rope_kernel[grid](
            x3,
            freqs2,
            cu_seqlens if cu_seqlens is not None else freqs2,
            y,
            x3.stride(0),
            x3.stride(1),
            y.stride(0),
            y.stride(1),
            freqs2.stride(0),
            freqs2.stride(1) if freqs2.shape[1] > 1 else 0,
            batch,
            n_seqs,
            n_heads,
            head_dim,
            half,
            POS_MODE=pos_mode,
            BACKWARD=backward,
            BLOCK_H=block_h,
            BLOCK_HALF=block_half,
            BLOCK_PASS=block_pass,
            BLOCK_SEQ=next_pow2(n_seqs),
            num_warps=4 if block_h * block_half <= 2048 else 8,
        )
    return y


class RoPEFunction(torch.autograd.Function):
    """Autograd wrapper: the backward is the same kernel with the rotation transposed. No grad for freqs."""

    @staticmethod
    def forward(ctx, x3, freqs2, cu_seqlens, batch, pos_mode):
        y = _launch(x3, freqs2, cu_seqlens, batch=batch, pos_mode=pos_mode, backward=False)
        ctx.save_for_backward(freqs2, cu_seqlens)
        ctx.batch, ctx.pos_mode = batch, pos_mode
        return y

    @staticmethod
    def backward(ctx, dy):
        freqs2, cu_seqlens = ctx.saved_tensors
        dy = dy if dy.stride(-1) == 1 else dy.contiguous()
        dx = _launch(dy, freqs2, cu_seqlens, batch=ctx.batch, pos_mode=ctx.pos_mode, backward=True)
        return dx, None, None, None, None


def _as_rows(t: torch.Tensor, n_rows: int) -> torch.Tensor:
    t3 = t.reshape(n_rows, t.shape[-2], t.shape[-1])
    return t3 if t3.stride(-1) == 1 else t3.contiguous()


def apply_rope(
    x: torch.Tensor,
    freqs: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None = None,
    impl: str | None = None,
) -> torch.Tensor:
    """Rotate ``x`` by ``freqs`` (megatron's RotaryEmbedding output, [s, 1, 1, rot_dim], non-interleaved).

    ``x`` is [s, b, h, d] (sbhd), or packed [t, h, d] with ``cu_seqlens`` [n_seqs + 1] (THD). In THD, positions
    restart at 0 in each sequence unless ``freqs`` has exactly t rows (then row i is token i's, as megatron).
    """
    rot = freqs.shape[-1]
    if rot % 2 or rot > x.shape[-1]:
        raise ValueError(f"apply_rope: rot_dim {rot} must be even and <= head dim {x.shape[-1]}")
    if resolve(impl, x) == "torch":
        return rope_ref(x, freqs, cu_seqlens=cu_seqlens)
    f = freqs.float().contiguous()
    if cu_seqlens is None:
        if x.dim() != 4:
            raise ValueError(f"apply_rope: expected sbhd input [s, b, h, d], got shape {tuple(x.shape)}")
        s, b = x.shape[:2]
        f2 = f.reshape(f.shape[0], -1, rot)  # [S, 1 or b, rot]
        if f2.shape[0] < s or f2.shape[1] not in (1, b):
            raise ValueError(f"apply_rope: freqs {tuple(freqs.shape)} does not cover x {tuple(x.shape)}")
        y = RoPEFunction.apply(_as_rows(x, s * b), f2, None, b, 0)
        return y.view(x.shape)
    if x.dim() != 3:
        raise ValueError(
            f"apply_rope: expected THD input [t, h, d] with cu_seqlens, got shape {tuple(x.shape)}"
        )
    n_tok = x.shape[0]
    mode = 2 if f.shape[0] == n_tok else 1
    y = RoPEFunction.apply(
        _as_rows(x, n_tok), f.reshape(f.shape[0], 1, rot), cu_seqlens.contiguous(), 1, mode
    )
    return y.view(x.shape)
