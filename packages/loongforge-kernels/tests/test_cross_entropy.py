from __future__ import annotations

import pytest
import torch
from loongforge_kernels import fused_linear_cross_entropy
from loongforge_kernels.references import linear_cross_entropy_ref

from .conftest import assert_close, run_both

# Tolerances for the loss and grads: the chunked kernel sums the same terms in another order; bf16 logits and
# grads are rounded like the eager bf16 GEMMs'.
CE_SCALE = {torch.float32: 10.0, torch.bfloat16: 1.0}


def _problem(n: int, hidden: int, vocab: int, dtype: torch.dtype, *, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=gen).to(dtype)
    w = (torch.randn(vocab, hidden, generator=gen) / hidden**0.5).to(dtype)
    labels = torch.randint(0, vocab, (n,), generator=gen)
    labels[::5] = -100  # some ignored tokens
    return h, w, labels


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("n,hidden,vocab", [(1, 32, 1000), (37, 48, 1000), (20, 33, 4001)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flce_matches_reference(request, impl, reduction, n, hidden, vocab, dtype):
    if impl == "triton":
        request.getfixturevalue("triton_cpu")
    h, w, labels = _problem(n, hidden, vocab, dtype)
    if n == 1:
        labels[:] = 7
    (loss_t, loss_r), [(dh_t, dh_r), (dw_t, dw_r)] = run_both(
        lambda a, b: fused_linear_cross_entropy(a, b, labels, reduction=reduction, chunk_size=16, impl=impl),
        lambda a, b: linear_cross_entropy_ref(a, b, labels, reduction=reduction),
        [h, w],
    )
    s = CE_SCALE[dtype]
    assert_close(loss_t, loss_r, torch.float32 if dtype == torch.float32 else dtype, scale=s, name="loss")
    assert dh_t.dtype == dtype and dw_t.dtype == dtype
    assert_close(dh_t, dh_r, dtype, scale=s, name="dhidden")
    assert_close(dw_t, dw_r, dtype, scale=s, name="dweight")


def test_flce_all_ignored_and_frozen_weight(triton_cpu):
    h, w, labels = _problem(8, 16, 100, torch.float32)
    h.requires_grad_(True)
    loss = fused_linear_cross_entropy(h, w, torch.full_like(labels, -100), impl="triton")
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(h.grad) == 0 and w.grad is None


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_flce_padded_rows_take_no_mass(request, impl, reduction):
    """``vocab_size`` below the weight's rows: the loss of the real rows alone, zero grad for the padded rows
    (whatever they hold), as if they were not there."""
    if impl == "triton":
        request.getfixturevalue("triton_cpu")
    h, w, labels = _problem(21, 16, 97, torch.float32)
    padded = torch.cat([w, 5.0 * torch.ones(3, 16)])  # large padded logits would dominate an unmasked softmax
    (loss_t, loss_r), [(dh_t, dh_r), (dw_t, dw_r)] = run_both(
        lambda a, b: fused_linear_cross_entropy(a, b, labels, reduction=reduction, chunk_size=8, impl=impl,
                                                vocab_size=97),
        lambda a, b: linear_cross_entropy_ref(a, b, labels, reduction=reduction, vocab_size=97),
        [h, padded],
    )
    assert_close(loss_t, loss_r, torch.float32, scale=CE_SCALE[torch.float32], name="loss")
    assert_close(dh_t, dh_r, torch.float32, scale=CE_SCALE[torch.float32], name="dhidden")
    assert_close(dw_t, dw_r, torch.float32, scale=CE_SCALE[torch.float32], name="dweight")
    assert torch.count_nonzero(dw_t[97:]) == 0


def test_flce_3d_input_and_bad_args(triton_cpu):
    h, w, labels = _problem(12, 16, 50, torch.float32)
    loss = fused_linear_cross_entropy(h.view(3, 4, 16), w, labels.view(3, 4), impl="triton")
    assert_close(loss, linear_cross_entropy_ref(h, w, labels), torch.float32)
    with pytest.raises(ValueError, match="reduction"):
        fused_linear_cross_entropy(h, w, labels, reduction="avg")


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flce_token_weights_match_reference(request, impl, reduction, dtype):
    """Per-token weights (a loss mask, or fractional weights with zeros) in the single-pass sum / mean."""
    if impl == "triton":
        request.getfixturevalue("triton_cpu")
    h, w, labels = _problem(37, 33, 1001, dtype)
    weights = torch.rand(37, generator=torch.Generator().manual_seed(5))
    weights[::3] = 0.0
    (loss_t, loss_r), [(dh_t, dh_r), (dw_t, dw_r)] = run_both(
        lambda a, b: fused_linear_cross_entropy(a, b, labels, reduction=reduction, chunk_size=16, impl=impl,
                                                token_weights=weights),
        lambda a, b: linear_cross_entropy_ref(a, b, labels, reduction=reduction, token_weights=weights),
        [h, w],
    )
    s = CE_SCALE[dtype]
    assert_close(loss_t, loss_r, torch.float32 if dtype == torch.float32 else dtype, scale=s, name="loss")
    assert_close(dh_t, dh_r, dtype, scale=s, name="dhidden")
    assert_close(dw_t, dw_r, dtype, scale=s, name="dweight")
    # the masked sum equals weighting the per-token losses of reduction="none"
    per_token = fused_linear_cross_entropy(h.float(), w.float(), labels, reduction="none", impl=impl)
    if reduction == "sum":
        assert_close(loss_t.float(), (per_token * weights).sum(), dtype, scale=s, name="sum vs none")


@pytest.mark.parametrize("upstream", [1.0, 0.5, 0.0])
def test_flce_upstream_grad_scales_the_stored_grads(triton_cpu, upstream):
    """The stored grads are scaled by the upstream grad on the device; 1 (``loss.backward()``) skips the pass."""
    h, w, labels = _problem(37, 33, 1001, torch.float32)
    grads = []
    for impl in ("triton", "torch"):
        a, b = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        fused_linear_cross_entropy(a, b, labels, chunk_size=16, impl=impl).backward(torch.tensor(upstream))
        grads.append((a.grad, b.grad))
    a, b = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    linear_cross_entropy_ref(a, b, labels).backward(torch.tensor(upstream))
    for got in grads:
        assert_close(got[0], a.grad, torch.float32, scale=10.0, name="dhidden")
        assert_close(got[1], b.grad, torch.float32, scale=10.0, name="dweight")


def test_flce_token_weights_all_zero_and_bad_args(triton_cpu):
    h, w, labels = _problem(8, 16, 100, torch.float32)
    h.requires_grad_(True)
    loss = fused_linear_cross_entropy(h, w, labels, impl="triton", token_weights=torch.zeros(8))
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(h.grad) == 0
    with pytest.raises(ValueError, match="token_weights needs reduction"):
        fused_linear_cross_entropy(h, w, labels, reduction="none", token_weights=torch.ones(8))
    with pytest.raises(ValueError, match="token_weights .* do not match"):
        fused_linear_cross_entropy(h, w, labels, token_weights=torch.ones(7))


def test_flce_no_grad_skips_the_grads(monkeypatch):
    """Under torch.no_grad (eval) the sum / mean path must not compute the grads it would store for backward."""
    import loongforge_kernels.cross_entropy as ce

    calls = []
    real = ce._chunk_grads
    monkeypatch.setattr(ce, "_chunk_grads", lambda *a, **k: calls.append(1) or real(*a, **k))
    h, w, labels = _problem(40, 16, 100, torch.float32)
    h.requires_grad_(True)
    with torch.no_grad():
        loss = fused_linear_cross_entropy(h, w, labels, reduction="sum", chunk_size=16, impl="torch")
    assert not calls
    assert_close(loss, linear_cross_entropy_ref(h, w, labels, reduction="sum"), torch.float32)
    fused_linear_cross_entropy(h, w, labels, reduction="sum", chunk_size=16, impl="torch").backward()
    assert len(calls) == 3  # one per chunk when grads are wanted


# ---- vocab-parallel over 2 gloo processes -------------------------------------------------------------


def _flce_vocab_parallel(*, rank: int, world: int, configs: list[tuple[str, str]]) -> None:
    """A rank: vocab-sharded fused linear CE vs the full-vocab eager reference, per (impl, reduction) in
    ``configs``; a reduction ``"sum+weights"`` / ``"mean+weights"`` also passes per-token weights (megatron's
    loss mask), ``"mean+vocabN"`` a real vocabulary of N rows (the rest padding)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        for impl, reduction in configs:
            _flce_vocab_parallel_check(rank, world, impl, reduction)
    finally:
        dist.destroy_process_group()


def _flce_vocab_parallel_check(rank: int, world: int, impl: str, reduction: str) -> None:
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(3)
    n, hidden, vocab = 19, 24, 2 * 301
    h = torch.randn(n, hidden, generator=gen)
    w = torch.randn(vocab, hidden, generator=gen) / hidden**0.5
    labels = torch.randint(0, vocab, (n,), generator=gen)
    labels[::5] = -100
    reduction, _, extra = reduction.partition("+")
    kw = {"token_weights": (torch.arange(n) % 3 != 1).float() * 0.7} if extra == "weights" else {}
    if extra.startswith("vocab"):  # the rows from vocab_size on are padding (maybe a whole shard of it)
        kw = {"vocab_size": int(extra.removeprefix("vocab"))}
        labels = torch.where(labels >= kw["vocab_size"], labels % kw["vocab_size"], labels)
    h_t, w_t = h.clone().requires_grad_(True), w.chunk(world)[rank].clone().requires_grad_(True)
    h_r, w_r = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    loss_t = fused_linear_cross_entropy(
        h_t, w_t, labels, reduction=reduction, process_group=dist.group.WORLD, chunk_size=8, impl=impl, **kw
    )
    loss_r = linear_cross_entropy_ref(h_r, w_r, labels, reduction=reduction, **kw)
    g = torch.randn(loss_r.shape, generator=torch.Generator().manual_seed(1))
    loss_t.backward(g)
    loss_r.backward(g)
    tol = dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(
        loss_t, loss_r, **tol, msg=lambda m: f"{impl}/{reduction} loss, rank {rank}: {m}"
    )
    torch.testing.assert_close(
        h_t.grad, h_r.grad, **tol, msg=lambda m: f"{impl}/{reduction} hidden grad, rank {rank}: {m}"
    )
    torch.testing.assert_close(
        w_t.grad,
        w_r.grad.chunk(world)[rank],
        **tol,
        msg=lambda m: f"{impl}/{reduction} weight grad, rank {rank}: {m}",
    )


@pytest.mark.slow
def test_flce_vocab_parallel_gloo(ranks, tmp_path):
    """Each rank holds half the vocab; loss and grads must equal the single-process full-vocab result."""
    ranks(_flce_vocab_parallel, world=2, out=tmp_path, timeout_s=120,
          configs=[("torch", "none"), ("torch", "mean"), ("torch", "sum+weights"), ("torch", "mean+vocab599"),
                   ("torch", "none+vocab250")])


@pytest.mark.slow
def test_flce_vocab_parallel_gloo_triton(triton_cpu, ranks, tmp_path):
    """The same with the Triton kernels (the ranks see this process's TRITON_INTERPRET)."""
    ranks(_flce_vocab_parallel, world=2, out=tmp_path, timeout_s=120,
          configs=[("triton", "mean"), ("triton", "none"), ("triton", "sum+weights"), ("triton", "mean+vocab599"),
                   ("triton", "none+vocab250")])
