"""Fused linear + cross-entropy: loss of ``hidden @ weight.T`` without the full [N, V] logits.

Tokens are processed in chunks. Per chunk: logits = h_c @ W.T (input dtype), a Triton kernel computes the
row max / sum-exp / target logit, and a second one overwrites the logits in place with
d loss / d logits = (softmax - onehot) * scale. The chunk's grads wrt hidden and weight are then two GEMMs,
so the backward only scales what the forward stored (Liger-Kernel's scheme). ``reduction="none"`` cannot
know the per-token output grads in advance, so it recomputes the chunks in the backward instead (one more
logits GEMM); a caller that reduces with known per-token weights (a loss mask) passes them as
``token_weights`` with ``reduction="sum"`` / ``"mean"`` and keeps the single pass.

Vocab-parallel (tensor parallelism): ``weight`` is this rank's shard [V/tp, H] of rows
``[rank * V/tp, (rank + 1) * V/tp)``; the max, sum-exp and target logit are all-reduced over
``process_group`` per chunk, so every rank gets the full loss.

Padded vocabulary: with ``vocab_size`` below the (global) rows of ``weight``, the rows from ``vocab_size`` on
are padding (a vocabulary rounded up so tensor parallelism divides it): their logits count as -inf, so they
take no probability mass and their weight rows get zero gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from loongforge_kernels._dispatch import jit, next_pow2, resolve, tl
from loongforge_kernels.references import linear_cross_entropy_ref

REDUCTIONS = ("mean", "sum", "none")
LOGITS_CHUNK_BYTES = 2 << 30  # one chunk of logits, in the input dtype


@jit
def _row_max_sumexp(base, n_vocab, BLOCK: tl.constexpr):
    """Online softmax over one row of logits: its max and sum(exp(x - max)), in fp32."""
    m = float("-inf")
    s = 0.0
    for off in range(0, n_vocab, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < n_vocab, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    return m, s


@jit
def _ce_stats_kernel(
    L, LABELS, MAX, SUMEXP, TGT, stride_l, n_vocab, vocab_start, ignore_index, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    base = L + row * stride_l
    m, s = _row_max_sumexp(base, n_vocab, BLOCK)
    label = tl.load(LABELS + row).to(tl.int64)
    local = label - vocab_start
    hit = (label != ignore_index) & (local >= 0) & (local < n_vocab)
    tgt = tl.load(base + local, mask=hit, other=0.0).to(tl.float32)
    tl.store(MAX + row, m)
    tl.store(SUMEXP + row, s)
    tl.store(TGT + row, tgt)


@jit
def _ce_grad_kernel(L, LABELS, LSE, SCALE, stride_l, n_vocab, vocab_start, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = L + row * stride_l
    lse = tl.load(LSE + row)
    scale = tl.load(SCALE + row)
    local = tl.load(LABELS + row).to(tl.int64) - vocab_start
    for off in range(0, n_vocab, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        mask = cols < n_vocab
        x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        g = (tl.exp(x - lse) - tl.where(cols == local, 1.0, 0.0)) * scale
        tl.store(base + cols, g.to(L.dtype.element_ty), mask=mask)


@jit
def _ce_loss_grad_kernel(
    L, LABELS, LOSS, SCALE, stride_l, n_vocab, ignore_index, BLOCK: tl.constexpr
):
    """Single-shard fast path: per row, the loss and, in place, the grad — one program reads its row twice,
    the second time mostly from L2 (a row of a 128k vocab is 256 KB in bf16)."""
    row = tl.program_id(0).to(tl.int64)
    base = L + row * stride_l
    m, s = _row_max_sumexp(base, n_vocab, BLOCK)
    lse = m + tl.log(s)
    label = tl.load(LABELS + row).to(tl.int64)
    valid = label != ignore_index
    hit = valid & (label >= 0) & (label < n_vocab)
    tgt = tl.load(base + label, mask=hit, other=0.0).to(tl.float32)
    tl.store(LOSS + row, tl.where(valid, lse - tgt, 0.0))
    scale = tl.load(SCALE + row)
    for off in range(0, n_vocab, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        mask = cols < n_vocab
        x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        g = (tl.exp(x - lse) - tl.where(cols == label, 1.0, 0.0)) * scale
        tl.store(base + cols, g.to(L.dtype.element_ty), mask=mask)


@jit
def _scale_unless_one_kernel(X, G, n, BLOCK: tl.constexpr):
    """x *= g in place, in fp32, unless g == 1: then a program reads one scalar and stops (no pass over x)."""
    g = tl.load(G).to(tl.float32)
    if g != 1.0:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(X + offs, mask=mask).to(tl.float32)
        tl.store(X + offs, (x * g).to(X.dtype.element_ty), mask=mask)


SCALE_BLOCK = 8192


def _scale_by_upstream(grad: torch.Tensor, g: torch.Tensor, impl: str) -> torch.Tensor:
    """``grad * g`` in place for the stored grads. The upstream grad of a training loss is 1 (``loss.backward()``,
    or megatron without loss scaling), and checking that on the host would sync; the Triton kernel reads ``g`` on
    the device and skips the pass over a [V, H] weight grad when it is 1."""
    if impl == "triton" and grad.is_contiguous() and grad.numel():
        _scale_unless_one_kernel[(-(-grad.numel() // SCALE_BLOCK),)](
            grad, g.reshape(1).float().contiguous(), grad.numel(), BLOCK=SCALE_BLOCK, num_warps=8)
        return grad
    return grad.mul_(g.to(grad.dtype))


def _row_launch(n_vocab: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK, num_warps) of the one-program-per-row kernels: a row is swept in BLOCK-wide pieces."""
    block = min(next_pow2(n_vocab), 32768 if device.type == "cuda" else 65536)
    return block, 32 if block >= 32768 else 8


def _stats(logits, labels, *, vocab_start, ignore_index, impl):
    """Per row: max, sum of exp(x - max), and the target logit (0 when the target is in another shard)."""
    n, v = logits.shape
    if v == 0:  # NOTE: a shard of padding only: no mass (max -inf, sum 0), no target
        mx = torch.full((n,), float("-inf"), dtype=torch.float32, device=logits.device)
        return mx, torch.zeros_like(mx), torch.zeros_like(mx)
    if impl == "triton":
        mx, se, tgt = (torch.empty(n, dtype=torch.float32, device=logits.device) for _ in range(3))
        block, warps = _row_launch(v, logits.device)
        _ce_stats_kernel[(n,)](
            logits,
            labels,
            mx,
            se,
            tgt,
            logits.stride(0),
            v,
            vocab_start,
            ignore_index,
            BLOCK=block,
            num_warps=warps,
        )
        return mx, se, tgt
    x = logits.float()
    mx = x.max(dim=1).values
    se = torch.exp(x - mx[:, None]).sum(dim=1)
    local = labels - vocab_start
    hit = (labels != ignore_index) & (local >= 0) & (local < v)
    tgt = x.gather(1, local.clamp(0, v - 1)[:, None]).squeeze(1) * hit
    return mx, se, tgt


def _grad_in_place(logits, labels, lse, scale, *, vocab_start, impl):
    """logits <- (softmax(logits) - onehot(label)) * scale[row], softmax taken with the global ``lse``."""
    n, v = logits.shape
    if v == 0:
        return
    if impl == "triton":
        block, warps = _row_launch(v, logits.device)
        _ce_grad_kernel[(n,)](
            logits,
            labels,
            lse,
            scale,
            logits.stride(0),
            v,
            vocab_start,
            BLOCK=block,
            num_warps=warps,
        )
        return
    g = torch.exp(logits.float() - lse[:, None])
    local = labels - vocab_start
    hit = (local >= 0) & (local < v)
    rows = torch.nonzero(hit).squeeze(1)
    g[rows, local[rows]] -= 1.0
    logits.copy_(g * scale[:, None])


def _chunk_rows(n_tokens: int, vocab: int, elem_bytes: int) -> int:
    """Tokens per chunk: about N/2 rounded up to 256 (at least 256), the logits chunk within the byte budget.

    NOTE: big chunks pay on GPU: the d(hidden) GEMM has only chunk x H outputs (few tiles per SM for small
    chunks), and each chunk re-reads the [V, H] weight grad. 1024-token chunks ran 0.94x torch.compile on an
    H200, N/2-token ones 0.95-1.0x. Only one chunk of logits is alive at a time (the loop drops the last one
    before the next GEMM), so N/2 peaks near 0.2x eager's memory at vocab 128k.
    """
    budget = max(256, LOGITS_CHUNK_BYTES // (elem_bytes * max(vocab, 1)) // 256 * 256)
    half = -(-n_tokens // 2 // 256) * 256
    return max(1, min(budget, max(256, half), n_tokens))


def _run_chunks(
    hidden,
    weight,
    labels,
    *,
    vocab_size,
    ignore_index,
    group,
    grad_scale,
    want_grad_hidden,
    want_grad_weight,
    chunk,
    impl,
):
    """The chunk loop. Returns per-token loss [N] fp32 and, when ``grad_scale`` [N] is given, the grads."""
    n, _ = hidden.shape
    v_local = weight.shape[0]
    vocab_start = dist.get_rank(group) * v_local if group is not None else 0
    # NOTE: the columns of this shard that are real tokens; the padded ones are left out of the softmax (-inf)
    n_real = v_local if vocab_size is None else min(max(vocab_size - vocab_start, 0), v_local)
    loss = torch.empty(n, dtype=torch.float32, device=hidden.device)
    grad_h = (
        torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
        if grad_scale is not None and want_grad_hidden
        else None
    )
    # NOTE: like Liger, the weight grad accumulates in the weight dtype; each GEMM sums in fp32 inside.
    grad_w = torch.empty_like(weight) if grad_scale is not None and want_grad_weight else None
    w = weight if weight.dtype == hidden.dtype else weight.to(hidden.dtype)
    logits = None
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        h = hidden[start:end]
        lab = labels[start:end]
        del logits  # NOTE: free the previous chunk before allocating the next (one chunk alive at a time)
        logits = h @ w.t()
        real = logits[:, :n_real]  # NOTE: a view with the same row stride, so the kernels read only real columns
        if n_real < v_local and grad_scale is not None:
            logits[:, n_real:] = 0  # d loss / d (padded logit) = softmax = 0
        if impl == "triton" and group is None and grad_scale is not None:
            block, warps = _row_launch(n_real, logits.device)
            _ce_loss_grad_kernel[(end - start,)](
                real,
                lab,
                loss[start:end],
                grad_scale[start:end].float().contiguous(),
                logits.stride(0),
                n_real,
                ignore_index,
                BLOCK=block,
                num_warps=warps,
            )
            _chunk_grads(logits, h, w, grad_h, grad_w, start, end)
            continue
        mx, se, tgt = _stats(real, lab, vocab_start=vocab_start, ignore_index=ignore_index, impl=impl)
        if group is not None:
            m_glob = mx.clone()
            dist.all_reduce(m_glob, op=dist.ReduceOp.MAX, group=group)
            packed = torch.stack((se * torch.exp(mx - m_glob), tgt))
            dist.all_reduce(packed, group=group)
            mx, se, tgt = m_glob, packed[0], packed[1]
        lse = mx + torch.log(se)
        valid = lab != ignore_index
        loss[start:end] = torch.where(valid, lse - tgt, 0.0)
        if grad_scale is None:
            continue
        _grad_in_place(
            real, lab, lse, grad_scale[start:end].float().contiguous(), vocab_start=vocab_start, impl=impl
        )
        _chunk_grads(logits, h, w, grad_h, grad_w, start, end)
    return loss, grad_h, grad_w


def _chunk_grads(dlogits, h, w, grad_h, grad_w, start, end):
    """The chunk's grads from d loss / d logits: d hidden = dL @ W, d weight (+)= dL.T @ h."""
    if grad_h is not None:
        torch.mm(dlogits, w, out=grad_h[start:end])
    if grad_w is not None:
        lt, hc = dlogits.t().to(grad_w.dtype), h.to(grad_w.dtype)
        torch.mm(lt, hc, out=grad_w) if start == 0 else grad_w.addmm_(lt, hc)


def _validate(hidden, weight, labels, reduction, token_weights=None):
    if reduction not in REDUCTIONS:
        raise ValueError(f"fused_linear_cross_entropy: reduction {reduction!r} is not one of {REDUCTIONS}")
    if token_weights is not None:
        if reduction == "none":
            raise ValueError("fused_linear_cross_entropy: token_weights needs reduction 'sum' or 'mean', not 'none' "
                             "(weight the per-token losses yourself)")
        if token_weights.numel() != labels.numel():
            raise ValueError(f"token_weights {tuple(token_weights.shape)} do not match labels {tuple(labels.shape)}")
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} disagree on H")
    if labels.numel() != hidden.numel() // hidden.shape[-1]:
        raise ValueError(f"labels {tuple(labels.shape)} do not match hidden {tuple(hidden.shape)} tokens")


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """Autograd wrapper of the chunk loop (grads stored in forward for mean/sum, recomputed for none)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, reduction, group, reduce_grad_input, chunk, impl,
                token_weights=None, grad_enabled=True, vocab_size=None):
        h2 = hidden.reshape(-1, hidden.shape[-1])
        lab = labels.reshape(-1).contiguous()
        valid = lab != ignore_index
        wts = valid.float()
        if token_weights is not None:
            wts = wts * token_weights.reshape(-1).to(device=wts.device, dtype=torch.float32)
            total_w = wts.sum()
            n_valid = torch.where(total_w != 0, total_w, torch.ones_like(total_w))
        else:
            n_valid = valid.sum().clamp(min=1).float()
        # NOTE: needs_input_grad ignores grad mode (it is True under torch.no_grad too): eval must not pay for grads
        need_h, need_w = grad_enabled and ctx.needs_input_grad[0], grad_enabled and ctx.needs_input_grad[1]
        grad_scale = None
        if reduction != "none" and (need_h or need_w):
            grad_scale = wts / n_valid if reduction == "mean" else wts
        kw = dict(
            vocab_size=vocab_size,
            ignore_index=ignore_index,
            group=group,
            want_grad_hidden=need_h,
            want_grad_weight=need_w,
            chunk=chunk,
            impl=impl,
        )
        loss, grad_h, grad_w = _run_chunks(h2, weight, lab, grad_scale=grad_scale, **kw)
        if grad_h is not None and group is not None and reduce_grad_input:
            dist.all_reduce(grad_h, group=group)
        ctx.reduction = reduction
        ctx.hidden_shape = hidden.shape
        ctx.reduce_grad_input = reduce_grad_input
        ctx.kw = kw
        if reduction == "none":
            ctx.save_for_backward(h2, weight, lab)
            return loss.view(labels.shape)
        ctx.save_for_backward(grad_h, grad_w)
        total = loss.sum() if token_weights is None else (loss * wts).sum()
        return total / n_valid if reduction == "mean" else total

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.reduction == "none":
            h2, weight, lab = ctx.saved_tensors
            scale = grad_out.reshape(-1).float() * (lab != ctx.kw["ignore_index"])
            _, grad_h, grad_w = _run_chunks(h2, weight, lab, grad_scale=scale, **ctx.kw)
            if grad_h is not None and ctx.kw["group"] is not None and ctx.reduce_grad_input:
                dist.all_reduce(grad_h, group=ctx.kw["group"])
        else:
            if getattr(ctx, "consumed", False):
                raise RuntimeError(
                    "fused_linear_cross_entropy: backward through the same graph twice is unsupported"
                )
            ctx.consumed = True  # NOTE: the stored grads are scaled in place to save a [V, H] copy
            grad_h, grad_w = ctx.saved_tensors
            g = grad_out.to(torch.float32)
            impl = ctx.kw["impl"]
            grad_h = _scale_by_upstream(grad_h, g, impl) if grad_h is not None else None
            grad_w = _scale_by_upstream(grad_w, g, impl) if grad_w is not None else None
        grad_h = grad_h.view(ctx.hidden_shape) if grad_h is not None else None
        return grad_h, grad_w, None, None, None, None, None, None, None, None, None, None


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    *,
    process_group: dist.ProcessGroup | None = None,
    reduce_grad_input: bool = True,
    chunk_size: int | None = None,
    impl: str | None = None,
    token_weights: torch.Tensor | None = None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T`` vs ``labels`` without materialising the [N, V] logits.

    ``reduction`` "mean" divides by the number of non-ignored tokens (0 loss when there are none), "sum"
    sums, "none" returns per-token losses (0 at ignored tokens). ``token_weights`` (one per label, "sum" /
    "mean" only; not differentiated) weights each token's loss: "sum" is sum(w * loss), "mean" divides that by
    the weights' sum over non-ignored tokens. With ``process_group`` the weight is the local vocab shard;
    ``reduce_grad_input=False`` leaves the hidden grad partial for a caller whose own communication op
    (megatron's copy-to-TP-region) reduces it. ``chunk_size`` overrides the tokens per chunk. ``vocab_size``
    (the real vocabulary, when the weight's rows are padded past it) keeps the padded rows out of the softmax.
    """
    _validate(hidden, weight, labels, reduction, token_weights)
    which = resolve(impl, hidden)
    n_tokens = hidden.numel() // hidden.shape[-1]
    chunk = chunk_size or _chunk_rows(n_tokens, weight.shape[0], hidden.element_size())
    if token_weights is not None:
        token_weights = token_weights.detach()
    return FusedLinearCrossEntropyFunction.apply(
        hidden, weight, labels, ignore_index, reduction, process_group, reduce_grad_input, chunk, which,
        token_weights, torch.is_grad_enabled(), vocab_size,
    )


__all__ = ["fused_linear_cross_entropy", "linear_cross_entropy_ref", "FusedLinearCrossEntropyFunction"]
