"""Delta-FP8 codec kernels vs their torch references: bit-identical payloads and reconstructions.

No tolerances: every check is ``torch.equal`` on bytes. On CPU the kernels run in Triton's interpreter without
the GPU conversions (``HW_CVT``), i.e. with the integer rounding; ``test_gpu.py`` compares the CUDA path, and
``test_hopper_ptx_keeps_ieee_rounding`` checks here that the sm_90 code rounds each step as torch does.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from loongforge_kernels import KernelUnavailableError, _dispatch
from loongforge_kernels.fp8_delta import BLOCK, apply_fp8_deltas, encode_fp8_delta, payload_bytes
from loongforge_kernels.references import apply_fp8_deltas_ref, encode_fp8_delta_ref

NUMELS = [1, 255, 256, 257, 4099, 3 * 32 * 256 + 5]  # the last spans several programs


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


def _slab(numel: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, ref): magnitudes from fp32 subnormals to 1e30 per element, exact zeros, equal pairs (zero delta),
    a zero block and a block whose deltas are all fp32 subnormals."""
    mag = 10.0 ** torch.randint(-44, 31, (numel,), generator=gen).double()
    x = (torch.randn(numel, generator=gen, dtype=torch.float64) * mag).to(dtype)
    ref = (x.double() + torch.randn(numel, generator=gen, dtype=torch.float64) * mag * 0.1).to(dtype)
    x[::7] = 0
    ref[::5] = x[::5]
    if numel > 2 * BLOCK:
        x[:BLOCK] = ref[:BLOCK]
        ref[BLOCK : 2 * BLOCK] = 0
        x[BLOCK : 2 * BLOCK] = (torch.randn(BLOCK, generator=gen) * 1e-40).to(dtype)
    return x, ref


@pytest.mark.parametrize("numel", NUMELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_encode_matches_reference(triton_cpu, numel, dtype):
    x, ref = _slab(numel, dtype, torch.Generator().manual_seed(numel))
    got = encode_fp8_delta(x, ref, impl="triton")
    want = encode_fp8_delta_ref(x, ref)
    assert got.dtype == torch.uint8 and got.shape == (payload_bytes(numel),)
    assert torch.equal(got, want), (got != want).nonzero()[:8].flatten().tolist()


def test_encode_rounds_ties_to_even(triton_cpu):
    """One block with amax 448, so its scale is exactly 1 and d / scale = d: every E4M3 midpoint, one fp32
    ulp either side of it, E4M3 subnormals and fp32 subnormals, against torch's own fp32 -> E4M3 cast."""
    codes = torch.arange(0, 0x7F, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (codes[:-1] + codes[1:]) / 2  # exact in fp32
    vals = torch.cat(
        (
            mids,
            torch.nextafter(mids, torch.full_like(mids, 1e9)),
            torch.nextafter(mids, torch.zeros_like(mids)),
            torch.tensor([448.0, 2.0**-10, 3 * 2.0**-11, 2.0**-130, 1e-45]),
        )
    )
    assert vals.numel() <= 3 * BLOCK
    d = torch.zeros(3 * BLOCK)
    d[: vals.numel()] = vals
    d[1::2] *= -1
    for b in range(3):
        d[b * BLOCK] = 448.0
    got = encode_fp8_delta(d, torch.zeros_like(d), impl="triton")
    assert torch.equal(got[3 * BLOCK :].view(torch.float32), torch.ones(3))
    assert torch.equal(got[: 3 * BLOCK], d.to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(got, encode_fp8_delta_ref(d, torch.zeros_like(d)))


def _payloads(world: int, numel: int, gen: torch.Generator) -> torch.Tensor:
    """Encoded deltas; every other block has a power-of-two scale (amax 448 * 2^k), so q * scale has 4
    significant bits and recon + q * scale often lands exactly half-way between two bf16 values."""
    rows = []
    for _ in range(world):
        d = torch.randn(numel, generator=gen) * 10.0 ** torch.randint(-6, 2, (numel,), generator=gen)
        for b in range(0, numel, 2 * BLOCK):
            d[b] = 448.0 * 2.0 ** int(torch.randint(-12, 0, (), generator=gen))
        rows.append(encode_fp8_delta_ref(d, torch.zeros(numel)))
    return torch.stack(rows)


@pytest.mark.parametrize("numel", NUMELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_matches_reference(triton_cpu, numel, dtype):
    gen = torch.Generator().manual_seed(numel)
    world = 3
    gathered = _payloads(world, numel, gen)
    recon = (torch.randn(world, numel, generator=gen) * 2.0 ** torch.randint(-14, 2, (world, numel))).to(
        dtype
    )
    recon[:, ::9] = 0
    got, want, out = recon.clone(), recon.clone(), torch.full_like(recon, float("nan"))
    apply_fp8_deltas(got, gathered, out=out, impl="triton")
    apply_fp8_deltas_ref(want, gathered)
    assert torch.equal(_bits(got), _bits(want)), (got != want).nonzero()[:8].tolist()
    assert torch.equal(_bits(out), _bits(got))
    if dtype == torch.bfloat16 and numel >= 4099:  # the ties the rounding must break to even did occur
        nb = -(-numel // BLOCK)
        q = gathered[:, : nb * BLOCK].view(torch.float8_e4m3fn).float().view(world, nb, BLOCK)
        dq = (q * gathered[:, nb * BLOCK :].view(torch.float32)[:, :, None]).view(world, -1)[:, :numel]
        ties = ((recon.float() + dq).view(torch.int32) & 0xFFFF) == 0x8000
        assert ties.sum() >= 20, ties.sum()


def test_decode_without_out_and_round_trip(triton_cpu):
    gen = torch.Generator().manual_seed(1)
    x, ref = _slab(1000, torch.bfloat16, gen)
    ref = ref.clamp(-1e30, 1e30)
    payload = encode_fp8_delta(x, ref, impl="triton")
    got, want = ref.clone().view(1, -1), ref.clone().view(1, -1)
    apply_fp8_deltas(got, payload.view(1, -1), impl="triton")
    apply_fp8_deltas_ref(want, encode_fp8_delta_ref(x, ref).view(1, -1))
    assert torch.equal(_bits(got), _bits(want))


def test_dispatch_and_validation(triton_cpu, monkeypatch):
    x = torch.randn(300)
    assert torch.equal(encode_fp8_delta(x, x.flip(0), impl="torch"), encode_fp8_delta_ref(x, x.flip(0)))
    with pytest.raises(KernelUnavailableError, match="bf16 / fp32"):
        encode_fp8_delta(x.half(), x.half(), impl="triton")
    # NOTE: auto (impl None) falls back to the reference for fp16
    h = x.half()
    assert torch.equal(encode_fp8_delta(h, h.flip(0)), encode_fp8_delta_ref(h, h.flip(0)))
    with pytest.raises(ValueError, match="elements"):
        encode_fp8_delta(x, x[:10], impl="triton")
    with pytest.raises(ValueError, match="uint8"):
        apply_fp8_deltas(x.view(1, -1), torch.zeros(1, 5, dtype=torch.uint8), impl="triton")


@pytest.mark.skipif(not _dispatch.HAS_TRITON, reason="triton not installed")
def test_hopper_ptx_keeps_ieee_rounding():
    """The sm_90 code (as launched: no FP fusion) divides with div.rn, converts with cvt.rn, never fuses
    recon + q * scale into an FMA and never flushes subnormals: each step rounds as torch's kernels do."""
    code = (
        "from compile_specs import compile_kernel\n"
        "for k in ('_encode_kernel#True', '_decode_kernel#True'):\n"
        "    print('=====', k)\n"
        "    print(compile_kernel('fp8_delta.' + k).asm['ptx'])\n"
    )
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    _, enc, dec = r.stdout.split("===== ")
    assert "div.rn.f32" in enc and "cvt.rn.satfinite.e4m3x2.f32" in enc
    assert "cvt.rn.bf16.f32" in dec and "mul.rn.f32" in dec and "add.rn.f32" in dec
    for ptx in (enc, dec):
        assert not re.search(r"\bfma\.|\.ftz|div\.(full|approx)", ptx)
