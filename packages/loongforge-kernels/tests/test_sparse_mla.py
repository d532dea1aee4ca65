"""Sparse MLA (DSA) attention vs its plain-torch reference, forward and backward, and the top-k index helper.

Small dims (d_v 32 + d_rope 16) keep Triton's interpreter fast; tests/test_gpu.py runs DeepSeek's 512 + 64.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import loongforge_kernels as lk
import pytest
import torch
import torch.nn.functional as F
from loongforge_kernels import _dispatch, dsa_topk_indices, sparse_mla_attention
from loongforge_kernels.references import sparse_mla_ref
from loongforge_kernels.sparse_mla import CUDA_CONFIGS

from .conftest import assert_close, run_both

D_V, D_ROPE = 32, 16
# NOTE: grads get twice the dtype tolerance (conftest.TOL): dkv sums over every (query, head) that selected a
# row, and in bf16 the kernel rounds p and dS to bf16 before its MMAs (as FlashAttention) where the reference
# keeps fp32.
GRAD_SCALE = 2.0


def _inputs(t, h, g, topk, n_kv, dtype, *, d_v=D_V, d_rope=D_ROPE, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, d_v + d_rope, generator=gen).to(dtype)
    kv = torch.randn(n_kv, g, d_v + d_rope, generator=gen).to(dtype)
    # random draws repeat rows across queries (shared dkv rows) and within a query (counted twice)
    idx = torch.randint(0, n_kv, (t, g, topk), generator=gen, dtype=torch.int32)
    return q, kv, idx


def _check(q, kv, idx, *, d_v=D_V, sm_scale=None):
    """Kernel vs reference: o, lse, dq, dkv; returns the kernel's (o, lse)."""
    dtype = q.dtype
    (o_t, o_r), grads = run_both(
        lambda a, b, i: sparse_mla_attention(a, b, i, sm_scale, d_v, impl="triton"),
        lambda a, b, i: sparse_mla_ref(a, b, i, sm_scale, d_v),
        [q, kv, idx],
    )
    assert o_t.dtype == dtype and o_t.shape == (q.shape[0], q.shape[1], d_v)
    assert_close(o_t, o_r, dtype, name="o")
    (dq_t, dq_r), (dkv_t, dkv_r) = grads
    assert dq_t.dtype == dtype and dkv_t.dtype == dtype
    assert_close(dq_t, dq_r, dtype, scale=GRAD_SCALE, name="dq")
    assert_close(dkv_t, dkv_r, dtype, scale=GRAD_SCALE, name="dkv")
    o, lse = sparse_mla_attention(q, kv, idx, sm_scale, d_v, return_lse=True, impl="triton")
    _, lse_r = sparse_mla_ref(q, kv, idx, sm_scale, d_v, return_lse=True)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_r))
    finite = torch.isfinite(lse_r)
    torch.testing.assert_close(lse[finite], lse_r[finite], atol=1e-4, rtol=1e-4)
    return o, lse


DTYPES = [torch.float32, torch.bfloat16]


# (T, H, G, topk, T_kv): one token; topk below / equal to / not a multiple of the block (16 under the
# interpreter); H not a power of two; heads over two blocks (20 > 16); two kv groups of 3 heads
@pytest.mark.parametrize(
    "shape",
    [(1, 1, 1, 5, 3), (5, 5, 1, 16, 9), (7, 3, 1, 37, 50), (3, 20, 1, 20, 11), (4, 6, 2, 21, 13)],
    ids=lambda s: "T{}-H{}-G{}-k{}-kv{}".format(*s),
)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_sparse_mla_matches_reference(triton_cpu, shape, dtype):
    _check(*_inputs(*shape, dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_sparse_mla_masked_indices(triton_cpu, dtype):
    """-1, other negatives and >= T_kv are masked; a row with none valid gives zeros, lse -inf, zero grads."""
    q, kv, idx = _inputs(6, 5, 1, 24, 10, dtype, seed=2)
    idx[0, 0, 3:] = -1  # causal-style padding
    idx[1, 0] = -1  # fully masked row
    idx[2, 0, ::3] = 10  # == T_kv
    idx[3, 0, 1::4] = -7
    idx[4, 0, :] = idx[4, 0, 0]  # one row selected 24 times
    o, lse = _check(q, kv, idx, sm_scale=0.3)
    assert torch.all(o[1] == 0) and torch.all(torch.isneginf(lse[1]))
    qq = q.clone().requires_grad_(True)
    sparse_mla_attention(qq, kv, idx, 0.3, D_V, impl="triton").sum().backward()
    assert torch.all(qq.grad[1] == 0) and torch.isfinite(qq.grad).all()


def test_sparse_mla_all_masked_and_empty(triton_cpu):
    q, kv, idx = _inputs(3, 4, 1, 8, 5, torch.float32)
    kvv = kv.clone().requires_grad_(True)
    o = sparse_mla_attention(q, kvv, torch.full_like(idx, -1), None, D_V, impl="triton")
    o.sum().backward()
    assert torch.all(o == 0) and torch.all(kvv.grad == 0)
    empty = sparse_mla_attention(q, kv, idx[:, :, :0], None, D_V, impl="triton")
    assert empty.shape == (3, 4, D_V) and torch.all(empty == 0)


def test_sparse_mla_layouts(triton_cpu):
    """Strided q / kv (views into wider buffers), int64 indices, no rope channels (d_v == D)."""
    q, kv, idx = _inputs(5, 3, 1, 19, 12, torch.float32, seed=3)
    q_wide = torch.cat([q, torch.randn(5, 3, 8)], dim=-1)[..., : D_V + D_ROPE]
    kv_wide = torch.cat([kv, torch.randn(12, 1, 4)], dim=-1)[..., : D_V + D_ROPE]
    assert not q_wide.is_contiguous() and not kv_wide.is_contiguous()
    _check(q_wide, kv_wide, idx.long())
    _check(q, kv, idx, d_v=D_V + D_ROPE)


def test_sparse_mla_torch_impl_and_errors(monkeypatch):
    q, kv, idx = _inputs(4, 2, 1, 6, 7, torch.float32)
    torch.testing.assert_close(
        sparse_mla_attention(q, kv, idx, None, D_V, impl="torch"), sparse_mla_ref(q, kv, idx, None, D_V)
    )
    with pytest.raises(ValueError, match="H % G"):
        sparse_mla_attention(q, kv.expand(7, 3, -1), idx.expand(4, 3, -1), None, D_V)
    with pytest.raises(ValueError, match="indices"):
        sparse_mla_attention(q, kv, idx[:3], None, D_V)
    with pytest.raises(ValueError, match="d_v"):
        sparse_mla_attention(q, kv, idx, None, 512)
    with pytest.raises(ValueError, match="integer"):
        sparse_mla_attention(q, kv, idx.float(), None, D_V)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_sparse_mla_with_all_causal_keys_is_dense_causal_attention(impl):
    """topk >= T selects every causal key: the result must equal dense causal MQA attention (SDPA)."""
    if impl == "triton" and _dispatch.triton_unavailable_reason("cpu"):
        pytest.skip("needs Triton's interpreter (test_interpreter_suite runs it)")
    t, h = 9, 4
    q, kv, _ = _inputs(t, h, 1, 1, t, torch.float32, seed=4)
    idx = dsa_topk_indices(torch.randn(t, t), topk=12, causal=True)
    out = sparse_mla_attention(q, kv, idx, None, D_V, impl=impl)
    k = kv[:, 0].unsqueeze(0).expand(h, -1, -1)
    dense = F.scaled_dot_product_attention(
        q.transpose(0, 1), k, k[..., :D_V], is_causal=True, scale=(D_V + D_ROPE) ** -0.5
    ).transpose(0, 1)
    torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-5)


def test_dsa_topk_indices():
    gen = torch.Generator().manual_seed(5)
    scores = torch.randn(6, 9, generator=gen)  # 6 queries are the last 6 of 9 positions
    idx = dsa_topk_indices(scores, topk=5, causal=True)
    assert idx.dtype == torch.int32 and idx.shape == (6, 1, 5)
    for i in range(6):
        allowed = scores[i, : i + 4]
        want = allowed.topk(min(5, allowed.numel())).indices.tolist()
        got = idx[i, 0].tolist()
        assert got[: len(want)] == want and all(j == -1 for j in got[len(want) :]), (i, got, want)
    # topk above T_kv pads with -1; without causal every key is eligible; -inf scores are never selected
    s = torch.randn(2, 3, 4, generator=gen)
    s[0, 1, 2] = float("-inf")
    idx = dsa_topk_indices(s, topk=6, causal=False)
    assert idx.shape == (2, 3, 6) and (idx[..., 4:] == -1).all()
    assert sorted(idx[1, 2, :4].tolist()) == [0, 1, 2, 3] and sorted(idx[0, 1, :3].tolist()) == [0, 1, 3]
    assert idx[0, 1, 3] == -1


def test_sparse_mla_compiles_for_hopper():
    """Every CUDA autotune config compiles for sm_90 and fits its shared memory at DeepSeek's shape."""
    if not _dispatch.HAS_TRITON:
        pytest.skip("triton not installed")
    code = f"""
import inspect, triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from loongforge_kernels import sparse_mla as sm
ptrs = {{"IDX": "*i32", "LSE": "*fp32", "DELTA": "*fp32", "DKV": "*fp32"}}
for which, kernel in (("fwd", sm._sparse_mla_fwd_kernel), ("bwd", sm._sparse_mla_bwd_kernel)):
    params = list(inspect.signature(kernel.fn).parameters)
    for bh, bk, warps, stages in sm.CUDA_CONFIGS[which]:
        consts = dict(BLOCK_H=bh, BLOCK_K=bk, BLOCK_DV=512, BLOCK_DR=64, DOT_DTYPE=tl.bfloat16,
                      DOT_PRECISION="tf32")
        sig = {{p: "constexpr" if p in consts else ptrs.get(p, "*bf16") if p.isupper()
               else "fp32" if "scale" in p else "i32" for p in params}}
        src = ASTSource(fn=kernel, signature=sig, constexprs={{(params.index(k),): v for k, v in consts.items()}})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
        assert k.metadata.shared <= {227 * 1024}, (which, bh, bk, k.metadata.shared)
        print(which, bh, bk, warps, stages, k.metadata.shared)
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(r.stdout.splitlines()) == sum(len(c) for c in CUDA_CONFIGS.values()), r.stdout


# ---------------------------------------------------------------------------------------------- TileLang
# The TileLang kernels (tilelang_sparse_mla.py) need a GPU to run (tests/test_gpu.py); here: that the module and
# the dispatch work without tilelang, and, where tilelang and nvcc are installed, that every kernel compiles.


@pytest.fixture
def no_tilelang(monkeypatch):
    """Make ``import tilelang`` fail (as in CI, where the optional extra is not installed)."""
    from loongforge_kernels import tilelang_sparse_mla as tsm

    cached = tsm._setup_error  # tests may replace it; its cache must not keep this fixture's answer
    monkeypatch.setitem(sys.modules, "tilelang", None)
    cached.cache_clear()
    yield tsm
    cached.cache_clear()


def _fake_hopper(monkeypatch):
    """Pretend a CUDA SM 9.0 device is present (only the availability checks look at it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


class _FakeCuda:
    """Stands in for a CUDA tensor where only the dispatch looks: device, dtype, shape."""

    def __init__(self, dtype=torch.bfloat16, d=576):
        self.device, self.dtype, self.shape = torch.device("cuda"), dtype, (1, 1, d)


def test_tilelang_module_imports_without_tilelang(no_tilelang):
    """The module imports, names why it cannot run, and builds nothing, with tilelang unimportable."""
    code = (
        "import sys; sys.modules['tilelang'] = None\n"
        "import loongforge_kernels.tilelang_sparse_mla as tsm\n"
        "from loongforge_kernels.providers import TileLangProvider\n"
        "print(tsm._setup_error())\n"
        "print(sorted(TileLangProvider().ops()))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tilelang is not importable" in r.stdout and "['sparse_mla_attention']" in r.stdout, r.stdout
    assert "tilelang is not importable" in no_tilelang._setup_error()
    assert "CUDA" in no_tilelang.tilelang_unavailable_reason("cpu")


def test_tilelang_explicit_on_cpu_raises(no_tilelang):
    q, kv, idx = _inputs(3, 2, 1, 5, 4, torch.bfloat16)
    with pytest.raises(lk.KernelUnavailableError, match="TileLang kernels requested but unusable: .*CUDA"):
        sparse_mla_attention(q, kv, idx, None, D_V, impl="tilelang")


def test_tilelang_unavailable_reasons(no_tilelang, monkeypatch):
    tsm = no_tilelang
    _fake_hopper(monkeypatch)
    assert "tilelang is not importable" in tsm.tilelang_unavailable_reason("cuda")
    monkeypatch.setattr(tsm, "_setup_error", lambda: None)
    assert tsm.tilelang_unavailable_reason("cuda") is None
    assert tsm.unsupported_reason(_FakeCuda(), 512) is None
    assert "bf16 or fp16" in tsm.unsupported_reason(_FakeCuda(torch.float32), 512)
    assert "multiples of 16" in tsm.unsupported_reason(_FakeCuda(d=520), 512)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "SM >= 9.0" in tsm.tilelang_unavailable_reason("cuda")


def test_auto_uses_tilelang_only_when_it_can_run(no_tilelang, monkeypatch):
    """``auto`` on CUDA: TileLang when it can run the call, else Triton; never on CPU or when pinned."""
    from loongforge_kernels import sparse_mla

    tsm = no_tilelang
    _fake_hopper(monkeypatch)
    assert not sparse_mla._use_tilelang(None, _FakeCuda(), 512)  # tilelang missing: Triton
    assert sparse_mla._use_tilelang("tilelang", _FakeCuda(), 512)  # explicit: its own error names why
    monkeypatch.setattr(tsm, "_setup_error", lambda: None)
    assert sparse_mla._use_tilelang(None, _FakeCuda(), 512)
    assert sparse_mla._use_tilelang("auto", _FakeCuda(), 512)
    assert not sparse_mla._use_tilelang(None, _FakeCuda(torch.float32), 512)  # fp32: Triton's exact path
    assert not sparse_mla._use_tilelang("triton", _FakeCuda(), 512)
    q, kv, idx = _inputs(4, 2, 1, 6, 7, torch.float32)
    assert not sparse_mla._use_tilelang(None, q, D_V)  # CPU tensors
    torch.testing.assert_close(
        sparse_mla_attention(q, kv, idx, None, D_V), sparse_mla_ref(q, kv, idx, None, D_V)
    )


def test_tilelang_provider(no_tilelang, monkeypatch):
    """The provider serves sparse MLA only; core's select_op skips or rejects it like any provider."""
    from loongforge_kernels.providers import TileLangProvider

    prov = TileLangProvider()
    assert prov.name == "tilelang" and set(prov.ops()) == {"sparse_mla_attention"}
    assert prov.ops()["sparse_mla_attention"].keywords["impl"] == "tilelang"
    assert "CUDA" in prov.unavailable_reason("cpu")
    registry = pytest.importorskip("loongforge.registry", reason="loongforge core not importable")
    from loongforge.errors import PluginError
    from loongforge.kernels import select_op

    registry.kernels.reset()
    if "tilelang" not in registry.kernels:
        pytest.skip("the tilelang entry point is not installed yet: reinstall loongforge-kernels (uv sync)")
    assert registry.kernels.get("tilelang") is TileLangProvider
    with pytest.raises(PluginError, match="cannot run on cpu"):
        select_op("sparse_mla_attention", provider="tilelang", device_type="cpu")
    monkeypatch.setattr(TileLangProvider, "unavailable_reason", lambda self, device_type: None)
    with pytest.raises(PluginError, match="has no op 'rms_norm'"):
        select_op("rms_norm", provider="tilelang", device_type="cuda")
    assert (
        select_op("sparse_mla_attention", provider="tilelang", device_type="cuda").keywords["impl"]
        == "tilelang"
    )


def test_tilelang_compiles_for_hopper():
    """Every TileLang kernel lowers and compiles (nvcc) for sm_90a at DeepSeek's shape and at odd ones, and
    fits Hopper's shared memory. Needs tilelang and nvcc, not a GPU (tilelang finds nvcc through CUDA_HOME,
    PATH or the nvidia-cuda-nvcc wheel)."""
    if importlib.util.find_spec("tilelang") is None:
        pytest.skip("tilelang not installed (pip install 'loongforge-kernels[tilelang]' nvidia-cuda-nvcc)")
    code = f"""
import tilelang
from tvm.target import Target
from loongforge_kernels import tilelang_sparse_mla as tsm
tilelang.disable_cache()  # a cache hit has no device module to read the shared memory from
target = Target({{"kind": "cuda", "arch": "sm_90a"}})
# (heads per group, groups, d_v, d_rope, topk, sm_scale, dtype): DeepSeek; topk not a multiple of the kv block
# and 16 heads; 5 heads per group (padded) in 2 groups, fp16, small dims; no rope, 2 head blocks, 1 kv block
shapes = [(64, 1, 512, 64, 2048, 576**-0.5, "bfloat16"), (16, 1, 512, 64, 100, 0.1, "bfloat16"),
          (5, 2, 32, 16, 37, 0.2, "float16"), (128, 1, 512, 0, 24, 0.3, "bfloat16")]
for sh in shapes:
    progs = [("fwd", tsm.fwd_program(*sh, **tsm.FWD), [-2, -1]), ("bwd", tsm.bwd_program(*sh, **tsm.BWD), [-1]),
             ("delta", tsm.delta_program(sh[2], sh[6], **tsm.DELTA), [-1])]
    for name, prog, out_idx in progs:
        kernel = tsm.compile_program(prog, out_idx, target=target)
        funcs = kernel.artifact.device_mod.functions.values()
        smem = max((int(f.attrs["dyn_shared_memory_buf"]) for f in funcs
                    if f.attrs is not None and "dyn_shared_memory_buf" in f.attrs), default=0)
        assert smem <= {227 * 1024}, (name, sh, smem)
        assert "__global__" in kernel.get_kernel_source()
        print("compiled", name, sh, smem)
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert sum(line.startswith("compiled ") for line in r.stdout.splitlines()) == 12, r.stdout[-4000:]


def test_tilelang_kernels_match_reference_on_tilelang_c_backend():
    """``impl="tilelang"`` end to end (autograd Function, delta, fwd and bwd programs) vs the reference, with the
    kernels built for TileLang's C backend: shared / fragment buffers become local arrays and parallel loops
    serial ones, so this checks the programs' math and indexing (masks, topk tail, padded heads, groups, online
    softmax, dkv scatter), not GPU layouts or synchronisation (tests/test_gpu.py does). fp16 only: the C backend
    has no bf16. Needs tilelang and a C++ compiler, not a GPU."""
    if importlib.util.find_spec("tilelang") is None:
        pytest.skip("tilelang not installed (pip install 'loongforge-kernels[tilelang]')")
    code = """
import contextlib, tilelang, torch
import tilelang.language as T
from tilelang.cpu.language import Kernel
from loongforge_kernels import sparse_mla_attention, tilelang_sparse_mla as tsm
from loongforge_kernels.references import sparse_mla_ref
serial = T.serial
T.Kernel = lambda *blocks, threads=None: Kernel(*blocks)
T.alloc_fragment = T.alloc_shared = T.alloc_local
T.Parallel = lambda *ext: serial(ext[0]) if len(ext) == 1 else T.grid(*ext)
T.Pipelined = lambda n, num_stages=0: serial(n)
tsm.TARGET = "c"
tsm.PASS_CONFIGS["tirx.disable_vectorize"] = True  # the C backend cannot cast float4 to half4
tsm.unsupported_reason = lambda q, d_v: None
torch.cuda.device = lambda device: contextlib.nullcontext()
# (T, H, G, topk, T_kv, d_v, d_rope, scale): tail of a kv block, 5 heads per group padded to 16, 2 groups;
# one kv block; 70 heads in 2 head blocks; no rope channels
for t, h, g, topk, n_kv, d_v, d_rope, scale in [(6, 10, 2, 37, 50, 32, 16, 0.2), (6, 20, 1, 24, 10, 32, 16, 0.3),
                                                 (5, 70, 1, 40, 64, 32, 32, None), (5, 3, 1, 19, 12, 48, 0, 0.2)]:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(t, h, d_v + d_rope, generator=gen).half()
    kv = torch.randn(n_kv, g, d_v + d_rope, generator=gen).half()
    do = torch.randn(t, h, d_v, generator=gen).half()
    idx = torch.randint(0, n_kv, (t, g, topk), generator=gen, dtype=torch.int32)
    idx[0, :, 3:], idx[1], idx[2, :, ::3], idx[3, :, 1::4], idx[4] = -1, -1, n_kv, -7, idx[4, :, :1]
    outs = []
    for impl, dtype in (("tilelang", torch.half), ("torch", torch.float)):  # the reference in fp32 math
        qq, kk = q.detach().to(dtype).requires_grad_(True), kv.detach().to(dtype).requires_grad_(True)
        o, lse = sparse_mla_attention(qq, kk, idx, scale, d_v, return_lse=True, impl=impl)
        o.backward(do.to(dtype))
        outs.append((o.detach(), lse, qq.grad, kk.grad))
    (o, lse, dq, dkv), (o_r, lse_r, dq_r, dkv_r) = outs
    assert o.dtype == dq.dtype == dkv.dtype == torch.half and lse.dtype == torch.float
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_r)) and torch.isneginf(lse[1]).all()
    fin = torch.isfinite(lse_r)
    torch.testing.assert_close(lse[fin], lse_r[fin], atol=1e-5, rtol=1e-5)
    for name, got, want in (("o", o, o_r), ("dq", dq, dq_r), ("dkv", dkv, dkv_r)):
        err = (got.float() - want).norm() / want.norm()
        assert err < 2e-3, (name, t, h, g, topk, err.item())
    assert (o[1] == 0).all() and (dq[1] == 0).all()
    print("matched", t, h, g, topk)
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert sum(line.startswith("matched ") for line in r.stdout.splitlines()) == 4, r.stdout[-4000:]
