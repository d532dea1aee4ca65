"""MoE token permute / unpermute: Triton kernels -> autograd Functions -> ``moe_permute`` / ``moe_unpermute``.

``moe_permute`` copies each token to its k experts' slots in an expert-sorted buffer [T*k, H] (stable: tokens
keep their order inside an expert, as megatron's permute). ``moe_unpermute`` is the inverse weighted combine
``out[t] = sum_k probs[t, k] * permuted[row_id_map[t, k]]``. Every kernel program owns one token and gathers
or scatters its k rows, so no atomics are needed and the results are deterministic.
"""

from __future__ import annotations

import torch

from loongforge_kernels._dispatch import jit, next_pow2, resolve, tl
from loongforge_kernels.references import moe_permute_ref, moe_row_id_map, moe_unpermute_ref


@jit
def _permute_kernel(X, ROW_ID, Y, stride_x, stride_y, hidden, TOPK: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(X + t * stride_x + cols, mask=mask, other=0.0)
    for k in tl.static_range(TOPK):
        dst = tl.load(ROW_ID + t * TOPK + k).to(tl.int64)
        tl.store(Y + dst * stride_y + cols, x, mask=mask & (dst >= 0))


@jit
def _gather_sum_kernel(
    SRC,
    ROW_ID,
    PROBS,
    OUT,
    stride_src,
    stride_out,
    hidden,
    HAS_PROBS: tl.constexpr,
    TOPK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out[t] = sum_k p[t, k] * src[row_id[t, k]]: unpermute forward, and permute backward (p = 1)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in tl.static_range(TOPK):
        src = tl.load(ROW_ID + t * TOPK + k).to(tl.int64)
        row = tl.load(SRC + src * stride_src + cols, mask=mask & (src >= 0), other=0.0).to(tl.float32)
        if HAS_PROBS:
            row = row * tl.load(PROBS + t * TOPK + k).to(tl.float32)
        acc += row
    tl.store(OUT + t * stride_out + cols, acc.to(OUT.dtype.element_ty), mask=mask)


@jit
def _unpermute_bwd_kernel(
    DOUT,
    PERM,
    ROW_ID,
    PROBS,
    DPERM,
    DPROBS_PART,
    stride_dout,
    stride_perm,
    stride_dperm,
    hidden,
    n_col_blocks,
    HAS_PROBS: tl.constexpr,
    TOPK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cb = tl.program_id(1)
    cols = cb * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    dy = tl.load(DOUT + t * stride_dout + cols, mask=mask, other=0.0).to(tl.float32)
    for k in tl.static_range(TOPK):
        dst = tl.load(ROW_ID + t * TOPK + k).to(tl.int64)
        ok = mask & (dst >= 0)
        if HAS_PROBS:
            p = tl.load(PROBS + t * TOPK + k).to(tl.float32)
            tl.store(DPERM + dst * stride_dperm + cols, (dy * p).to(DPERM.dtype.element_ty), mask=ok)
            row = tl.load(PERM + dst * stride_perm + cols, mask=ok, other=0.0).to(tl.float32)
            tl.store(DPROBS_PART + (t * TOPK + k) * n_col_blocks + cb, tl.sum(dy * row, axis=0))
        else:
            tl.store(DPERM + dst * stride_dperm + cols, dy.to(DPERM.dtype.element_ty), mask=ok)


def _grid(n_tokens: int, hidden: int, device: torch.device) -> tuple[tuple[int, int], int, int]:
    block = min(next_pow2(hidden), 4096 if device.type == "cuda" else 65536)
    return (n_tokens, -(-hidden // block)), block, 8 if block >= 2048 else 4


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


class MoEPermuteFunction(torch.autograd.Function):
    """tokens [T, H] -> expert-sorted [T*k, H]; backward sums each token's k row grads."""

    @staticmethod
    def forward(ctx, tokens, row_id_map):
        x = _rows(tokens)
        n_tok, topk = row_id_map.shape
        # NOTE: zeros: rows of dropped slots (the tail) are written by no program
        y = torch.zeros(n_tok * topk, x.shape[1], dtype=x.dtype, device=x.device)
        grid, block, warps = _grid(n_tok, x.shape[1], x.device)
        if n_tok:
            _permute_kernel[grid](
                x,
                row_id_map,
                y,
                x.stride(0),
                y.stride(0),
                x.shape[1],
                TOPK=topk,
                BLOCK=block,
                num_warps=warps,
            )
        ctx.save_for_backward(row_id_map)
        return y

    @staticmethod
    def backward(ctx, dy):
        (row_id_map,) = ctx.saved_tensors
        dy = _rows(dy)
        n_tok, topk = row_id_map.shape
        dx = torch.empty(n_tok, dy.shape[1], dtype=dy.dtype, device=dy.device)
        grid, block, warps = _grid(n_tok, dy.shape[1], dy.device)
        if n_tok:
            _gather_sum_kernel[grid](
                dy,
                row_id_map,
                dy,
                dx,
                dy.stride(0),
                dx.stride(0),
                dy.shape[1],
                HAS_PROBS=False,
                TOPK=topk,
                BLOCK=block,
                num_warps=warps,
            )
        return dx, None


class MoEUnpermuteFunction(torch.autograd.Function):
    """expert-sorted [T*k, H] (+ probs [T, k]) -> [T, H]; backward gives grads for both."""

    @staticmethod
    def forward(ctx, permuted, row_id_map, probs):
        x = _rows(permuted)
        n_tok, topk = row_id_map.shape
        out = torch.empty(n_tok, x.shape[1], dtype=x.dtype, device=x.device)
        grid, block, warps = _grid(n_tok, x.shape[1], x.device)
        p = probs.contiguous() if probs is not None else None
        if n_tok:
            _gather_sum_kernel[grid](
                x,
                row_id_map,
                p if p is not None else x,
                out,
                x.stride(0),
                out.stride(0),
                x.shape[1],
                HAS_PROBS=p is not None,
                TOPK=topk,
                BLOCK=block,
                num_warps=warps,
            )
        ctx.save_for_backward(x, row_id_map, p)
        return out

    @staticmethod
    def backward(ctx, dout):
        x, row_id_map, p = ctx.saved_tensors
        dout = _rows(dout)
        n_tok, topk = row_id_map.shape
        grid, block, warps = _grid(n_tok, x.shape[1], x.device)
        dperm = torch.zeros_like(x)  # NOTE: rows of dropped slots get no gradient
        dprobs_part = torch.empty(n_tok * topk, grid[1], dtype=torch.float32, device=x.device)
        if n_tok:
            _unpermute_bwd_kernel[grid](
                dout,
                x,
                row_id_map,
                p if p is not None else x,
                dperm,
                dprobs_part,
                dout.stride(0),
                x.stride(0),
                dperm.stride(0),
                x.shape[1],
                grid[1],
                HAS_PROBS=p is not None,
                TOPK=topk,
                BLOCK=block,
                num_warps=warps,
            )
        dprobs = dprobs_part.sum(1).view(n_tok, topk).to(p.dtype) if p is not None else None
        return dperm, None, dprobs


def moe_permute(
    tokens: torch.Tensor,
    indices: torch.Tensor,
    *,
    num_experts: int | None = None,
    impl: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort tokens [T, H] by their top-k expert ``indices`` [T, k]; a negative index is a dropped slot (a token
    over an expert's capacity, or routed nowhere): it gets no row, and the buffer's last rows stay zero.

    Returns ``(permuted [T*k, H], row_id_map [T, k] int32, tokens_per_expert [E] int64)``; pass
    ``row_id_map`` to :func:`moe_unpermute`. ``num_experts`` (E) avoids a device sync for the count (and
    ``indices`` must then lie in ``[0, E)``).
    """
    if indices.dim() == 1:
        indices = indices[:, None]
    if indices.shape[0] != tokens.shape[0]:
        raise ValueError(
            f"moe_permute: indices {tuple(indices.shape)} do not match tokens {tuple(tokens.shape)}"
        )
    row_id_map = moe_row_id_map(indices)
    n_exp = (
        num_experts if num_experts is not None else int(indices.max().item()) + 1 if indices.numel() else 0
    )
    flat = indices.reshape(-1).long()
    kept = (flat >= 0).long()
    if num_experts is None:
        tokens_per_expert = torch.bincount(flat.clamp(min=0), weights=kept, minlength=n_exp).long()
    else:  # NOTE: no device sync (bincount reads the maximum back to size its output)
        tokens_per_expert = torch.zeros(n_exp, dtype=torch.int64, device=flat.device).index_add_(
            0, flat.clamp(min=0), kept)
    if resolve(impl, tokens) == "triton":
        permuted = MoEPermuteFunction.apply(tokens, row_id_map)
    else:
        permuted = moe_permute_ref(tokens, row_id_map)
    return permuted, row_id_map, tokens_per_expert


def moe_unpermute(
    permuted: torch.Tensor,
    row_id_map: torch.Tensor,
    probs: torch.Tensor | None = None,
    *,
    impl: str | None = None,
) -> torch.Tensor:
    """Combine expert outputs [T*k, H] back to tokens [T, H], weighted by ``probs`` [T, k] when given."""
    if probs is not None and probs.shape != row_id_map.shape:
        raise ValueError(
            f"moe_unpermute: probs {tuple(probs.shape)} must match row_id_map {tuple(row_id_map.shape)}"
        )
    if resolve(impl, permuted) == "triton":
        return MoEUnpermuteFunction.apply(permuted, row_id_map.contiguous(), probs)
    return moe_unpermute_ref(permuted, row_id_map, probs)
