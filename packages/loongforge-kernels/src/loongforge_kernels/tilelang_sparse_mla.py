"""Sparse MLA attention (DSA) as TileLang kernels: forward, and backward (delta preprocess + main pass).

Same contract as :mod:`loongforge_kernels.sparse_mla` (whose Triton kernels are the other GPU path and whose
reference is the truth): q [T, H, D], kv [T_kv, G, D] (value = first d_v channels), indices [T, G, topk]
(< 0 or >= T_kv masked); o [T, H, d_v] in q's dtype and the fp32 natural-log lse [T, H] (-inf, and o = 0, for a
query with no valid index). Backward: dq, and dkv summed in an fp32 buffer with atomics, then cast.

Tiling (one CTA per (query token, block of heads, kv group); the group's heads share the gathered kv rows):

- forward: BLOCK_H heads (16..64: the heads of a group rounded up to a power of two; more heads take more
  CTAs along grid y) x BLOCK_K = 32 gathered kv rows per step, 8 warps, 3 pipeline stages (the gathers lower
  to cp.async, prefetched two blocks ahead). q stays in shared memory, the [BLOCK_H, d_v] fp32 accumulator in
  registers; online softmax in fp32 with exp2 (scores pre-scaled by sm_scale * log2 e); p is rounded to q's
  dtype for P @ V. At DeepSeek's 64 heads, 512 + 64: q 72 KiB + 3 x 36 KiB kv + 4 KiB p (186 KiB with the
  reduction scratch), 255 registers, no spills (ptxas, sm_90a).
- backward: BLOCK_H heads x BLOCK_K = 32 kv rows, 8 warps, not pipelined: the loop holds dq [BLOCK_H, D] and
  the block's dkv [BLOCK_K, D] in fp32 registers (180 KiB shared memory, 255 registers, 16 B spilled at
  DeepSeek's shape). p is recomputed from the saved lse; dS = p * (dP - delta) * sm_scale; dq accumulates
  over topk, each block's dkv rows are added to global memory with fp32 atomics (vectorized pairs), so dkv's
  last bits vary from run to run, as with the Triton kernel.
- fewer warps when a GEMM tile is too small to split 8 ways (TileLang gives each warp >= 16 x 8 of it).
- delta = rowsum(o * dO) over (token, head) rows: 32 rows per CTA, d_v walked in chunks of 128.

Masking: padded heads (the heads of a group not a multiple of BLOCK_H) load zeros and are never stored; the
topk tail of the last block and invalid indices gather kv row 0 (a harmless in-bounds row) and get score
-inf / p = 0, and their dkv is not written. A query whose indices are all invalid keeps l = 0: o = 0,
lse = -inf, and p = 0 in the backward.

tilelang is optional and imported lazily: this module imports without it. Kernels are compiled by
``tilelang.compile`` on first use and cached per (shape parameters, dtype, scale) in-process (and on disk by
tilelang's own cache); token counts are dynamic, so one compile serves every sequence length.
"""

# NOTE: no ``from __future__ import annotations``: TileLang evaluates the kernels' parameter annotations
# (T.Tensor shapes built from closure variables), which string annotations would hide.
import functools
import math
import os

import torch

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
MIN_TILELANG = (0, 1, 15)
DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}

# Tiling, see the module docstring. NOTE: chosen from ptxas / shared memory on sm_90a at 64 heads x (512 + 64)
# without a GPU to time them: a forward BLOCK_K of 64 with 2 stages spills (12 B) and needs 226 of the 227 KiB
# of shared memory; 32 x 3 stages spills nothing. A backward BLOCK_K of 64 spills 1 KiB, 16 halves the MMA N.
FWD = dict(block_k=32, max_warps=8, stages=3)
BWD = dict(block_k=32, max_warps=8)
DELTA = dict(rows=32, chunk=128, threads=128)
MAX_BLOCK_H = 64
TARGET = "auto"  # tilelang picks the current GPU (sm_90a on Hopper); the CPU-only tests pass their own

PASS_CONFIGS = {
    # gathers are indexed per row: no TMA, and no producer / consumer warp specialization to feed it
    "tl.disable_tma_lower": True,
    "tl.disable_warp_specialized": True,
}


def block_h(heads_per_group: int) -> int:
    """Heads per CTA: the group's heads as a power of two in [16, 64] (16: the MMA's smallest M)."""
    return min(MAX_BLOCK_H, max(16, 1 << max(heads_per_group - 1, 0).bit_length()))


def num_warps(max_warps: int, *gemm_outputs: tuple[int, int]) -> int:
    """The most warps (a power of two <= ``max_warps``) that split every GEMM output [M, N] of a kernel.

    TileLang gives each warp of an MMA a multiple of 16 rows and 8 columns (WGMMA, at M >= 64, groups 4 warps
    along M, which our multiples of 16 always allow), so few heads with a short kv block need fewer warps.
    """
    warps = max_warps
    while warps > 1 and not all(
        any(
            m % (16 * wm) == 0 and n % (8 * (warps // wm)) == 0
            for wm in range(1, warps + 1)
            if warps % wm == 0
        )
        for m, n in gemm_outputs
    ):
        warps //= 2
    return warps


@functools.cache
def _setup_error() -> str | None:
    """Why tilelang cannot build kernels here (not importable, too old, no nvcc), or None."""
    try:
        import tilelang
        from tilelang.contrib.nvcc import get_nvcc_compiler
    except Exception as exc:  # not installed, or a broken install (missing libs, incompatible torch)
        why = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:120]}"
        return f"tilelang is not importable ({why}); pip install 'loongforge-kernels[tilelang]'"
    version = tuple(int(p) for p in tilelang.__version__.split("+")[0].split(".")[:3] if p.isdigit())
    if version < MIN_TILELANG:
        return f"tilelang {tilelang.__version__} is older than {'.'.join(map(str, MIN_TILELANG))}"
    try:
        nvcc = get_nvcc_compiler()
    except RuntimeError:
        nvcc = ""
    if not os.path.isfile(nvcc):
        return "tilelang found no nvcc to compile with: set CUDA_HOME, or pip install nvidia-cuda-nvcc"
    return None


def tilelang_unavailable_reason(device_type: str) -> str | None:
    """None when the TileLang kernels can run on ``device_type`` tensors (CUDA, SM >= 9.0), else why not."""
    if device_type != "cuda":
        return f"the TileLang kernels target CUDA GPUs, not '{device_type}' tensors"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    major, minor = torch.cuda.get_device_capability()
    if major < 9:
        return f"the TileLang kernels are built for SM >= 9.0 (Hopper); this GPU is SM {major}.{minor}"
    return _setup_error()


def unsupported_reason(q: torch.Tensor, d_v: int) -> str | None:
    """None when these kernels can run this call (device, then dtype and head dims), else why not."""
    reason = tilelang_unavailable_reason(q.device.type)
    if reason:
        return reason
    if q.dtype not in DTYPES:
        return f"the TileLang kernels take bf16 or fp16, not {q.dtype}"
    d_rope = q.shape[-1] - d_v
    if d_v % 16 or d_rope % 16:  # MMA K / N granularity; DeepSeek's 512 + 64 qualifies
        return f"the TileLang kernels need d_v and d_rope multiples of 16, got {d_v} + {d_rope}"
    return None


# ---------------------------------------------------------------------------------------------- programs
# Each builder returns a TileLang PrimFunc for static shape parameters; token counts are dynamic.


def fwd_program(heads_per_group, groups, d_v, d_rope, topk, sm_scale, dtype, *, block_k, max_warps, stages):
    """o [T, H, d_v] and lse [T, H] (fp32, natural log) from q, kv and indices."""
    import tilelang.language as T

    n_tok, n_kv = T.dynamic("n_tok"), T.dynamic("n_kv")
    hpg, heads, dim = heads_per_group, heads_per_group * groups, d_v + d_rope
    bh, bk = block_h(hpg), block_k
    n_hb, n_kb = -(-hpg // bh), -(-topk // bk)
    threads = 32 * num_warps(max_warps, (bh, bk), (bh, d_v))
    scale_log2 = sm_scale * LOG2E
    acc_t = "float32"

    @T.prim_func
    def sparse_mla_fwd(
        Q: T.Tensor([n_tok, heads, dim], dtype),
        KV: T.Tensor([n_kv, groups, dim], dtype),
        Idx: T.Tensor([n_tok, groups, topk], "int32"),
        Out: T.Tensor([n_tok, heads, d_v], dtype),
        Lse: T.Tensor([n_tok, heads], acc_t),
    ):
        with T.Kernel(n_tok, n_hb, groups, threads=threads) as (t, hb, g):
            q_v = T.alloc_shared([bh, d_v], dtype)
            k_v = T.alloc_shared([bk, d_v], dtype)
            p_s = T.alloc_shared([bh, bk], dtype)
            if d_rope:
                q_r = T.alloc_shared([bh, d_rope], dtype)
                k_r = T.alloc_shared([bk, d_rope], dtype)
            valid = T.alloc_fragment([bk], "bool")
            s = T.alloc_fragment([bh, bk], acc_t)
            acc = T.alloc_fragment([bh, d_v], acc_t)
            # running max of the log2-scaled scores (-inf until one is valid), and its NaN-free use in exp2
            m = T.alloc_fragment([bh], acc_t)
            m_prev = T.alloc_fragment([bh], acc_t)
            m_safe = T.alloc_fragment([bh], acc_t)  # m, or 0 while no score is valid
            lsum = T.alloc_fragment([bh], acc_t)  # running sum of exp2(s - m)
            l_blk = T.alloc_fragment([bh], acc_t)
            alpha = T.alloc_fragment([bh], acc_t)

            h_lo = hb * bh  # first head of this block, within the group
            for i, d in T.Parallel(bh, d_v):
                q_v[i, d] = Q[t, g * hpg + h_lo + i, d] if h_lo + i < hpg else T.cast(0, dtype)
            if d_rope:
                for i, d in T.Parallel(bh, d_rope):
                    q_r[i, d] = Q[t, g * hpg + h_lo + i, d_v + d] if h_lo + i < hpg else T.cast(0, dtype)
            T.fill(acc, 0)
            T.fill(lsum, 0)
            T.fill(m, -T.infinity(acc_t))

            for kb in T.Pipelined(n_kb, num_stages=stages):
                # gather the block's kv rows; the topk tail and invalid indices read row 0 and are masked
                for j in T.Parallel(bk):
                    r = Idx[t, g, kb * bk + j] if kb * bk + j < topk else -1
                    valid[j] = r >= 0 and r < n_kv
                for j, d in T.Parallel(bk, d_v):
                    r = Idx[t, g, kb * bk + j] if kb * bk + j < topk else 0
                    k_v[j, d] = KV[r if r >= 0 and r < n_kv else 0, g, d]
                if d_rope:
                    for j, d in T.Parallel(bk, d_rope):
                        r = Idx[t, g, kb * bk + j] if kb * bk + j < topk else 0
                        k_r[j, d] = KV[r if r >= 0 and r < n_kv else 0, g, d_v + d]

                T.gemm(q_v, k_v, s, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                if d_rope:
                    T.gemm(q_r, k_r, s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                for i, j in T.Parallel(bh, bk):
                    s[i, j] = s[i, j] * scale_log2 if valid[j] else -T.infinity(acc_t)

                # online softmax: rescale what was accumulated under the previous max
                T.copy(m, m_prev)
                T.reduce_max(s, m, dim=1, clear=False)
                for i in T.Parallel(bh):
                    m_safe[i] = 0.0 if m[i] == -T.infinity(acc_t) else m[i]
                    alpha[i] = T.exp2(m_prev[i] - m_safe[i])
                for i, j in T.Parallel(bh, bk):
                    s[i, j] = T.exp2(s[i, j] - m_safe[i])
                T.reduce_sum(s, l_blk, dim=1)
                for i in T.Parallel(bh):
                    lsum[i] = lsum[i] * alpha[i] + l_blk[i]
                for i, d in T.Parallel(bh, d_v):
                    acc[i, d] = acc[i, d] * alpha[i]
                T.copy(s, p_s)
                T.gemm(p_s, k_v, acc, policy=T.GemmWarpPolicy.FullRow)

            for i, d in T.Parallel(bh, d_v):
                if h_lo + i < hpg:
                    Out[t, g * hpg + h_lo + i, d] = T.cast(acc[i, d] / lsum[i] if lsum[i] > 0 else 0.0, dtype)
            for i in T.Parallel(bh):
                if h_lo + i < hpg:
                    Lse[t, g * hpg + h_lo + i] = (
                        (m[i] + T.log2(lsum[i])) * LN2 if lsum[i] > 0 else -T.infinity(acc_t)
                    )

    return sparse_mla_fwd


def delta_program(d_v, dtype, *, rows, chunk, threads):
    """delta [N] = sum_d o[n, d] * dO[n, d] in fp32, over the N = T * H rows of contiguous o and dO."""
    import tilelang.language as T

    n_rows = T.dynamic("n_rows")
    chunk = min(chunk, d_v)
    acc_t = "float32"

    @T.prim_func
    def sparse_mla_delta(
        Out: T.Tensor([n_rows, d_v], dtype),
        dO: T.Tensor([n_rows, d_v], dtype),
        Delta: T.Tensor([n_rows], acc_t),
    ):
        with T.Kernel(T.ceildiv(n_rows, rows), threads=threads) as bx:
            acc = T.alloc_fragment([rows, chunk], acc_t)
            delta = T.alloc_fragment([rows], acc_t)
            T.clear(acc)
            for c in T.serial(-(-d_v // chunk)):
                for i, j in T.Parallel(rows, chunk):
                    r, d = bx * rows + i, c * chunk + j
                    if r < n_rows and d < d_v:
                        acc[i, j] += T.cast(Out[r, d], acc_t) * T.cast(dO[r, d], acc_t)
            T.reduce_sum(acc, delta, dim=1)
            for i in T.Parallel(rows):
                if bx * rows + i < n_rows:
                    Delta[bx * rows + i] = delta[i]

    return sparse_mla_delta


def bwd_program(heads_per_group, groups, d_v, d_rope, topk, sm_scale, dtype, *, block_k, max_warps):
    """dq [T, H, D] (returned) and dkv [T_kv, G, D] (fp32, accumulated in place with atomics)."""
    import tilelang.language as T

    n_tok, n_kv = T.dynamic("n_tok"), T.dynamic("n_kv")
    hpg, heads, dim = heads_per_group, heads_per_group * groups, d_v + d_rope
    bh, bk = block_h(hpg), block_k
    n_hb, n_kb = -(-hpg // bh), -(-topk // bk)
    gemms = [(bh, bk), (bh, d_v), (bk, d_v)] + ([(bh, d_rope), (bk, d_rope)] if d_rope else [])
    threads = 32 * num_warps(max_warps, *gemms)
    scale_log2 = sm_scale * LOG2E
    acc_t = "float32"

    @T.prim_func
    def sparse_mla_bwd(
        Q: T.Tensor([n_tok, heads, dim], dtype),
        KV: T.Tensor([n_kv, groups, dim], dtype),
        Idx: T.Tensor([n_tok, groups, topk], "int32"),
        dO: T.Tensor([n_tok, heads, d_v], dtype),
        Lse: T.Tensor([n_tok, heads], acc_t),
        Delta: T.Tensor([n_tok, heads], acc_t),
        dKV: T.Tensor([n_kv, groups, dim], acc_t),
        dQ: T.Tensor([n_tok, heads, dim], dtype),
    ):
        with T.Kernel(n_tok, n_hb, groups, threads=threads) as (t, hb, g):
            q_v = T.alloc_shared([bh, d_v], dtype)
            do_s = T.alloc_shared([bh, d_v], dtype)
            k_v = T.alloc_shared([bk, d_v], dtype)
            p_s = T.alloc_shared([bh, bk], dtype)
            ds_s = T.alloc_shared([bh, bk], dtype)
            if d_rope:
                q_r = T.alloc_shared([bh, d_rope], dtype)
                k_r = T.alloc_shared([bk, d_rope], dtype)
                dq_r = T.alloc_fragment([bh, d_rope], acc_t)
                dk_r = T.alloc_fragment([bk, d_rope], acc_t)
            rows = T.alloc_shared([bk], "int32")  # the block's kv rows, -1 where masked
            lse2 = T.alloc_fragment([bh], acc_t)  # lse in log2 units; 0 for padded heads and empty rows
            delta = T.alloc_fragment([bh], acc_t)
            p = T.alloc_fragment([bh, bk], acc_t)
            dp = T.alloc_fragment([bh, bk], acc_t)
            dq_v = T.alloc_fragment([bh, d_v], acc_t)
            dk_v = T.alloc_fragment([bk, d_v], acc_t)

            h_lo = hb * bh
            for i, d in T.Parallel(bh, d_v):
                live = h_lo + i < hpg
                q_v[i, d] = Q[t, g * hpg + h_lo + i, d] if live else T.cast(0, dtype)
                do_s[i, d] = dO[t, g * hpg + h_lo + i, d] if live else T.cast(0, dtype)
            if d_rope:
                for i, d in T.Parallel(bh, d_rope):
                    q_r[i, d] = Q[t, g * hpg + h_lo + i, d_v + d] if h_lo + i < hpg else T.cast(0, dtype)
                T.clear(dq_r)
            for i in T.Parallel(bh):
                live = h_lo + i < hpg
                lse = Lse[t, g * hpg + h_lo + i] if live else 0.0
                lse2[i] = lse * LOG2E if lse != -T.infinity(acc_t) else 0.0
                delta[i] = Delta[t, g * hpg + h_lo + i] if live else 0.0
            T.clear(dq_v)

            for kb in T.serial(n_kb):
                for j in T.Parallel(bk):
                    r = Idx[t, g, kb * bk + j] if kb * bk + j < topk else -1
                    rows[j] = r if r >= 0 and r < n_kv else -1
                for j, d in T.Parallel(bk, d_v):
                    k_v[j, d] = KV[T.max(rows[j], 0), g, d]
                if d_rope:
                    for j, d in T.Parallel(bk, d_rope):
                        k_r[j, d] = KV[T.max(rows[j], 0), g, d_v + d]

                # p = exp2(s * scale log2 e - lse2), 0 where the index is invalid or the head is padding
                T.gemm(q_v, k_v, p, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullCol)
                if d_rope:
                    T.gemm(q_r, k_r, p, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
                for i, j in T.Parallel(bh, bk):
                    p[i, j] = (
                        T.exp2(p[i, j] * scale_log2 - lse2[i]) if rows[j] >= 0 and h_lo + i < hpg else 0.0
                    )
                # dS = p * (dO . v - delta) * sm_scale
                T.gemm(do_s, k_v, dp, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullCol)
                for i, j in T.Parallel(bh, bk):
                    dp[i, j] = p[i, j] * (dp[i, j] - delta[i]) * sm_scale
                T.copy(p, p_s)
                T.copy(dp, ds_s)

                # dq += dS @ k ; dkv rows of this block = dS^T @ q (+ p^T @ dO on the value channels)
                T.gemm(ds_s, k_v, dq_v, policy=T.GemmWarpPolicy.FullCol)
                T.gemm(ds_s, q_v, dk_v, transpose_A=True, clear_accum=True, policy=T.GemmWarpPolicy.FullCol)
                T.gemm(p_s, do_s, dk_v, transpose_A=True, policy=T.GemmWarpPolicy.FullCol)
                for j, d in T.Parallel(bk, d_v):
                    if rows[j] >= 0:
                        T.atomic_add(dKV[rows[j], g, d], dk_v[j, d])
                if d_rope:
                    T.gemm(ds_s, k_r, dq_r, policy=T.GemmWarpPolicy.FullCol)
                    T.gemm(
                        ds_s, q_r, dk_r, transpose_A=True, clear_accum=True, policy=T.GemmWarpPolicy.FullCol
                    )
                    for j, d in T.Parallel(bk, d_rope):
                        if rows[j] >= 0:
                            T.atomic_add(dKV[rows[j], g, d_v + d], dk_r[j, d])

            for i, d in T.Parallel(bh, d_v):
                if h_lo + i < hpg:
                    dQ[t, g * hpg + h_lo + i, d] = T.cast(dq_v[i, d], dtype)
            if d_rope:
                for i, d in T.Parallel(bh, d_rope):
                    if h_lo + i < hpg:
                        dQ[t, g * hpg + h_lo + i, d_v + d] = T.cast(dq_r[i, d], dtype)

    return sparse_mla_bwd


# ---------------------------------------------------------------------------------------------- compiled


def compile_program(program, out_idx, target=None):
    import tilelang

    return tilelang.compile(program, out_idx=out_idx, target=target or TARGET, pass_configs=PASS_CONFIGS)


@functools.lru_cache(maxsize=64)
def _fwd_kernel(hpg, groups, d_v, d_rope, topk, sm_scale, dtype):
    return compile_program(
        fwd_program(hpg, groups, d_v, d_rope, topk, sm_scale, dtype, **FWD), out_idx=[-2, -1]
    )


@functools.lru_cache(maxsize=16)
def _delta_kernel(d_v, dtype):
    return compile_program(delta_program(d_v, dtype, **DELTA), out_idx=[-1])


@functools.lru_cache(maxsize=64)
def _bwd_kernel(hpg, groups, d_v, d_rope, topk, sm_scale, dtype):
    return compile_program(bwd_program(hpg, groups, d_v, d_rope, topk, sm_scale, dtype, **BWD), out_idx=[-1])


def _dense(x: torch.Tensor) -> torch.Tensor:
    """``x`` contiguous and 16-byte aligned (the kernels load 16-byte vectors from each tensor's base)."""
    if x.is_contiguous() and x.data_ptr() % 16 == 0:
        return x
    return x.clone(memory_format=torch.contiguous_format)


class TileLangSparseMLAFunction(torch.autograd.Function):
    """Autograd wrapper of the TileLang kernels; saves q, kv, indices, o and the fp32 lse.

    q / kv bf16 or fp16 and indices int32, all contiguous and 16-byte aligned (see
    :func:`sparse_mla_attention_tilelang`, which prepares them).
    """

    @staticmethod
    def forward(ctx, q, kv, indices, sm_scale, d_v):
        t, h, d = q.shape
        n_kv, g = kv.shape[0], kv.shape[1]
        topk = indices.shape[-1]
        if t and topk and n_kv:
            key = (h // g, g, d_v, d - d_v, topk, sm_scale, DTYPES[q.dtype])
            with torch.cuda.device(q.device):
                o, lse = _fwd_kernel(*key)(q, kv, indices)
        else:  # nothing to attend to (and the kernels would gather from an empty kv)
            o = torch.zeros(t, h, d_v, dtype=q.dtype, device=q.device)
            lse = torch.full((t, h), float("-inf"), dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, kv, indices, o, lse)
        ctx.sm_scale = sm_scale
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, kv, indices, o, lse = ctx.saved_tensors
        t, h, d = q.shape
        n_kv, g = kv.shape[0], kv.shape[1]
        d_v, topk = o.shape[-1], indices.shape[-1]
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        if not (t and topk and n_kv):
            return torch.zeros_like(q), dkv.to(kv.dtype), None, None, None
        do = _dense(do)
        dtype = DTYPES[q.dtype]
        key = (h // g, g, d_v, d - d_v, topk, ctx.sm_scale, dtype)
        with torch.cuda.device(q.device):
            delta = _delta_kernel(d_v, dtype)(o.view(t * h, d_v), do.view(t * h, d_v)).view(t, h)
            dq = _bwd_kernel(*key)(q, kv, indices, do, lse, delta, dkv)
        return dq, dkv.to(kv.dtype), None, None, None  # the postprocess: one cast of the fp32 sum


def sparse_mla_attention_tilelang(q, kv, indices, scale: float, d_v: int, return_lse: bool = False):
    """:func:`loongforge_kernels.sparse_mla_attention` on the TileLang kernels (shapes already validated).

    ``scale`` is the softmax scale (a float, not None). Raises ``KernelUnavailableError`` when the kernels
    cannot run these tensors (see :func:`unsupported_reason`).
    """
    from loongforge_kernels._dispatch import KernelUnavailableError

    reason = unsupported_reason(q, d_v)
    if reason:
        raise KernelUnavailableError(f"TileLang kernels requested but unusable: {reason}")
    if not math.isfinite(scale):
        raise ValueError(f"sparse_mla_attention: sm_scale must be finite, got {scale}")
    idx = _dense(indices.to(torch.int32))
    o, lse = TileLangSparseMLAFunction.apply(_dense(q), _dense(kv), idx, float(scale), d_v)
    return (o, lse) if return_lse else o


__all__ = [
    "TileLangSparseMLAFunction",
    "sparse_mla_attention_tilelang",
    "tilelang_unavailable_reason",
    "unsupported_reason",
]
