"""Sparse MLA attention (DeepSeek-V3.2 DSA) in MLA's absorbed / MQA form, forward + backward.

Each query token attends only to the ``topk`` latent kv rows its indexer selected: q [T, H, D] with
D = d_v + d_rope (DeepSeek: 512 + 64), kv [T_kv, G, D] shared by the H / G heads of a group (value = the first
d_v channels), indices [T, G, topk] (< 0 or >= T_kv: masked; causality is expressed by the indices). Output
o [T, H, d_v]; the fp32 lse [T, H] (natural log, -inf for a query with no valid index) is kept for backward.

Two GPU implementations share this contract, the reference and the tests: the Triton kernels below, and the
TileLang kernels of :mod:`loongforge_kernels.tilelang_sparse_mla` (``impl="tilelang"``; tilelang is an optional
dependency, ``pip install 'loongforge-kernels[tilelang]'``, and JIT-compiles through TVM and nvcc for SM >= 9.0).
``auto`` on CUDA takes TileLang when it can run the call (importable, Hopper or newer, bf16 / fp16, head dims
multiples of 16), else Triton; ``impl="triton"`` pins Triton. Without a GPU
the TileLang kernels are compiled for sm_90a and run serially on TileLang's C backend against the reference
(tests/test_sparse_mla.py, where tilelang and nvcc are installed); tests/test_gpu.py runs them on the GPU.

NOTE: both follow the TileLang design (tile-lang ``examples/deepseek_v32`` sparse_mla_fwd / sparse_mla_bwd,
and FlashMLA's sparse kernels): one program per (query token, kv group, block of heads), topk walked in blocks
of BLOCK_K gathered kv rows, online softmax in fp32 (exp2); the backward recomputes p from lse, accumulates dq
in the program and scatters dkv into an fp32 buffer with atomics (kv rows are shared across queries, so dkv's
summation order, and its last bits, vary from run to run).
"""

from __future__ import annotations

import functools

import torch

from loongforge_kernels._dispatch import jit, next_pow2, resolve, tl
from loongforge_kernels.references import sparse_mla_ref

LOG2E = 1.4426950408889634


@jit
def _sparse_mla_fwd_kernel(
    Q,
    KV,
    IDX,
    OUT,
    LSE,
    stride_qt,
    stride_qh,
    stride_kvt,
    stride_kvg,
    stride_it,
    stride_ig,
    stride_ot,
    stride_oh,
    heads_per_group,
    n_heads,
    n_kv,
    topk,
    d_v,
    d_rope,
    scale_log2,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    local = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = local < heads_per_group
    heads = (g * heads_per_group + local).to(tl.int64)
    dv = tl.arange(0, BLOCK_DV)
    dr = tl.arange(0, BLOCK_DR)
    vmask = dv < d_v
    rmask = dr < d_rope
    q_rows = Q + t * stride_qt + heads[:, None] * stride_qh
    q_v = tl.load(q_rows + dv[None, :], mask=hmask[:, None] & vmask[None, :], other=0.0).to(DOT_DTYPE)
    q_r = tl.load(q_rows + d_v + dr[None, :], mask=hmask[:, None] & rmask[None, :], other=0.0).to(DOT_DTYPE)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    idx_row = IDX + t * stride_it + g * stride_ig
    kv_group = KV + g * stride_kvg
    for k0 in range(0, topk, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(idx_row + offs, mask=offs < topk, other=-1).to(tl.int64)
        valid = (idx >= 0) & (idx < n_kv)
        kv_rows = kv_group + idx[:, None] * stride_kvt
        k_v = tl.load(kv_rows + dv[None, :], mask=valid[:, None] & vmask[None, :], other=0.0).to(DOT_DTYPE)
        k_r = tl.load(kv_rows + d_v + dr[None, :], mask=valid[:, None] & rmask[None, :], other=0.0).to(
            DOT_DTYPE
        )
        s = tl.dot(q_v, tl.trans(k_v), input_precision=DOT_PRECISION)
        s = tl.dot(q_r, tl.trans(k_r), s, input_precision=DOT_PRECISION)
        s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # all masked so far: keep exp2 free of NaN
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(
            p.to(KV.dtype.element_ty).to(DOT_DTYPE), k_v, acc * alpha[:, None], input_precision=DOT_PRECISION
        )
        m_i = m_new

    has_any = l_i > 0.0
    o = acc / tl.where(has_any, l_i, 1.0)[:, None]
    lse = tl.where(has_any, (m_i + tl.log2(tl.where(has_any, l_i, 1.0))) / 1.4426950408889634, float("-inf"))
    tl.store(
        OUT + t * stride_ot + heads[:, None] * stride_oh + dv[None, :],
        o.to(OUT.dtype.element_ty),
        mask=hmask[:, None] & vmask[None, :],
    )
    tl.store(LSE + t * n_heads + heads, lse, mask=hmask)


@jit
def _sparse_mla_delta_kernel(OUT, DO, DELTA, n_rows, d_v, BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr):
    """delta[row] = sum_d o[row, d] * do[row, d] in fp32, rows = (token, head) of contiguous o / do."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_DV)
    mask = (rows < n_rows)[:, None] & (cols < d_v)[None, :]
    offs = rows[:, None] * d_v + cols[None, :]
    o = tl.load(OUT + offs, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(DELTA + rows, tl.sum(o * do, axis=1), mask=rows < n_rows)


@jit
def _sparse_mla_bwd_kernel(
    Q,
    KV,
    IDX,
    DO,
    LSE,
    DELTA,
    DQ,
    DKV,
    stride_qt,
    stride_qh,
    stride_kvt,
    stride_kvg,
    stride_it,
    stride_ig,
    stride_dot,
    stride_doh,
    stride_dqt,
    stride_dqh,
    stride_dkvt,
    stride_dkvg,
    heads_per_group,
    n_heads,
    n_kv,
    topk,
    d_v,
    d_rope,
    sm_scale,
    scale_log2,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """dq of one (token, group, head block) in registers; its dkv contributions scattered with fp32 atomics.

    DKV is an fp32 buffer, cast to kv's dtype by the caller.
    """
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    local = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = local < heads_per_group
    heads = (g * heads_per_group + local).to(tl.int64)
    dv = tl.arange(0, BLOCK_DV)
    dr = tl.arange(0, BLOCK_DR)
    vmask = dv < d_v
    rmask = dr < d_rope
    hv_mask = hmask[:, None] & vmask[None, :]
    hr_mask = hmask[:, None] & rmask[None, :]
    q_rows = Q + t * stride_qt + heads[:, None] * stride_qh
    q_v = tl.load(q_rows + dv[None, :], mask=hv_mask, other=0.0).to(DOT_DTYPE)
    q_r = tl.load(q_rows + d_v + dr[None, :], mask=hr_mask, other=0.0).to(DOT_DTYPE)
    do_rows = DO + t * stride_dot + heads[:, None] * stride_doh
    do = tl.load(do_rows + dv[None, :], mask=hv_mask, other=0.0).to(DOT_DTYPE)
    lse = tl.load(LSE + t * n_heads + heads, mask=hmask, other=0.0)
    lse2 = tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)  # no valid index: every p is masked
    delta = tl.load(DELTA + t * n_heads + heads, mask=hmask, other=0.0)

    dq_v = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    dq_r = tl.zeros([BLOCK_H, BLOCK_DR], dtype=tl.float32)
    idx_row = IDX + t * stride_it + g * stride_ig
    kv_group = KV + g * stride_kvg
    dkv_group = DKV + g * stride_dkvg
    for k0 in range(0, topk, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(idx_row + offs, mask=offs < topk, other=-1).to(tl.int64)
        valid = (idx >= 0) & (idx < n_kv)
        kv_rows = kv_group + idx[:, None] * stride_kvt
        kv_mask_v = valid[:, None] & vmask[None, :]
        kv_mask_r = valid[:, None] & rmask[None, :]
        k_v = tl.load(kv_rows + dv[None, :], mask=kv_mask_v, other=0.0).to(DOT_DTYPE)
        k_r = tl.load(kv_rows + d_v + dr[None, :], mask=kv_mask_r, other=0.0).to(DOT_DTYPE)
        s = tl.dot(q_v, tl.trans(k_v), input_precision=DOT_PRECISION)
        s = tl.dot(q_r, tl.trans(k_r), s, input_precision=DOT_PRECISION)
        p = tl.where(hmask[:, None] & valid[None, :], tl.exp2(s * scale_log2 - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(k_v), input_precision=DOT_PRECISION)
        ds = (p * (dp - delta[:, None]) * sm_scale).to(KV.dtype.element_ty).to(DOT_DTYPE)
        dq_v = tl.dot(ds, k_v, dq_v, input_precision=DOT_PRECISION)
        dq_r = tl.dot(ds, k_r, dq_r, input_precision=DOT_PRECISION)
        dk_v = tl.dot(tl.trans(p.to(KV.dtype.element_ty).to(DOT_DTYPE)), do, input_precision=DOT_PRECISION)
        dk_v = tl.dot(tl.trans(ds), q_v, dk_v, input_precision=DOT_PRECISION)
        dk_r = tl.dot(tl.trans(ds), q_r, input_precision=DOT_PRECISION)
        dkv_rows = dkv_group + idx[:, None] * stride_dkvt
        tl.atomic_add(dkv_rows + dv[None, :], dk_v, mask=kv_mask_v, sem="relaxed")
        tl.atomic_add(dkv_rows + d_v + dr[None, :], dk_r, mask=kv_mask_r, sem="relaxed")

    dq_rows = DQ + t * stride_dqt + heads[:, None] * stride_dqh
    tl.store(dq_rows + dv[None, :], dq_v.to(DQ.dtype.element_ty), mask=hv_mask)
    tl.store(dq_rows + d_v + dr[None, :], dq_r.to(DQ.dtype.element_ty), mask=hr_mask)


# (BLOCK_H, BLOCK_K, num_warps, num_stages) the autotuner tries on CUDA; configs with BLOCK_H above the
# heads per group (rounded up to a power of two, at least 16) are pruned.
# NOTE: chosen from ptxas on sm_90 at d_v 512 + d_rope 64 (bf16): the forward's [64, 512] fp32 accumulator
# is half the registers of 8 warps (BLOCK_H 64 spills ~350 B, 32 none); the backward holds dq and a dkv
# block, and at BLOCK_H 64 stages q and dO twice in shared memory (one copy per MMA layout, > 227 KB), so it
# tiles at most 32 heads; BLOCK_K 64 spills kilobytes in the backward.
CUDA_CONFIGS = {
    "fwd": ((64, 32, 8, 2), (64, 16, 8, 1), (32, 32, 8, 2), (16, 32, 4, 2)),
    "bwd": ((32, 16, 8, 1), (32, 32, 8, 2), (16, 16, 4, 1), (16, 32, 4, 2)),
}
INTERPRETER_BLOCK = 16  # BLOCK_H and BLOCK_K off CUDA: small, so the tests walk several blocks


def _prune(configs, named_args, **_):
    cap = max(16, next_pow2(named_args["heads_per_group"]))
    return [c for c in configs if c.kwargs["BLOCK_H"] <= cap]


@functools.cache
def _tuned(which: str):
    """The autotuned kernel for CUDA, built on first use (never under the interpreter)."""
    import triton

    configs = [
        triton.Config({"BLOCK_H": bh, "BLOCK_K": bk}, num_warps=w, num_stages=st)
        for bh, bk, w, st in CUDA_CONFIGS[which]
    ]
    kernel = _sparse_mla_fwd_kernel if which == "fwd" else _sparse_mla_bwd_kernel
    return triton.autotune(
        configs,
        key=["heads_per_group", "d_v", "d_rope"],
        prune_configs_by={"early_config_prune": _prune},
        reset_to_zero=["DKV"] if which == "bwd" else None,  # benchmarking configs accumulates into it
    )(kernel)


def _dot_options(dtype: torch.dtype, device: torch.device) -> dict:
    """The dtype tl.dot operands are cast to, and the precision of fp32 dots.

    NOTE: Triton's interpreter stores bf16 as raw uint16 and multiplies those in tl.dot, so off CUDA the
    operands go to fp32 (p and ds are still rounded to the input dtype first, as on the GPU). fp32 inputs are
    the exactness path: "ieee", not Triton's default tf32 (10-bit mantissa).
    """
    if device.type != "cuda" or dtype == torch.float32:
        return dict(DOT_DTYPE=tl.float32, DOT_PRECISION="ieee")
    return dict(
        DOT_DTYPE={torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype], DOT_PRECISION="tf32"
    )


def _launch(which: str, args: tuple, *, t: int, g: int, hpg: int, d_v: int, d_rope: int, q: torch.Tensor):
    """Run the forward or backward kernel over (token, kv group, head block) programs."""
    consts = dict(
        BLOCK_DV=max(next_pow2(d_v), 16),
        BLOCK_DR=max(next_pow2(max(d_rope, 1)), 16),  # tl.dot needs >= 16; d_rope 0 is all masked
        **_dot_options(q.dtype, q.device),
    )
    if q.device.type == "cuda":
        _tuned(which)[lambda meta: (t, g, -(-hpg // meta["BLOCK_H"]))](*args, **consts)
        return
    kernel = _sparse_mla_fwd_kernel if which == "fwd" else _sparse_mla_bwd_kernel
    block = INTERPRETER_BLOCK
    kernel[(t, g, -(-hpg // block))](*args, BLOCK_H=block, BLOCK_K=block, **consts)


class SparseMLAFunction(torch.autograd.Function):
    """Autograd wrapper of the Triton kernels; saves q, kv, indices, o and the fp32 lse."""

    @staticmethod
    def forward(ctx, q, kv, indices, sm_scale, d_v):
        t, h, d = q.shape
        n_kv, g = kv.shape[0], kv.shape[1]
        hpg = h // g
        o = torch.empty(t, h, d_v, dtype=q.dtype, device=q.device)
        lse = torch.empty(t, h, dtype=torch.float32, device=q.device)
        if t and indices.shape[-1]:
            args = (
                q,
                kv,
                indices,
                o,
                lse,
                q.stride(0),
                q.stride(1),
                kv.stride(0),
                kv.stride(1),
                indices.stride(0),
                indices.stride(1),
                o.stride(0),
                o.stride(1),
                hpg,
                h,
                n_kv,
                indices.shape[-1],
                d_v,
                d - d_v,
                sm_scale * LOG2E,
            )
            _launch("fwd", args, t=t, g=g, hpg=hpg, d_v=d_v, d_rope=d - d_v, q=q)
        else:
            o.zero_()
            lse.fill_(float("-inf"))
        ctx.save_for_backward(q, kv, indices, o, lse)
        ctx.sm_scale = sm_scale
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, kv, indices, o, lse = ctx.saved_tensors
        t, h, d = q.shape
        n_kv, g = kv.shape[0], kv.shape[1]
        d_v = o.shape[-1]
        hpg = h // g
        do = do.contiguous()
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        if not (t and indices.shape[-1]):
            return dq.zero_(), dkv.to(kv.dtype), None, None, None
        delta = torch.empty(t, h, dtype=torch.float32, device=q.device)
        block_r = 16
        _sparse_mla_delta_kernel[(-(-t * h // block_r),)](
            o, do, delta, t * h, d_v, BLOCK_R=block_r, BLOCK_DV=max(next_pow2(d_v), 16)
        )
        args = (
            q,
            kv,
            indices,
            do,
            lse,
            delta,
            dq,
            dkv,
            q.stride(0),
            q.stride(1),
            kv.stride(0),
            kv.stride(1),
            indices.stride(0),
            indices.stride(1),
            do.stride(0),
            do.stride(1),
            dq.stride(0),
            dq.stride(1),
            dkv.stride(0),
            dkv.stride(1),
            hpg,
            h,
            n_kv,
            indices.shape[-1],
            d_v,
            d - d_v,
            ctx.sm_scale,
            ctx.sm_scale * LOG2E,
        )
        _launch("bwd", args, t=t, g=g, hpg=hpg, d_v=d_v, d_rope=d - d_v, q=q)
        return dq, dkv.to(kv.dtype), None, None, None


def _validate(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, d_v: int) -> None:
    if q.dim() != 3 or kv.dim() != 3 or indices.dim() != 3:
        raise ValueError(
            f"sparse_mla_attention: want q [T, H, D], kv [T_kv, G, D], indices [T, G, topk]; got "
            f"{tuple(q.shape)}, {tuple(kv.shape)}, {tuple(indices.shape)}"
        )
    t, h, d = q.shape
    g = kv.shape[1]
    if kv.shape[2] != d or g == 0 or h % g:
        raise ValueError(
            f"sparse_mla_attention: kv {tuple(kv.shape)} does not fit q {tuple(q.shape)} (H % G == 0)"
        )
    if tuple(indices.shape[:2]) != (t, g):
        raise ValueError(
            f"sparse_mla_attention: indices {tuple(indices.shape)} should start with (T, G) = {(t, g)}"
        )
    if indices.is_floating_point() or indices.is_complex():
        raise ValueError(f"sparse_mla_attention: indices must be an integer tensor, got {indices.dtype}")
    if not 0 < d_v <= d:
        raise ValueError(f"sparse_mla_attention: d_v={d_v} must be in (0, D={d}]")
    if q.dtype != kv.dtype:
        raise ValueError(f"sparse_mla_attention: q is {q.dtype} but kv is {kv.dtype}")


def sparse_mla_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float | None = None,
    d_v: int = 512,
    *,
    return_lse: bool = False,
    impl: str | None = None,
):
    """DSA sparse attention, MLA absorbed form: o[t, h] = softmax_k(q[t, h] . kv[idx[t, g, k], g]) @ v.

    q [T, H, D], kv [T_kv, G, D] (value = its first ``d_v`` channels), indices [T, G, topk] int (< 0 or
    >= T_kv: masked; a query with none valid gets zeros). ``sm_scale`` defaults to D**-0.5 (TileLang's
    example; DeepSeek-V3.2 passes its own). Returns o [T, H, d_v], and the fp32 lse [T, H] with ``return_lse``.
    Grads flow to q and kv; ``impl``: ``auto`` (None), ``torch``, ``triton`` or ``tilelang``.
    """
    _validate(q, kv, indices, d_v)
    scale = q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
    if _use_tilelang(impl, q, d_v):
        from loongforge_kernels.tilelang_sparse_mla import sparse_mla_attention_tilelang

        return sparse_mla_attention_tilelang(q, kv, indices, scale, d_v, return_lse)
    if resolve(impl, q) == "torch":
        return sparse_mla_ref(q, kv, indices, scale, d_v, return_lse=return_lse)
    q_c = q if q.stride(-1) == 1 else q.contiguous()
    kv_c = kv if kv.stride(-1) == 1 else kv.contiguous()
    idx = indices.to(torch.int32)
    idx = idx if idx.stride(-1) == 1 else idx.contiguous()
    o, lse = SparseMLAFunction.apply(q_c, kv_c, idx, scale, d_v)
    return (o, lse) if return_lse else o


def _use_tilelang(impl: str | None, q: torch.Tensor, d_v: int) -> bool:
    """``impl="tilelang"`` always (it raises with the reason if it cannot run); ``auto`` on CUDA when it can."""
    if impl == "tilelang":
        return True
    if q.device.type != "cuda" or (impl or "auto") != "auto":
        return False
    from loongforge_kernels.tilelang_sparse_mla import unsupported_reason

    return unsupported_reason(q, d_v) is None


def dsa_topk_indices(index_scores: torch.Tensor, topk: int, causal: bool = True) -> torch.Tensor:
    """The lightning indexer's selection step: the ``topk`` highest-scoring keys per query, as kernel indices.

    index_scores [T, T_kv] (or [T, G, T_kv] for G kv groups); returns int32 [T, G, topk] (G = 1 for 2-D
    input) in descending score order. ``causal`` masks key j for query i when j > i + T_kv - T (queries are the
    last T positions). Masked (or -inf scored) slots, and slots beyond the valid keys, are -1.
    """
    scores = index_scores.unsqueeze(1) if index_scores.dim() == 2 else index_scores
    if scores.dim() != 3:
        raise ValueError(
            f"dsa_topk_indices: want scores [T, T_kv] or [T, G, T_kv], got {tuple(index_scores.shape)}"
        )
    t, _, n_kv = scores.shape
    if causal:
        q_pos = torch.arange(t, device=scores.device) + (n_kv - t)
        future = torch.arange(n_kv, device=scores.device)[None, :] > q_pos[:, None]
        scores = scores.masked_fill(future.unsqueeze(1), float("-inf"))
    k = min(topk, n_kv)
    vals, idx = scores.topk(k, dim=-1)
    idx = torch.where(vals == float("-inf"), -1, idx).to(torch.int32)
    if k < topk:
        idx = torch.nn.functional.pad(idx, (0, topk - k), value=-1)
    return idx


__all__ = ["SparseMLAFunction", "dsa_topk_indices", "sparse_mla_attention", "sparse_mla_ref"]
