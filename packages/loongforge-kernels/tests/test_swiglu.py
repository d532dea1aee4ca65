from __future__ import annotations

import pytest
import torch
from loongforge_kernels import SwiGLU, swiglu
from loongforge_kernels.references import swiglu_ref

from .conftest import assert_close, run_both


@pytest.mark.parametrize("shape", [(1, 2 * 1000), (3, 2, 2 * 64), (4, 2 * 4001), (2, 2 * 1024)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_matches_reference(triton_cpu, shape, dtype):
    torch.manual_seed(0)
    x = torch.randn(shape).to(dtype)
    (out_t, out_r), [(dx_t, dx_r)] = run_both(lambda a: swiglu(a, impl="triton"), swiglu_ref, [x])
    assert out_t.shape == (*shape[:-1], shape[-1] // 2) and out_t.dtype == dtype
    assert_close(out_t, out_r, dtype, name="y")
    assert_close(dx_t, dx_r, dtype, scale=2, name="dx")


def test_swiglu_semantics_and_module(triton_cpu, monkeypatch):
    x = torch.randn(5, 2 * 7)
    expected = torch.nn.functional.silu(x[:, :7]) * x[:, 7:]
    assert_close(swiglu(x, impl="triton"), expected, torch.float32)
    assert_close(SwiGLU(impl="triton")(x), expected, torch.float32)
    with pytest.raises(ValueError, match="even"):
        swiglu(torch.randn(2, 5), impl="triton")
