"""Kernel tests on CPU run the Triton kernels through Triton's interpreter.

NOTE: Triton reads TRITON_INTERPRET when ``@triton.jit`` decorates, its own standard library included, so it
must be set before anything imports triton, and it is process-wide. We never set it in the test process (that
would change what every other package's tests see). Tests that need it carry the ``interpreter`` marker: they
run in-process when the interpreter is already active (``TRITON_INTERPRET=1 pytest ...``), else they skip here
and ``test_dispatch.py::test_interpreter_suite`` runs exactly them in a fresh process with the variable set.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from loongforge_kernels import _dispatch

HERE = Path(__file__).parent

# Per-dtype tolerances (atol, rtol) for kernel vs fp32-math reference on the same inputs. bf16 outputs are
# rounded once, so they may differ by about one bf16 ulp (2^-8 relative).
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}


def pytest_configure(config):
    config.addinivalue_line("markers", "interpreter: runs Triton kernels on CPU through Triton's interpreter")
    # the interpreter indexes numpy arrays in a way numpy deprecates; not ours to fix
    config.addinivalue_line("filterwarnings", "ignore:Conversion of an array with ndim:DeprecationWarning")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE not in Path(str(item.path)).parents:
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "triton_cpu" in item.fixturenames or params.get("impl") == "triton":
            item.add_marker(pytest.mark.interpreter)


@pytest.fixture
def triton_cpu():
    """Skip unless Triton kernels can run on CPU tensors in this process (the interpreter is active)."""
    if _dispatch.triton_unavailable_reason("cpu"):
        pytest.skip(
            "needs Triton's interpreter: test_interpreter_suite runs it in a TRITON_INTERPRET=1 subprocess"
        )


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, *, scale: float = 1.0, name=""
):
    """Compare with the dtype's tolerance; ``scale`` widens it for reductions over many terms."""
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(
        actual.float(), expected.float(), atol=atol * scale, rtol=rtol * scale, msg=name or None
    )


def run_both(fn_test, fn_ref, inputs, *, grad_seed: int = 0):
    """Forward + backward of both on cloned leaves with one random upstream grad; returns (outs, grads)."""
    leaves_t = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    leaves_r = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out_t, out_r = fn_test(*leaves_t), fn_ref(*leaves_r)
    gen = torch.Generator().manual_seed(grad_seed)
    g = torch.randn(out_r.shape, generator=gen).to(out_r.dtype)
    out_t.backward(g)
    out_r.backward(g)
    grads = [(a.grad, b.grad) for a, b in zip(leaves_t, leaves_r, strict=True) if b.grad is not None]
    return (out_t, out_r), grads
