"""Current-scaling FP8 quantization for FP8 GEMMs: tensorwise, rowwise and blockwise, plain or transposed.

``fp8_quantize(x, granularity, dtype, layout=...)`` quantizes a 2-D ``x`` ``[R, C]`` to E4M3 / E5M2 with one
scale per group: the whole tensor (``tensor``), a row (``row``), a 1x128 tile of a row (``block1x128``,
DeepSeek-V3's activation tiles) or a 128x128 block (``block128x128``, its weight blocks). Per group
``scale = fp8_max / max(amax, 1e-12)`` (fp32), ``q = fp8(clamp(x * scale))`` rounded to nearest even, and the
returned *decode* scale is ``1 / scale`` (what ``torch._scaled_mm`` takes). ``layout`` picks the outputs:
``n`` is ``(q, s)``; ``t`` is the quantization of ``x.T`` (``qt [C, R]`` contiguous, groups along the rows of
``x.T``, i.e. down the columns of ``x``), the operand a backward GEMM needs; ``nt`` is both from one read of ``x``
where the groups allow (tensorwise: one amax pass, then one pass writing both; blockwise: one pass over 128x128
tiles; rowwise: a row pass for ``q``, and a column-amax pass then a tile pass for ``qt``, since the two are
different reductions).

The amax is fused into the quantize pass wherever the group fits one program (row, tile, block); tensorwise
needs a global amax first (one reduction kernel with an atomic max, then the quantize kernel reads it on the
device: no host sync). 1x128 scales come back outer-dim-major (``[R, ceil(C / 128)]`` with strides ``(1, R)``),
the layout cuBLAS's blockwise GEMM takes. Bit-identical to ``references.fp8_quantize_ref`` (IEEE division for
the scales, RNE conversions; the interpreter path rounds in integer arithmetic, as ``fp8_delta``).

``check_finite=True`` (default) raises ``ValueError`` for inf / nan input (one small reduction and a host sync:
the FP8 linears turn it off on their hot path, where a non-finite loss is the trainer's to report).
"""

from __future__ import annotations

import torch

from loongforge_kernels._dispatch import jit, resolve, tl
from loongforge_kernels.fp8_delta import _e4m3_bits, _f32
from loongforge_kernels.references import FP8_AMAX_EPS, FP8_MAX, fp8_quantize_ref

GRANULARITIES = ("tensor", "row", "block1x128", "block128x128")
LAYOUTS = ("n", "t", "nt")
DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_MODE = {"tensor": 0, "block128x128": 1, "block1x128": 2}  # the tile kernel's per-output scale group


@jit
def _abs_inf(x):
    """|x| with NaN as inf, so a NaN anywhere in a group makes its amax (and decode scale) non-finite."""
    a = tl.abs(x)
    return tl.where(a == a, a, float("inf"))


@jit
def _e5m2_bits(v):
    """fp32 -> float8_e5m2 bits (uint8), round to nearest even, in integer arithmetic; |v| <= 57344."""
    bits = v.to(tl.uint32, bitcast=True)
    sign = bits & 0x80000000
    a = bits ^ sign
    # below 2^-14 (subnormal E5M2): adding 128 rounds to the 2^-16 grid in fp32, the low bits are the result
    small = ((a.to(tl.float32, bitcast=True) + 128.0).to(tl.uint32, bitcast=True) - (134 << 23)) & 0xFF
    # normal: rebias the exponent by 112 and round the mantissa at bit 21 to nearest even
    normal = ((a + 0xFFFFF + ((a >> 21) & 1) - (112 << 23)) >> 21) & 0xFF
    r = tl.where(a < (113 << 23), small, normal)
    return (r | (sign >> 24)).to(tl.uint8)


@jit
def _fp8_bits(x, scale, FMAX: tl.constexpr, IS_E4M3: tl.constexpr, HW_CVT: tl.constexpr):
    """The FP8 bits of clamp(x * scale, -FMAX, FMAX): the GPU's cvt.rn on CUDA, integer rounding elsewhere."""
    v = tl.minimum(tl.maximum(x * scale, -FMAX), FMAX)
    if HW_CVT:
        if IS_E4M3:
            return v.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
        return v.to(tl.float8e5, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    if IS_E4M3:
        return _e4m3_bits(v)
    return _e5m2_bits(v)


@jit
def _scale_of(amax, FMAX: tl.constexpr):
    """fp8_max / max(amax, eps) with IEEE division (the reference's ``fmax / amax.clamp(min=eps)``)."""
    a = tl.maximum(amax, 1e-12)
    return tl.math.div_rn(tl.zeros_like(a) + FMAX, a)


@jit
def _amax_kernel(X, AMAX, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = _f32(tl.load(X + offs, mask=offs < n, other=0.0))
    tl.atomic_max(AMAX, tl.max(_abs_inf(x), axis=0))


@jit
def _tile_kernel(
    X,
    AMAX,
    Q,
    S,
    QT,
    ST,
    n_rows,
    n_cols,
    N_MODE: tl.constexpr,
    T_MODE: tl.constexpr,
    FMAX: tl.constexpr,
    IS_E4M3: tl.constexpr,
    HW_CVT: tl.constexpr,
    BR: tl.constexpr,
    BC: tl.constexpr,
):
    """One [BR, BC] tile of x -> q (N_MODE >= 0) and q.T (T_MODE >= 0). Modes: 0 the global amax in AMAX,
    1 the tile's amax (128x128 blocks), 2 per row of the tile for q / per column for q.T (1x128 tiles),
    3 (q.T only) per column of x from the column amaxes in AMAX (rowwise scaling of x.T)."""
    pr = tl.program_id(0)
    pc = tl.program_id(1)
    rows = pr.to(tl.int64) * BR + tl.arange(0, BR)
    cols = pc.to(tl.int64) * BC + tl.arange(0, BC)
    rmask = rows < n_rows
    cmask = cols < n_cols
    mask = rmask[:, None] & cmask[None, :]
    x = _f32(tl.load(X + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0.0))
    a = _abs_inf(x)
    if N_MODE >= 0:
        if N_MODE == 0:
            scale = _scale_of(tl.load(AMAX), FMAX)
            if (pr == 0) & (pc == 0):
                tl.store(S, tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale))
            q = _fp8_bits(x, scale, FMAX, IS_E4M3, HW_CVT)
        elif N_MODE == 1:
            scale = _scale_of(tl.max(tl.max(a, axis=1), axis=0), FMAX)
            tl.store(S + pr * tl.cdiv(n_cols, BC) + pc, tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale))
            q = _fp8_bits(x, scale, FMAX, IS_E4M3, HW_CVT)
        else:
            scale = _scale_of(tl.max(a, axis=1), FMAX)  # [BR]; scales stored [n_cols / 128, n_rows] (outer-dim-major)
            tl.store(S + pc * n_rows + rows, tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale), mask=rmask)
            q = _fp8_bits(x, scale[:, None], FMAX, IS_E4M3, HW_CVT)
        tl.store(Q + rows[:, None] * n_cols + cols[None, :], q, mask=mask)
    if T_MODE >= 0:
        if T_MODE == 0:
            scale = _scale_of(tl.load(AMAX), FMAX)
            if N_MODE < 0:
                if (pr == 0) & (pc == 0):
                    tl.store(ST, tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale))
            q = _fp8_bits(x, scale, FMAX, IS_E4M3, HW_CVT)
        elif T_MODE == 1:
            scale = _scale_of(tl.max(tl.max(a, axis=1), axis=0), FMAX)
            tl.store(ST + pc * tl.cdiv(n_rows, BR) + pr, tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale))
            q = _fp8_bits(x, scale, FMAX, IS_E4M3, HW_CVT)
        elif T_MODE == 3:  # rowwise q.T: the column amaxes of x, from _col_amax_kernel
            scale = _scale_of(tl.load(AMAX + cols, mask=cmask, other=0.0), FMAX)
            if pr == 0:
                tl.store(ST + cols, tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale), mask=cmask)
            q = _fp8_bits(x, scale[None, :], FMAX, IS_E4M3, HW_CVT)
        else:
            scale = _scale_of(tl.max(a, axis=0), FMAX)  # [BC]; q.T's scales stored [n_rows / 128, n_cols]
            tl.store(ST + pr * n_cols + cols, tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale), mask=cmask)
            q = _fp8_bits(x, scale[None, :], FMAX, IS_E4M3, HW_CVT)
        tl.store(QT + cols[:, None] * n_rows + rows[None, :], tl.trans(q), mask=cmask[:, None] & rmask[None, :])


@jit
def _row_kernel(X, Q, S, n_rows, n_cols, FMAX: tl.constexpr, IS_E4M3: tl.constexpr, HW_CVT: tl.constexpr,
                BR: tl.constexpr, BC: tl.constexpr):
    """BR rows: amax per row over n_cols in BC chunks, then quantize them (the second read mostly hits L2)."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    rmask = rows < n_rows
    amax = tl.zeros([BR], dtype=tl.float32)
    for c0 in range(0, n_cols, BC):
        cols = c0 + tl.arange(0, BC)
        mask = rmask[:, None] & (cols < n_cols)[None, :]
        x = _f32(tl.load(X + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0.0))
        amax = tl.maximum(amax, tl.max(_abs_inf(x), axis=1))
    scale = _scale_of(amax, FMAX)
    for c0 in range(0, n_cols, BC):
        cols = c0 + tl.arange(0, BC)
        mask = rmask[:, None] & (cols < n_cols)[None, :]
        x = _f32(tl.load(X + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0.0))
        tl.store(Q + rows[:, None] * n_cols + cols[None, :], _fp8_bits(x, scale[:, None], FMAX, IS_E4M3, HW_CVT),
                 mask=mask)
    tl.store(S + rows, tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale), mask=rmask)


@jit
def _col_amax_kernel(X, AMAX, n_rows, n_cols, BR: tl.constexpr, BC: tl.constexpr):
    """Column amaxes of x (atomic max over row tiles, so tall matrices spread over the whole GPU)."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.program_id(1).to(tl.int64) * BC + tl.arange(0, BC)
    cmask = cols < n_cols
    mask = (rows < n_rows)[:, None] & cmask[None, :]
    x = _f32(tl.load(X + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0.0))
    tl.atomic_max(AMAX + cols, tl.max(_abs_inf(x), axis=0), mask=cmask)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _outer_major(s: torch.Tensor) -> torch.Tensor:
    """The same values with strides (1, rows): cuBLAS's layout for 1x128 scales."""
    return s.t().contiguous().t()


def _torch_path(x: torch.Tensor, granularity: str, dtype: torch.dtype, layout: str) -> tuple[torch.Tensor, ...]:
    out: list[torch.Tensor] = []
    for t in ((x,) if layout == "n" else (x.t(),) if layout == "t" else (x, x.t())):
        q, s = fp8_quantize_ref(t, granularity, dtype)
        out += [q.contiguous(), _outer_major(s) if granularity == "block1x128" else s.contiguous()]
    return tuple(out)


def _triton_path(x: torch.Tensor, granularity: str, dtype: torch.dtype, layout: str) -> tuple[torch.Tensor, ...]:
    x = x.contiguous()
    rows, cols = x.shape
    dev = x.device
    fmax, is_e4m3, hw = FP8_MAX[dtype], dtype == torch.float8_e4m3fn, dev.type == "cuda"
    want_n, want_t = "n" in layout, "t" in layout
    kw = dict(FMAX=fmax, IS_E4M3=is_e4m3, HW_CVT=hw)
    q = torch.empty(rows, cols, dtype=dtype, device=dev) if want_n else None
    qt = torch.empty(cols, rows, dtype=dtype, device=dev) if want_t else None
    u8 = lambda t: t.view(torch.uint8) if t is not None else None  # noqa: E731
    if granularity == "row":
        out: list[torch.Tensor] = []
        if want_n:
            s = torch.empty(rows, 1, dtype=torch.float32, device=dev)
            br = 4 if hw else 16
            _row_kernel[(_cdiv(rows, br),)](x, u8(q), s, rows, cols, **kw, BR=br, BC=1024, num_warps=4)
            out += [q, s]
        if want_t:  # column amaxes, then one tile pass writing q.T
            st = torch.empty(cols, 1, dtype=torch.float32, device=dev)
            col_amax = torch.zeros(cols, dtype=torch.float32, device=dev)
            grid = (_cdiv(rows, 64), _cdiv(cols, 64))
            _col_amax_kernel[grid](x, col_amax, rows, cols, BR=64, BC=64, num_warps=4)
            _tile_kernel[grid](x, col_amax, x, x, u8(qt), st, rows, cols, N_MODE=-1, T_MODE=3, **kw, BR=64, BC=64,
                               num_warps=4)
            out += [qt, st]
        return tuple(out)
    mode = _MODE[granularity]
    amax = None
    if granularity == "tensor":
        amax = torch.zeros((), dtype=torch.float32, device=dev)
        block = 8192
        _amax_kernel[(max(1, _cdiv(rows * cols, block)),)](x, amax, rows * cols, BLOCK=block, num_warps=8)
        br = bc = 64
        s = torch.empty((), dtype=torch.float32, device=dev)
        st = s
    elif granularity == "block128x128":
        br = bc = 128
        s = torch.empty(_cdiv(rows, 128), _cdiv(cols, 128), dtype=torch.float32, device=dev) if want_n else None
        st = torch.empty(_cdiv(cols, 128), _cdiv(rows, 128), dtype=torch.float32, device=dev) if want_t else None
    else:  # 1x128 tiles of x's rows (n) and of x.T's rows (t); a 128x128 tile serves both
        br, bc = (128 if want_t else 32), (128 if want_n else 32)
        s = torch.empty(_cdiv(cols, 128), rows, dtype=torch.float32, device=dev).t() if want_n else None
        st = torch.empty(_cdiv(rows, 128), cols, dtype=torch.float32, device=dev).t() if want_t else None
    grid = (_cdiv(rows, br), _cdiv(cols, bc))
    _tile_kernel[grid](
        x, amax if amax is not None else x, u8(q) if want_n else x, s if want_n else x,
        u8(qt) if want_t else x, st if want_t else x, rows, cols,
        N_MODE=mode if want_n else -1, T_MODE=mode if want_t else -1, **kw, BR=br, BC=bc,
        num_warps=8 if br * bc >= 128 * 128 else 4,
    )
    return tuple(v for v in ((q, s) if want_n else ()) + ((qt, st) if want_t else ()))


def fp8_quantize(
    x: torch.Tensor,
    granularity: str,
    dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    layout: str = "n",
    check_finite: bool = True,
    impl: str | None = None,
) -> tuple[torch.Tensor, ...]:
    """Quantize the 2-D ``x`` to ``dtype`` with one current scale per ``granularity`` group.

    Returns ``(q, s)`` for ``layout="n"``, ``(qt, st)`` (``x.T`` quantized, contiguous) for ``"t"``, and
    ``(q, s, qt, st)`` for ``"nt"``; ``s`` are fp32 decode scales (``x ~ q * s``). ``impl``: ``auto``
    (None), ``torch`` or ``triton``; see the module docstring for the scale shapes.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"fp8_quantize: granularity {granularity!r}; allowed: {', '.join(GRANULARITIES)}")
    if layout not in LAYOUTS:
        raise ValueError(f"fp8_quantize: layout {layout!r}; allowed: {', '.join(LAYOUTS)}")
    if dtype not in DTYPES:
        raise ValueError(f"fp8_quantize: dtype {dtype}; allowed: float8_e4m3fn, float8_e5m2")
    if x.dim() != 2 or not x.is_floating_point() or x.dtype in DTYPES:
        raise ValueError(f"fp8_quantize: x must be a 2-D bf16 / fp16 / fp32 tensor, got {x.dtype} {tuple(x.shape)}")
    if x.numel() == 0 or resolve(impl, x) == "torch":
        out = _torch_path(x, granularity, dtype, layout)
    else:
        out = _triton_path(x, granularity, dtype, layout)
    if check_finite and not all(bool(torch.isfinite(s).all()) for s in out[1::2]):
        raise ValueError(f"fp8_quantize: x ({tuple(x.shape)}) holds inf or nan; FP8 scaling needs finite input")
    return out


__all__ = ["DTYPES", "FP8_AMAX_EPS", "FP8_MAX", "GRANULARITIES", "LAYOUTS", "fp8_quantize"]
