"""The compiled Triton (and TileLang) kernels on a CUDA device at training-like shapes (skipped without CUDA)."""

from __future__ import annotations

import loongforge_kernels as lk
import pytest
import torch
from loongforge_kernels import references as ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# (atol, rtol) on GPU: bf16 grads of long reductions get a wider band.
BF16 = dict(atol=3e-2, rtol=3e-2)


def _grads(fn, inputs, *, seed=0):
    leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out = fn(*leaves)
    g = torch.randn(out.shape, device=out.device, generator=torch.Generator(out.device).manual_seed(seed))
    out.backward(g.to(out.dtype))
    return out, [x.grad for x in leaves if x.grad is not None]


def _check(fn_t, fn_r, inputs, *, ref_fp32=False, **tol):
    """Kernel vs reference, outputs and input grads; ``ref_fp32`` runs the reference on fp32 copies of the
    inputs (for references whose own bf16 backward accumulates in bf16, e.g. index_select's index_add)."""
    out_t, g_t = _grads(fn_t, inputs)
    ref_inputs = [x.float() if ref_fp32 and x.is_floating_point() else x for x in inputs]
    out_r, g_r = _grads(fn_r, ref_inputs)
    torch.testing.assert_close(out_t.float(), out_r.float(), **tol)
    for a, b in zip(g_t, g_r, strict=True):
        torch.testing.assert_close(a.float(), b.float(), **tol)


@pytest.mark.parametrize("hidden", [2048, 4096, 4001])
def test_rms_norm_gpu(hidden):
    x = torch.randn(4096, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(hidden, device="cuda") + 0.5
    _check(lambda a, b: lk.rms_norm(a, b, impl="triton"), ref.rms_norm_ref, [x, w], atol=5e-2, rtol=2e-2)


@pytest.mark.parametrize("ffn", [8192, 14336, 1000])
def test_swiglu_gpu(ffn):
    x = torch.randn(2048, 2 * ffn, device="cuda", dtype=torch.bfloat16)
    _check(lambda a: lk.swiglu(a, impl="triton"), ref.swiglu_ref, [x], **BF16)


def test_rope_gpu():
    x = torch.randn(1024, 2, 32, 128, device="cuda", dtype=torch.bfloat16)
    freqs = torch.rand(1024, 1, 1, 64, device="cuda") * 100
    _check(lambda a: lk.apply_rope(a, freqs, impl="triton"), lambda a: ref.rope_ref(a, freqs), [x], **BF16)
    cu = torch.tensor([0, 100, 1100, 2048], device="cuda", dtype=torch.int32)
    xt = x.view(2048, 32, 128)
    _check(
        lambda a: lk.apply_rope(a, freqs, cu_seqlens=cu, impl="triton"),
        lambda a: ref.rope_ref(a, freqs, cu_seqlens=cu),
        [xt],
        **BF16,
    )


@pytest.mark.parametrize("weighted", [False, True], ids=["mean", "masked-sum"])
def test_flce_gpu(weighted):
    h = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(32000, 1024, device="cuda", dtype=torch.bfloat16) / 32
    labels = torch.randint(0, 32000, (2048,), device="cuda")
    labels[::7] = -100
    # the megatron output layer's call: reduction "sum" weighted by the loss mask (mean-sized here by 1/N)
    kw = dict(reduction="sum", token_weights=(torch.rand(2048, device="cuda") > 0.2).float() / 2048) if weighted else {}
    _check(
        lambda a, b: lk.fused_linear_cross_entropy(a, b, labels, impl="triton", **kw),
        lambda a, b: ref.linear_cross_entropy_ref(a, b, labels, **kw),
        [h, w],
        atol=2e-2,
        rtol=5e-2,
    )


def test_moe_gpu():
    t = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
    idx = torch.rand(4096, 64, device="cuda").topk(8, dim=-1).indices
    probs = torch.rand(4096, 8, device="cuda").softmax(-1)
    _check(
        lambda a: lk.moe_permute(a, idx, num_experts=64, impl="triton")[0],
        lambda a: lk.moe_permute(a, idx, num_experts=64, impl="torch")[0],
        [t],
        ref_fp32=True,
        **BF16,
    )
    _, row_id, _ = lk.moe_permute(t, idx, num_experts=64)
    p = torch.randn(4096 * 8, 2048, device="cuda", dtype=torch.bfloat16)
    _check(
        lambda a, b: lk.moe_unpermute(a, row_id, b, impl="triton"),
        lambda a, b: ref.moe_unpermute_ref(a, row_id, b),
        [p, probs],
        **BF16,
    )


@pytest.mark.parametrize("heads,causal", [(64, False), (16, True)], ids=["H64-random", "H16-causal"])
def test_sparse_mla_gpu(heads, causal):
    """DeepSeek-V3.2 shape: T 4096, D 512 + 64, topk 2048, bf16, vs the fp32 reference over every query.

    The reference's [T, topk, D] gather would take 19 GB at once, so it runs in query chunks (o and dq rows are
    per query; dkv sums over the chunks). Random indices select 2048 of 4096 keys; causal ones come from
    ``dsa_topk_indices``, so the first 2047 queries carry -1 padding.
    """
    t, d_v, d_rope, topk = 4096, 512, 64, 2048
    gen = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(t, heads, d_v + d_rope, device="cuda", generator=gen).to(torch.bfloat16)
    kv = torch.randn(t, 1, d_v + d_rope, device="cuda", generator=gen).to(torch.bfloat16)
    idx = lk.dsa_topk_indices(torch.randn(t, t, device="cuda", generator=gen), topk, causal=causal)
    do = torch.randn(t, heads, d_v, device="cuda", generator=gen).to(torch.bfloat16)
    qq, kk = q.clone().requires_grad_(True), kv.clone().requires_grad_(True)
    o = lk.sparse_mla_attention(qq, kk, idx, None, d_v, impl="triton")
    o.backward(do)

    kv_ref = kv.float().requires_grad_(True)
    o_ref, dq_ref = torch.empty_like(o, dtype=torch.float32), torch.empty_like(q, dtype=torch.float32)
    for s in range(0, t, 512):
        q_ref = q[s : s + 512].float().requires_grad_(True)
        out = ref.sparse_mla_ref(q_ref, kv_ref, idx[s : s + 512], None, d_v)
        out.backward(do[s : s + 512].float())
        o_ref[s : s + 512], dq_ref[s : s + 512] = out.detach(), q_ref.grad
    for name, got, want in (("o", o, o_ref), ("dq", qq.grad, dq_ref), ("dkv", kk.grad, kv_ref.grad)):
        # bf16 inputs, fp32 truth: max error within 2% of the largest value, and 1% in the L2 norm
        scale = want.abs().max().item()
        torch.testing.assert_close(
            got.float(), want, atol=2e-2 * scale, rtol=2e-2, msg=lambda m, name=name: f"{name}: {m}"
        )
        assert (got.float() - want).norm() <= 1e-2 * want.norm(), name


def _sparse_mla_fwd_bwd(q, kv, idx, do, sm_scale, d_v, impl):
    """o, lse, dq, dkv of one implementation (``ref``: the reference on fp32 copies, the truth)."""
    if impl == "ref":
        qq, kk = q.float().requires_grad_(True), kv.float().requires_grad_(True)
        o, lse = ref.sparse_mla_ref(qq, kk, idx, sm_scale, d_v, return_lse=True)
        o.backward(do.float())
    else:
        qq, kk = q.clone().requires_grad_(True), kv.clone().requires_grad_(True)
        o, lse = lk.sparse_mla_attention(qq, kk, idx, sm_scale, d_v, return_lse=True, impl=impl)
        o.backward(do)
    return o.detach(), lse, qq.grad, kk.grad


# (T, H, G, topk, T_kv, sm_scale, dtype)
TILELANG_SHAPES = [
    (64, 64, 1, 2048, 4096, None, torch.bfloat16),  # DeepSeek-V3.2: 64 heads, 512 + 64, topk 2048
    (33, 16, 1, 100, 300, 0.1, torch.bfloat16),  # topk not a multiple of the kv block
    (17, 10, 2, 70, 90, None, torch.float16),  # 5 heads per group (padded to 16), two groups, fp16
    (8, 128, 1, 256, 512, 0.05, torch.bfloat16),  # two head blocks per group
]


@pytest.mark.parametrize(
    "t,h,g,topk,n_kv,sm_scale,dtype",
    TILELANG_SHAPES,
    ids=["deepseek", "H16-k100", "G2-H10-fp16", "H128"],
)
def test_sparse_mla_tilelang_gpu(t, h, g, topk, n_kv, sm_scale, dtype):
    """The TileLang kernels (fwd + bwd) vs the fp32 reference, and vs the Triton kernels, with masked indices:
    -1 padding, indices == T_kv, a query with none valid, one row selected topk times."""
    from loongforge_kernels.tilelang_sparse_mla import tilelang_unavailable_reason

    reason = tilelang_unavailable_reason("cuda")
    if reason:
        pytest.skip(reason)
    d_v, d_rope = 512, 64
    gen = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(t, h, d_v + d_rope, device="cuda", generator=gen).to(dtype)
    kv = torch.randn(n_kv, g, d_v + d_rope, device="cuda", generator=gen).to(dtype)
    do = torch.randn(t, h, d_v, device="cuda", generator=gen).to(dtype)
    idx = lk.dsa_topk_indices(torch.rand(t, g, n_kv, device="cuda", generator=gen), topk, causal=False)
    idx[1] = -1  # no valid index: o = 0, lse = -inf, no grads
    idx[2, :, ::3] = -1
    idx[3, :, 1::5] = n_kv  # out of range: masked
    idx[4] = idx[4, :, :1]  # one row, topk times

    o, lse, dq, dkv = _sparse_mla_fwd_bwd(q, kv, idx, do, sm_scale, d_v, "tilelang")
    assert o.dtype == dtype and dq.dtype == dtype and dkv.dtype == dtype and lse.dtype == torch.float32
    assert torch.all(o[1] == 0) and torch.all(torch.isneginf(lse[1])) and torch.all(dq[1] == 0)
    o_r, lse_r, dq_r, dkv_r = _sparse_mla_fwd_bwd(q, kv, idx, do, sm_scale, d_v, "ref")
    o_t, lse_t, dq_t, dkv_t = _sparse_mla_fwd_bwd(q, kv, idx, do, sm_scale, d_v, "triton")
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_r))
    finite = torch.isfinite(lse_r)
    torch.testing.assert_close(lse[finite], lse_r[finite], atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(lse[finite], lse_t[finite], atol=1e-3, rtol=1e-3)
    for name, got, want, triton_out in (
        ("o", o, o_r, o_t),
        ("dq", dq, dq_r, dq_t),
        ("dkv", dkv, dkv_r, dkv_t),
    ):
        # half-precision inputs, fp32 truth: max error within 2% of the largest value, 1% in the L2 norm; the
        # two kernels round p and dS alike, so they agree with each other as closely
        for other, label in ((want, "ref"), (triton_out.float(), "triton")):
            scale = other.abs().max().item()
            torch.testing.assert_close(
                got.float(),
                other,
                atol=2e-2 * scale,
                rtol=2e-2,
                msg=lambda m, n=name, lb=label: f"{n} vs {lb}: {m}",
            )
            assert (got.float() - other).norm() <= 1e-2 * other.norm(), (name, label)


@pytest.mark.parametrize("hw_cvt", [True, False], ids=["cvt", "integer-rounding"])
def test_fp8_delta_gpu_bit_identical(hw_cvt, monkeypatch):
    """Delta-FP8 codec at 64M elements (bf16, not a multiple of 256): the Triton payload and reconstruction
    equal the torch reference's bytes. ``cvt`` is the path CUDA runs (the GPU's conversions); the integer
    rounding is the interpreter's path, compiled."""
    from loongforge_kernels import fp8_delta

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 (e4m3) conversions need SM >= 8.9")
    monkeypatch.setattr(fp8_delta, "_launch", lambda device: (fp8_delta.ROWS["cuda"], hw_cvt))
    n = 64 * 2**20 + 77
    gen = torch.Generator("cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    # one optimizer step of drift on weights of mixed magnitude; zero, subnormal and huge blocks
    mag = 10.0 ** torch.randint(-4, 1, (n // 256 + 1, 1), device="cuda", generator=gen).float()
    master = (rand(n // 256 + 1, 256) * mag).view(-1)[:n]
    x, r = master.bfloat16(), (master + 1e-3 * rand(n)).bfloat16()
    r[:256] = x[:256]
    x[256:512], r[256:512] = (rand(256) * 1e-40).bfloat16(), 0  # bf16 subnormals, both signs
    x[512:768], r[512:768] = (rand(256) * 1e30).bfloat16(), (rand(256) * 1e30).bfloat16()
    got = fp8_delta.encode_fp8_delta(x, r, impl="triton")
    want = ref.encode_fp8_delta_ref(x, r)
    assert torch.equal(got, want), f"{(got != want).sum().item()} of {got.numel()} payload bytes differ"

    world, m = 2, n // 2
    gathered = torch.stack(
        [ref.encode_fp8_delta_ref(x[i * m : (i + 1) * m], r[i * m : (i + 1) * m]) for i in (0, 1)]
    )
    recon = r[: world * m].view(world, m).clone()
    out = torch.empty_like(recon)
    want_r = recon.clone()
    fp8_delta.apply_fp8_deltas(recon, gathered, out=out, impl="triton")
    ref.apply_fp8_deltas_ref(want_r, gathered)
    diff = (recon.view(torch.int16) != want_r.view(torch.int16)).sum().item()
    assert diff == 0, f"{diff} of {recon.numel()} reconstructed values differ"
    assert torch.equal(out.view(torch.int16), recon.view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_adamw_gpu_matches_torch_fused(dtype):
    """Our multi-tensor AdamW kernel vs torch's fused AdamW over 5 steps, with a grad scale (the clip)."""
    from loongforge_kernels.adamw import adamw_step_

    gen = torch.Generator("cuda").manual_seed(0)
    shapes = [(2048, 2048), (4097,), (1,), (257, 1152)]
    ps = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=gen).to(dtype)) for s in shapes]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt = torch.optim.AdamW(qs, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01, fused=True)
    m = [torch.zeros_like(p) for p in ps]
    v = [torch.zeros_like(p) for p in ps]
    s = [torch.zeros((), device="cuda") for _ in ps]
    for _ in range(5):
        grads = [torch.randn(p.shape, device="cuda", generator=gen).to(dtype) for p in ps]
        scale = torch.rand((), device="cuda", generator=gen) + 1
        for q, g in zip(qs, grads, strict=True):
            q.grad = g.clone()
        opt.grad_scale = scale
        opt.step()
        torch._foreach_add_(s, 1)
        adamw_step_([p.data for p in ps], grads, m, v, s, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8,
                    weight_decay=0.01, grad_scale=scale, impl="triton")
    for p, q in zip(ps, qs, strict=True):
        if dtype == torch.float32:
            torch.testing.assert_close(p.data, q.data, atol=1e-6, rtol=1e-5)
        else:  # NOTE: one bf16 ulp apart at most, from fp32 rounding differences before the final rounding
            assert ((p.data.float() - q.data.float()).abs() <= q.data.float().abs() * 2**-7 + 1e-6).all()
