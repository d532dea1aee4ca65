"""The delta-FP8 codec of the FSDP2 all-gather (``loongforge_embodied.fp8_allgather``), one pass per side.

``encode_fp8_delta(x, ref)``: ``d = x - ref`` in fp32, in blocks of 256 elements (the last one zero-padded);
per block ``scale = max(amax(|d|) * fl32(1/448), fp32 tiny)`` and the E4M3 (``float8_e4m3fn``) value of
``d / scale``; returned as one uint8 payload ``[fp8 bytes (nb * 256) | fp32 scales (4 * nb)]``.

``apply_fp8_deltas(recon, gathered)``: ``recon`` (world, n) ``+= q * scale`` decoded from ``gathered`` (world,
payload bytes), in place: fp32 product, fp32 sum, rounded once to ``recon``'s dtype; ``out=`` also writes the
result there (saves the caller a copy).

Both are bit-identical to the plain-torch references (``references.encode_fp8_delta_ref`` /
``apply_fp8_deltas_ref``; the embodied module's own torch codec gives the same bytes, its tests check that):
- every step is one IEEE fp32 operation in the same order: the quotient is a correctly rounded division
  (``div.rn.f32``), the scale multiplies by the fp32 constant ``1/448`` (as torch's CUDA ``div_(448)``),
  and both kernels launch with ``enable_fp_fusion=False`` so ``recon + q * scale`` is not contracted to an
  FMA (``tests/test_fp8_delta.py`` checks the sm_90 PTX for all three);
- fp32 -> E4M3 and fp32 -> bf16 round to nearest even. On CUDA the GPU's ``cvt.rn`` does it (``HW_CVT``);
  Triton's interpreter rounds half up and drops subnormals, so without ``HW_CVT`` the kernels round in integer
  arithmetic (``_e4m3_bits`` is c10's ``fp8e4m3fn_from_fp32_value``). The interpreter also upcasts bf16
  subnormals wrongly, so bf16 is widened by a 16-bit shift in both modes.
On CUDA the kernels need SM >= 8.9 (E4M3 conversions), as FP8 does. Non-finite inputs are out of scope
(NaN / inf deltas give NaN bytes in both paths, not necessarily the same ones).
"""

from __future__ import annotations

import math

import torch

from loongforge_kernels._dispatch import KernelUnavailableError, jit, resolve, tl
from loongforge_kernels.references import apply_fp8_deltas_ref, encode_fp8_delta_ref

BLOCK = 256  # elements per scale
DTYPES = (torch.bfloat16, torch.float32)  # of x / ref / recon on the Triton path

# Blocks per program: 2048 elements on CUDA; the interpreter pays per program, so CPU runs take more.
ROWS = {"cuda": 8, "cpu": 32}
NUM_WARPS = 4


@jit
def _f32(v):
    """Widen to fp32; bf16 by a 16-bit shift (exact for subnormals, which the interpreter gets wrong)."""
    if v.dtype == tl.bfloat16:
        return (v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return v.to(tl.float32)


@jit
def _e4m3_bits(v):
    """fp32 -> float8_e4m3fn bits (uint8), round to nearest even, in integer arithmetic (c10's conversion)."""
    bits = v.to(tl.uint32, bitcast=True)
    sign = bits & 0x80000000
    a = bits ^ sign
    # below 2^-6 (subnormal E4M3): adding 2^14 rounds to the 2^-9 grid in fp32, the low bits are the result
    small = ((a.to(tl.float32, bitcast=True) + 16384.0).to(tl.uint32, bitcast=True) - (141 << 23)) & 0xFF
    # normal: rebias the exponent by 120 and round the mantissa at bit 20 to nearest even
    normal = ((a + 0x7FFFF + ((a >> 20) & 1) - (120 << 23)) >> 20) & 0xFF
    r = tl.where(a < (121 << 23), small, normal)
    r = tl.where(a >= (1087 << 20), 0x7F, r)  # >= 480: NaN, as c10 (never reached: |d / scale| <= 448)
    return (r | (sign >> 24)).to(tl.uint8)


@jit
def _round_to(y, dtype: tl.constexpr, HW_CVT: tl.constexpr):
    """fp32 -> ``dtype`` (bf16 or fp32), round to nearest even."""
    if dtype == tl.bfloat16:
        if HW_CVT:
            return y.to(tl.bfloat16, fp_downcast_rounding="rtne")
        bits = y.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return y.to(dtype)


@jit
def _encode_kernel(X, REF, Q, S, n, nb, HW_CVT: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """ROWS blocks per program: d = x - ref (fp32), scale per block, E4M3 bytes of d / scale (padding too)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = offs < n
    d = _f32(tl.load(X + offs, mask=mask, other=0.0)) - _f32(tl.load(REF + offs, mask=mask, other=0.0))
    # NOTE: amax times the fp32 constant 1/448, as torch's CUDA ``div_(448)``; tiny keeps zero blocks finite.
    scale = tl.maximum(tl.max(tl.abs(d), axis=1) * 0.002232142857142857, 1.1754943508222875e-38)
    v = tl.math.div_rn(d, scale[:, None])
    if HW_CVT:
        q = v.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    else:
        q = _e4m3_bits(v)
    rmask = rows < nb
    tl.store(Q + offs, q, mask=rmask[:, None])
    tl.store(S + rows, scale, mask=rmask)


@jit
def _decode_kernel(
    G,
    GS,
    R,
    OUT,
    n,
    nb,
    row_bytes,
    HAS_OUT: tl.constexpr,
    HW_CVT: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (i, w): ROWS blocks of rank w's payload; recon[w] = round(recon[w] + q * scale)."""
    w = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    rmask = rows < nb
    mask = cols < n
    q = tl.load(G + w * row_bytes + cols, mask=mask, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    s = tl.load(GS + w * (row_bytes // 4) + rows, mask=rmask, other=0.0)
    r = _f32(tl.load(R + w * n + cols, mask=mask, other=0.0))
    # NOTE: two roundings (product, sum), as torch's mul_ then add_: launched with enable_fp_fusion=False.
    y = _round_to(r + q * s[:, None], R.dtype.element_ty, HW_CVT)
    tl.store(R + w * n + cols, y, mask=mask)
    if HAS_OUT:
        tl.store(OUT + w * n + cols, y, mask=mask)


def payload_bytes(numel: int) -> int:
    """Bytes of one encoded slab of ``numel`` elements: ``nb * 256`` fp8 values + ``nb`` fp32 scales."""
    return (BLOCK + 4) * nblocks(numel)


def nblocks(numel: int) -> int:
    return max(1, math.ceil(numel / BLOCK))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _which(impl: str | None, *tensors: torch.Tensor) -> str:
    """``resolve``, plus: dtypes other than bf16 / fp32 raise under an explicit triton, else run torch."""
    which = resolve(impl, tensors[0])
    if which == "triton" and any(t.dtype not in DTYPES for t in tensors):
        if impl == "triton":
            got = ", ".join(str(t.dtype) for t in tensors)
            raise KernelUnavailableError(f"fp8_delta Triton kernels take bf16 / fp32 tensors, got {got}")
        return "torch"
    return which


def _launch(device: torch.device) -> tuple[int, bool]:
    """(blocks per program, use the GPU's cvt.rn conversions)."""
    cuda = device.type == "cuda"
    return ROWS["cuda" if cuda else "cpu"], cuda


def encode_fp8_delta(x: torch.Tensor, ref: torch.Tensor, *, impl: str | None = None) -> torch.Tensor:
    """``x - ref`` (same numel) as one uint8 payload ``[fp8 e4m3 bytes (nb*256) | fp32 scales (4*nb)]``.

    One read of ``x`` and ``ref``, one write of the payload; ``impl``: ``auto`` (None), ``torch`` or ``triton``."""
    if x.numel() != ref.numel():
        raise ValueError(f"encode_fp8_delta: x has {x.numel()} elements, ref {ref.numel()}")
    if _which(impl, x, ref) == "torch":
        return encode_fp8_delta_ref(x, ref)
    n, nb = x.numel(), nblocks(x.numel())
    payload = torch.empty(payload_bytes(n), dtype=torch.uint8, device=x.device)
    rows, hw = _launch(x.device)
    _encode_kernel[(_cdiv(nb, rows),)](
        x.contiguous().view(-1),
        ref.contiguous().view(-1),
        payload[: nb * BLOCK],
        payload[nb * BLOCK :].view(torch.float32),
        n,
        nb,
        HW_CVT=hw,
        ROWS=rows,
        BLOCK=BLOCK,
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,
    )
    return payload


def apply_fp8_deltas(
    recon: torch.Tensor, gathered: torch.Tensor, *, out: torch.Tensor | None = None, impl: str | None = None
) -> None:
    """``recon`` (world, n) ``+=`` the deltas decoded from ``gathered`` (world, payload bytes), in place.

    Math in fp32, rounded once to ``recon``'s dtype; ``out`` (same shape and dtype) also receives the result.
    One read of the payloads and ``recon``, one write of ``recon`` (and ``out``)."""
    world, n = recon.shape
    if gathered.shape != (world, payload_bytes(n)) or gathered.dtype != torch.uint8:
        raise ValueError(
            f"apply_fp8_deltas: gathered must be uint8 ({world}, {payload_bytes(n)}), "
            f"got {gathered.dtype} {tuple(gathered.shape)}"
        )
    if out is not None and (out.shape != recon.shape or out.dtype != recon.dtype):
        raise ValueError(f"apply_fp8_deltas: out must be {recon.dtype} {tuple(recon.shape)}")
    if _which(impl, recon) == "torch":
        apply_fp8_deltas_ref(recon, gathered)
        if out is not None:
            out.copy_(recon)
        return
    if not recon.is_contiguous():
        raise ValueError("apply_fp8_deltas: recon must be contiguous (it is updated in place)")
    out_c = out if out is None or out.is_contiguous() else torch.empty_like(recon)
    g = gathered.contiguous()
    nb = nblocks(n)
    rows, hw = _launch(recon.device)
    _decode_kernel[(_cdiv(nb, rows), world)](
        g,
        g.view(torch.float32)[:, nb * BLOCK // 4 :],  # row 0's scales; row w's are row_bytes further
        recon,
        recon if out_c is None else out_c,
        n,
        nb,
        g.shape[1],
        HAS_OUT=out_c is not None,
        HW_CVT=hw,
        ROWS=rows,
        BLOCK=BLOCK,
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,
    )
    if out_c is not None and out_c is not out:
        out.copy_(out_c)
