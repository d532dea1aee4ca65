"""FP8 grouped GEMMs (MoE experts) on CPU: the operands, layouts, scales and zero-padded weight-grad groups each
of the three GEMMs hands ``torch._scaled_grouped_mm``, through an emulation of that kernel which also checks its
Hopper layout rules (K-major operands, 16-aligned weight-grad groups); ``test_gpu_fp8.py`` runs the real kernel."""

from __future__ import annotations

import pytest
import torch
from loongforge_kernels import fp8_grouped as fg


def _emulated_sgmm(a, sa, b, sb, offs, fast_accum):
    assert a.dtype == b.dtype == torch.float8_e4m3fn and sa.dtype == sb.dtype == torch.float32
    assert a.stride(-1) == 1 and b.stride(-2) == 1, "operands must be K-major (a row-major, b column-major)"
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    if b.dim() == 3:  # 2-D x 3-D: groups of a's rows; a [M, K] s [M], b [E, K, N] s [E, N]
        out = torch.zeros(a.shape[0], b.shape[-1])
        for g, (s, e) in enumerate(zip(starts, ends, strict=True)):
            out[s:e] = (a[s:e].float() * sa[s:e, None]) @ (b[g].float() * sb[g][None, :])
        return out.to(torch.bfloat16)
    # 2-D x 2-D: groups along the contraction; a [N, Mp] s [E * N], b [Mp, K] s [E * K]; out [E, N, K]
    n, k = a.shape[0], b.shape[1]
    out = torch.zeros(len(ends), n, k)
    for g, (s, e) in enumerate(zip(starts, ends, strict=True)):
        assert s % 16 == 0 and (e - s) % 16 == 0, f"group {g} [{s}, {e}) is not 16-aligned"
        out[g] = (a[:, s:e].float() * sa[g * n:(g + 1) * n, None]) @ (b[s:e].float() * sb[g * k:(g + 1) * k][None, :])
    return out.to(torch.bfloat16)


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(fg, "_sgmm", _emulated_sgmm)


def test_padded_groups_align_every_group():
    counts = [3, 0, 17, 16, 1]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    dest, poffs, rows = fg.padded_groups(offs, sum(counts))
    assert poffs.tolist() == [16, 16, 48, 64, 80] and rows % 16 == 0 and rows >= 80
    starts = [0, 16, 16, 48, 64]
    want = [starts[g] + i for g, c in enumerate(counts) for i in range(c)]
    assert dest.tolist() == want


@pytest.mark.parametrize("gemms", [(True, True, True), (True, False, True), (False, True, False)])
def test_fp8_grouped_linear_matches_fp32(emulated, gemms):
    gen = torch.Generator().manual_seed(0)
    counts = [37, 0, 5, 64, 19]  # an expert without tokens, groups that are not multiples of 16
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    x = torch.randn(sum(counts), 64, generator=gen).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(len(counts), 48, 64, generator=gen) / 8).to(torch.bfloat16).requires_grad_()
    g = torch.randn(sum(counts), 48, generator=gen).to(torch.bfloat16)
    y = fg.fp8_grouped_linear(x, w, offs, gemms)
    y.backward(g)
    xr, wr = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    yr = torch.cat([xe @ wr[e].T for e, xe in enumerate(xr.split(counts))])
    yr.backward(g.float())
    for name, a, r, fp8 in (("y", y, yr, gemms[0]), ("dx", x.grad, xr.grad, gemms[1]), ("dw", w.grad, wr.grad, gemms[2])):
        err = ((a.float() - r).norm() / r.norm()).item()
        assert err < (0.08 if fp8 else 0.01), (name, err)
        assert a.dtype == torch.bfloat16
    assert torch.count_nonzero(w.grad[1]) == 0


def test_fp8_grouped_linear_falls_back_to_bf16(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("an FP8 grouped GEMM ran")

    monkeypatch.setattr(fg, "_sgmm", refuse)
    offs = torch.tensor([4, 9], dtype=torch.int32)
    x = torch.randn(9, 24).to(torch.bfloat16)
    w = torch.randn(2, 40, 24).to(torch.bfloat16)  # K = 24: not a multiple of 16
    assert fg.fp8_grouped_linear(x, w, offs).shape == (9, 40)
    assert fg.fp8_grouped_linear(x[:, :16], w[:, :32, :16].contiguous(), offs, (False, False, False)).shape == (9, 32)
    assert not fg.grouped_shape_ok(40, 24) and fg.grouped_shape_ok(32, 16)


def test_unavailable_reason_names_the_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "no CUDA GPU" in fg.grouped_fp8_unavailable_reason()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 9))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA L40S")
    assert "Hopper (9.0) only; NVIDIA L40S is 8.9" in fg.grouped_fp8_unavailable_reason()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    assert fg.grouped_fp8_unavailable_reason() is None
