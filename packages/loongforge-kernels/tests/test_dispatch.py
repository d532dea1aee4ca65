"""Implementation selection: a direct call's ``impl``, the entry-point providers and core's ``select_op`` rules."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import loongforge_kernels as lk
import pytest
import torch
from loongforge_kernels import _dispatch
from loongforge_kernels._dispatch import PluginError

# NOTE: importing loongforge core's package pulls pydantic/pyyaml, which a bare GPU image may lack.
registry = pytest.importorskip(
    "loongforge.registry", reason="loongforge core (pydantic, pyyaml) not importable"
)
select_op = pytest.importorskip("loongforge.kernels").select_op
from loongforge_kernels.providers import OPS, TRITON_OPS, TorchProvider, TritonProvider  # noqa: E402


def _no_interpreter(monkeypatch):
    monkeypatch.setattr(_dispatch, "_interpreted", lambda: (False, False))


def test_providers_are_registered():
    registry.kernels.reset()
    assert registry.kernels.get("torch") is TorchProvider
    assert registry.kernels.get("triton") is TritonProvider
    assert set(TorchProvider().ops()) == set(OPS)
    assert set(TritonProvider().ops()) == set(OPS) | set(TRITON_OPS)


def test_every_served_op_is_in_the_core_op_list():
    from loongforge.kernels import OPS as CORE_OPS
    from loongforge_kernels.providers import TileLangProvider

    for cls in (TorchProvider, TritonProvider, TileLangProvider):
        assert set(cls().ops()) <= set(CORE_OPS), cls


def test_explicit_provider_that_cannot_serve_raises(monkeypatch):
    _no_interpreter(monkeypatch)
    with pytest.raises(PluginError, match="TRITON_INTERPRET"):
        select_op("rms_norm", provider="triton", device_type="cpu")
    with pytest.raises(PluginError, match="no op"):
        select_op("flash_attention", provider="torch", device_type="cpu")


def test_auto_falls_back_to_torch(monkeypatch):
    _no_interpreter(monkeypatch)
    op = select_op("rms_norm", provider="auto", device_type="cpu")
    assert op.keywords["impl"] == "torch"
    x, w = torch.randn(2, 8), torch.ones(8)
    torch.testing.assert_close(op(x, w), lk.references.rms_norm_ref(x, w))


def test_auto_prefers_triton_on_cuda():
    reason = _dispatch.triton_unavailable_reason("cuda")
    if reason:
        pytest.skip(reason)
    assert select_op("swiglu", device_type="cuda").keywords["impl"] == "triton"


def test_impl_argument(monkeypatch):
    """A direct call's ``impl`` is the only switch: no environment variable is read (one selection rule)."""
    x = torch.randn(2, 8)
    assert _dispatch.resolve("torch", x) == "torch"
    with pytest.raises(PluginError, match="bogus"):
        lk.swiglu(x, impl="bogus")
    _no_interpreter(monkeypatch)
    monkeypatch.setenv("LOONGFORGE_KERNELS", "triton")  # NOTE: once a second selection rule; now ignored
    assert _dispatch.resolve(None, x) == _dispatch.resolve("auto", x) == "torch"
    with pytest.raises(lk.KernelUnavailableError, match="TRITON_INTERPRET=1"):
        lk.swiglu(x, impl="triton")


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_fresh_process_behaviour():
    """Without the interpreter explicit triton raises a clear error; with it (set before import) triton runs."""
    code = (
        "import torch, loongforge_kernels as lk\n"
        "from loongforge_kernels import _dispatch\n"
        "x = torch.randn(2, 8)\n"
        "try:\n"
        "    print('resolved', _dispatch.resolve(None, x))\n"
        "    lk.swiglu(x, impl='triton')\n"
        "except lk.KernelUnavailableError as e:\n"
        "    print('error', e)\n"
    )
    r = _python(code)
    assert "error Triton kernels requested but unusable" in r.stdout and "TRITON_INTERPRET=1" in r.stdout, (
        r.stderr
    )
    assert "resolved triton" in _python(code, TRITON_INTERPRET="1").stdout


@pytest.mark.skipif(not _dispatch.HAS_TRITON, reason="triton not installed")
def test_interpreter_suite():
    """Run the ``interpreter``-marked tests in a fresh process with TRITON_INTERPRET=1 (see conftest.py)."""
    if _dispatch.triton_unavailable_reason("cpu") is None:
        pytest.skip("the interpreter is active in this process; those tests ran here")
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        str(Path(__file__).parent),
        "-q",
        "-p",
        "no:cacheprovider",
        "-m",
        "interpreter",
    ]
    r = subprocess.run(
        cmd, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert " passed" in r.stdout.splitlines()[-1] and "skipped" not in r.stdout.splitlines()[-1], r.stdout[
        -2000:
    ]


@pytest.mark.skipif(not _dispatch.HAS_TRITON, reason="triton not installed")
def test_kernels_compile_for_hopper():
    """The interpreter accepts code the compiler rejects: compile every kernel for sm_90, no GPU needed."""
    code = "from compile_specs import compile_all_kernels\nprint(len(compile_all_kernels()))"
    r = _python(code, PYTHONPATH=str(Path(__file__).parent))
    assert r.returncode == 0, r.stderr[-3000:]
    assert int(r.stdout.split()[-1]) >= 15
