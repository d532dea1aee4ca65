"""FP8 quantize / transpose-quantize kernels vs their torch reference: bit-identical bytes and scales.

On CPU the kernels run in Triton's interpreter with the integer-rounding conversions; ``test_gpu.py`` covers
CUDA. Shapes are odd on purpose (1x1, ragged 128-tiles / blocks); one 128x128 block is all zeros and the
magnitudes span 11 decades, so scales, subnormals and saturation are all exercised.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from loongforge_kernels import _dispatch
from loongforge_kernels.fp8_quant import GRANULARITIES, fp8_quantize
from loongforge_kernels.references import FP8_MAX, fp8_quantize_ref

SHAPES = [(1, 1), (7, 300), (130, 257)]
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _x(rows: int, cols: int, dtype=torch.bfloat16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rows * 1000 + cols)
    x = torch.randn(rows, cols, generator=gen) * torch.logspace(-8, 3, cols)[torch.randperm(cols, generator=gen)]
    if rows > 128 and cols > 128:
        x[:128, :128] = 0  # an all-zero block (and all-zero 1x128 tiles)
    return x.to(dtype)


def _same(got: tuple, want: tuple) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
        if a.dtype in FP8:
            bad = a.view(torch.uint8) != b.view(torch.uint8)
            assert not bad.any(), f"{int(bad.sum())} fp8 bytes differ, first at {bad.nonzero()[0].tolist()}"
        else:
            assert torch.equal(a, b), (a - b).abs().max()
            if a.dim() == 2 and min(a.shape) > 1:
                assert a.stride() == b.stride()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("dtype", FP8)
def test_quantize_and_transpose_quantize_match_reference(triton_cpu, shape, granularity, dtype):
    x = _x(*shape)
    for layout in ("nt", "n", "t") if granularity == "block1x128" else ("nt",):
        _same(fp8_quantize(x, granularity, dtype, layout=layout, impl="triton"),
              fp8_quantize(x, granularity, dtype, layout=layout, impl="torch"))


def test_transposed_layout_is_the_quantization_of_x_t():
    x = _x(130, 257, torch.float32)
    for g in GRANULARITIES:
        qt, st = fp8_quantize(x, g, layout="t", impl="torch")
        q, s = fp8_quantize_ref(x.t().contiguous(), g, torch.float8_e4m3fn)
        assert torch.equal(qt.view(torch.uint8), q.view(torch.uint8)) and torch.equal(st, s)
        assert qt.is_contiguous() and qt.shape == (257, 130)


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_fp32_and_fp16_inputs(triton_cpu, granularity):
    for dt in (torch.float32, torch.float16):
        x = _x(33, 140, dt)
        _same(fp8_quantize(x, granularity, layout="nt", impl="triton"),
              fp8_quantize(x, granularity, layout="nt", impl="torch"))


def test_reference_scales_and_error_bound():
    """Decode scales are amax / fp8_max per group; dequantized values are within half an FP8 ulp (E4M3: 2^-4
    relative) of x, and all-zero groups give zeros with a finite scale."""
    x = _x(130, 257, torch.float32)
    for g in GRANULARITIES:
        q, s = fp8_quantize_ref(x, g, torch.float8_e4m3fn)
        assert torch.isfinite(s).all() and (s > 0).all()
        full = s
        if g.startswith("block"):
            br = 128 if g == "block128x128" else 1
            full = s.repeat_interleave(br, 0)[:130].repeat_interleave(128, 1)[:, :257]
        err = (q.float() * full - x).abs()
        assert (err <= x.abs() * 2**-4 + full * 2**-9 * 1.01).all(), g  # relative, or the subnormal grid
    _, s = fp8_quantize_ref(x, "block128x128", torch.float8_e4m3fn)
    assert torch.equal(s[0, 0], torch.tensor(1e-12 / 448 * 1.0, dtype=torch.float32)) or s[0, 0] < 1e-14
    q, s = fp8_quantize_ref(x, "tensor", torch.float8_e5m2)
    assert q.float().abs().max() == FP8_MAX[torch.float8_e5m2]  # the amax element maps to the format's max


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_input_is_rejected(impl, bad):
    if impl == "triton" and _dispatch.triton_unavailable_reason("cpu"):
        pytest.skip("needs Triton's interpreter (test_interpreter_suite runs it)")
    x = _x(130, 257)
    x[129, 256] = bad
    for g in GRANULARITIES:
        with pytest.raises(ValueError, match="inf or nan"):
            fp8_quantize(x, g, layout="nt", impl=impl)
    q, s = fp8_quantize(x, "row", layout="n", impl=impl, check_finite=False)  # the hot path skips the check
    assert not torch.isfinite(s[129]).all() and torch.isfinite(s[:129]).all()


def test_argument_errors():
    x = torch.randn(4, 4)
    with pytest.raises(ValueError, match="granularity"):
        fp8_quantize(x, "column")
    with pytest.raises(ValueError, match="layout"):
        fp8_quantize(x, "row", layout="tn")
    with pytest.raises(ValueError, match="dtype"):
        fp8_quantize(x, "row", torch.bfloat16)
    with pytest.raises(ValueError, match="2-D"):
        fp8_quantize(x.view(-1), "row")


@pytest.mark.skipif(not _dispatch.HAS_TRITON, reason="triton not installed")
def test_fp8_quant_kernels_compile_for_hopper():
    """Every variant the wrappers launch compiles for sm_90 (the interpreter accepts code the compiler rejects),
    and the CUDA path converts with cvt.rn.satfinite and divides with div.rn."""
    code = r"""
import inspect, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from loongforge_kernels import fp8_quant as m
def build(kernel, ptrs, consts, warps):
    params = list(inspect.signature(kernel.fn).parameters)
    sig = {p: "constexpr" if p in consts else (ptrs.get(p, "*bf16") if p.isupper() else "i32") for p in params}
    attrs = {(params.index(p),): [["tt.divisibility", 16]] for p in params if sig[p].startswith("*")}
    src = ASTSource(fn=kernel, signature=sig, constexprs={(params.index(k),): v for k, v in consts.items()},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["ptx"]
ptx = []
for e4 in (True, False):
    fp = dict(FMAX=448.0 if e4 else 57344.0, IS_E4M3=e4, HW_CVT=True)
    u8 = {"Q": "*u8", "QT": "*u8", "S": "*fp32", "ST": "*fp32", "AMAX": "*fp32"}
    ptx.append(build(m._amax_kernel, {"AMAX": "*fp32"}, {"BLOCK": 8192}, 8))
    for n, t, br, bc in ((0, 0, 64, 64), (1, 1, 128, 128), (2, 2, 128, 128), (2, -1, 32, 128), (-1, 2, 128, 32)):
        ptx.append(build(m._tile_kernel, u8, dict(N_MODE=n, T_MODE=t, **fp, BR=br, BC=bc), 8))
    ptx.append(build(m._row_kernel, u8, dict(**fp, BR=4, BC=1024), 4))
    ptx.append(build(m._tile_kernel, u8, dict(N_MODE=-1, T_MODE=3, **fp, BR=64, BC=64), 4))
ptx.append(build(m._col_amax_kernel, {"AMAX": "*fp32"}, {"BR": 64, "BC": 64}, 4))
all_ptx = "\n".join(ptx)
print(len(ptx), "cvt.rn.satfinite.e4m3x2.f32" in all_ptx, "cvt.rn.satfinite.e5m2x2.f32" in all_ptx,
      "div.rn.f32" in all_ptx)
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["17", "True", "True", "True"], r.stdout
