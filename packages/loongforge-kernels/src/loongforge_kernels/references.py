"""Plain-torch references for every kernel: the CPU path, and the ground truth the tests compare against.

Each computes in fp32 and returns the input dtype, like the kernels; autograd gives their gradients.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, zero_centered_gamma: bool = False
):
    """y = x / rms(x) * w (``w + 1`` with megatron's zero-centered gamma), fp32 math, output in x.dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.float() + 1.0 if zero_centered_gamma else weight.float()
    return (y * w).to(x.dtype)


def swiglu_ref(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :F]) * x[..., F:] on megatron's fused fc1 output [..., 2F]."""
    a, b = x.float().chunk(2, dim=-1)
    return (F.silu(a) * b).to(x.dtype)


def _rope_bshd_ref(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    rot = freqs.shape[-1]
    tr, tp = t[..., :rot].float(), t[..., rot:]
    cos, sin = freqs.float().cos(), freqs.float().sin()
    x1, x2 = tr.chunk(2, dim=-1)
    out = tr * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((out.to(t.dtype), tp), dim=-1)


def thd_positions(cu_seqlens: torch.Tensor, n_tokens: int, *, packed_freqs: bool) -> torch.Tensor:
    """Rotary position of each packed token: its index within its sequence, or (packed freqs) in the batch."""
    idx = torch.arange(n_tokens, device=cu_seqlens.device, dtype=torch.int64)
    if packed_freqs:
        return idx
    cu = cu_seqlens.to(torch.int64)
    starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1], output_size=n_tokens)
    return idx - starts


def rope_ref(x: torch.Tensor, freqs: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """megatron's ``_apply_rotary_pos_emb_bshd`` / ``_thd`` (non-interleaved, cp_size 1) in fp32."""
    if cu_seqlens is None:
        return _rope_bshd_ref(x, freqs)
    pos = thd_positions(cu_seqlens, x.shape[0], packed_freqs=freqs.shape[0] == x.shape[0])
    return _rope_bshd_ref(x.unsqueeze(1), freqs[pos]).squeeze(1)


def linear_cross_entropy_ref(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    token_weights: torch.Tensor | None = None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """The eager baseline: full [N, V] logits, fp32 cross-entropy (``token_weights`` / ``vocab_size``: see the
    fused op; rows of ``weight`` past ``vocab_size`` are padding, dropped here)."""
    if vocab_size is not None:
        weight = weight[:vocab_size]
    logits = hidden.reshape(-1, hidden.shape[-1]) @ weight.t()
    labels = labels.reshape(-1)
    if token_weights is None:
        return F.cross_entropy(logits.float(), labels, ignore_index=ignore_index, reduction=reduction)
    per_token = F.cross_entropy(logits.float(), labels, ignore_index=ignore_index, reduction="none")
    wts = token_weights.reshape(-1).float() * (labels != ignore_index)
    total = (per_token * wts).sum()
    if reduction == "sum":
        return total
    denom = wts.sum()
    return total / torch.where(denom != 0, denom, torch.ones_like(denom))


def moe_row_id_map(indices: torch.Tensor) -> torch.Tensor:
    """[T, k] position of each (token, slot) in the expert-sorted order (stable: token order within an expert).

    A slot whose expert index is negative (a token dropped there, e.g. over capacity) gets -1: it has no row;
    the valid rows come first, so the sorted buffer's tail of ``#dropped`` rows belongs to no slot."""
    flat = indices.reshape(-1).long()
    dropped = flat < 0
    key = torch.where(dropped, torch.iinfo(torch.int64).max, flat)
    order = torch.argsort(key, stable=True)
    row_id = torch.empty_like(order)
    row_id[order] = torch.arange(flat.numel(), device=flat.device)
    return row_id.masked_fill(dropped, -1).view(indices.shape).to(torch.int32)


def moe_permute_ref(tokens: torch.Tensor, row_id_map: torch.Tensor) -> torch.Tensor:
    """Copy token t to rows ``row_id_map[t, :]`` of the expert-sorted output [T*k, H] (rows of no slot: zeros)."""
    topk = row_id_map.shape[1]
    flat = row_id_map.reshape(-1).long()
    keep = flat >= 0
    out = tokens.new_zeros(row_id_map.numel(), tokens.shape[1])
    src = torch.arange(row_id_map.numel(), device=tokens.device) // topk
    return out.index_put((flat[keep],), tokens.index_select(0, src[keep]))


def moe_unpermute_ref(
    permuted: torch.Tensor, row_id_map: torch.Tensor, probs: torch.Tensor | None = None
) -> torch.Tensor:
    """out[t] = sum_k probs[t, k] * permuted[row_id_map[t, k]] in fp32 over the slots with a row (row id >= 0),
    output in permuted.dtype."""
    t, k = row_id_map.shape
    flat = row_id_map.reshape(-1).long()
    rows = permuted.index_select(0, flat.clamp(min=0)).view(t, k, -1).float()
    w = (flat >= 0).view(t, k, 1).float()
    if probs is not None:
        w = w * probs.float().unsqueeze(-1)
    return (rows * w).sum(1).to(permuted.dtype)


def sparse_mla_ref(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float | None = None,
    d_v: int = 512,
    *,
    return_lse: bool = False,
):
    """DSA sparse attention in MLA's absorbed form: gather each query's ``topk`` kv rows, masked softmax in fp32.

    q [T, H, D], kv [T_kv, G, D] (value = first ``d_v`` channels), indices [T, G, topk]; an index < 0 or
    >= T_kv is masked. A query with no valid index gets a zero output (and lse -inf) and zero grads. Heads
    ``h`` use kv group ``h // (H // G)``. Returns o [T, H, d_v] in q.dtype (and lse [T, H] fp32, natural log).
    """
    t, h, d = q.shape
    n_kv, g = kv.shape[0], kv.shape[1]
    scale = d**-0.5 if sm_scale is None else sm_scale
    idx = indices.long()
    valid = (idx >= 0) & (idx < n_kv)  # [T, G, K]
    groups = torch.arange(g, device=kv.device).view(1, g, 1)
    rows = kv[torch.where(valid, idx, 0), groups].float()  # [T, G, K, D]
    qf = q.float().view(t, g, h // g, d)
    s = torch.einsum("tghd,tgkd->tghk", qf, rows) * scale
    s = s.masked_fill(~valid.unsqueeze(2), float("-inf"))
    # NOTE: a safe max (0 for an all-masked row) and a guarded divide keep all-masked rows free of NaN in the
    # forward and in autograd's backward; logsumexp / softmax would give NaN there.
    m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, 0.0)
    e = torch.exp(s - m)
    denom = e.sum(-1, keepdim=True)
    p = e / torch.where(denom > 0, denom, 1.0)
    o = torch.einsum("tghk,tgkd->tghd", p, rows[..., :d_v]).reshape(t, h, d_v).to(q.dtype)
    if not return_lse:
        return o
    lse = (m + torch.log(denom)).reshape(t, h).detach()
    return o, lse


FP8_BLOCK = 256  # elements per scale of the delta-FP8 codec


def encode_fp8_delta_ref(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``x - ref`` (fp32) as uint8 ``[float8_e4m3fn bytes (nb*256) | fp32 scales (4*nb)]``, blocks of 256.

    Per block ``scale = max(amax * fl32(1/448), tiny)``, value ``e4m3(d / scale)``; the padding encodes 0.
    NOTE: ``mul_(1 / 448)``, not ``div_(448)``: torch's CUDA ``div_`` by a scalar multiplies by the fp32
    reciprocal and its CPU ``div_`` divides, so only the product is the same on both (and in the kernel)."""
    n = x.numel()
    nb = max(1, -(-n // FP8_BLOCK))
    d = torch.zeros(nb * FP8_BLOCK, dtype=torch.float32, device=x.device)
    d[:n].copy_(x.reshape(-1))
    d[:n].sub_(ref.reshape(-1))
    blocks = d.view(nb, FP8_BLOCK)
    scales = blocks.abs().amax(1).mul_(1 / 448).clamp_min_(torch.finfo(torch.float32).tiny)
    q = (blocks / scales[:, None]).to(torch.float8_e4m3fn)
    return torch.cat((q.view(-1).view(torch.uint8), scales.view(torch.uint8)))


def apply_fp8_deltas_ref(recon: torch.Tensor, gathered: torch.Tensor) -> None:
    """``recon`` (world, n) += the deltas in ``gathered`` (world, payload bytes): fp32 ``q * scale``, then
    ``recon + that`` in fp32 rounded once to ``recon``'s dtype, in place."""
    world, n = recon.shape
    nb = max(1, -(-n // FP8_BLOCK))
    q = gathered[:, : nb * FP8_BLOCK].view(torch.float8_e4m3fn)
    scales = gathered[:, nb * FP8_BLOCK :].view(torch.float32)
    dq = q.float().view(world, nb, FP8_BLOCK).mul_(scales[:, :, None]).view(world, nb * FP8_BLOCK)
    recon.add_(dq[:, :n])


def moe_router_topk_ref(
    logits: torch.Tensor,
    *,
    topk: int,
    score_function: str = "softmax",
    pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    scaling_factor: float | None = None,
    expert_bias: torch.Tensor | None = None,
    indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron-core's top-k routing (``topk_routing_with_score_function``, dense output): probs [T, k] in the
    logits' dtype and expert indices [T, k] (int64), best first. Scores in fp32: softmax (before the top-k with
    ``pre_softmax``, else over the k chosen logits) or sigmoid (selection on scores + ``expert_bias``, the k
    chosen scores renormalised when k > 1). Group-limited routing keeps the ``group_topk`` of ``num_groups``
    expert groups with the largest sum of their top ``topk // group_topk`` selection scores. ``indices`` fixes
    the selection (the backward of the fused kernel differentiates through this with its indices)."""
    x = logits.float()
    n_tok, n_exp = x.shape

    def select(s: torch.Tensor) -> torch.Tensor:
        if indices is not None:
            return indices
        if group_topk:
            g = s.view(n_tok, num_groups, -1).topk(topk // group_topk, dim=-1)[0].sum(-1)
            keep = torch.zeros_like(g).scatter_(1, g.topk(group_topk, dim=-1)[1], 1.0).bool()
            s = s.masked_fill(~keep.repeat_interleave(n_exp // num_groups, dim=1), float("-inf"))
        return s.topk(topk, dim=-1)[1]

    if score_function == "softmax":
        if pre_softmax:
            scores = torch.softmax(x, dim=-1)
            idx = select(scores)
            probs = scores.gather(1, idx)
        else:
            idx = select(x)
            probs = torch.softmax(x.gather(1, idx), dim=-1)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(x)
        idx = select(scores + expert_bias.float() if expert_bias is not None else scores)
        probs = scores.gather(1, idx)
        if topk > 1:
            probs = probs / (probs.sum(-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"score_function {score_function!r}; allowed: softmax, sigmoid")
    if scaling_factor:
        probs = probs * scaling_factor
    return probs.to(logits.dtype), idx
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
FP8_AMAX_EPS = 1e-12  # amax floor (torchao's EPS): an all-zero block gets a finite scale


def fp8_quantize_ref(x: torch.Tensor, granularity: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Current-scaling FP8 quantization of a 2-D ``x``: ``(q, decode_scale)`` with ``x ~ q * decode_scale``.

    Per group (the whole tensor, a row, a 1x128 tile of a row, or a 128x128 block; the last tile / block of a
    ragged dimension is partial): ``scale = fp8_max / max(amax, 1e-12)`` in fp32, ``q = fp8(clamp(x * scale))``
    (round to nearest even), ``decode_scale = 1 / scale``. Scale shapes: ``()``, ``[R, 1]``,
    ``[R, ceil(C / 128)]``, ``[ceil(R / 128), ceil(C / 128)]``. Non-finite input gives non-finite scales.
    """
    fmax = FP8_MAX[dtype]
    xf = x.float()
    rows, cols = xf.shape
    if granularity == "tensor":
        amax = xf.abs().amax()
    elif granularity == "row":
        amax = xf.abs().amax(dim=1, keepdim=True)
    elif granularity in ("block1x128", "block128x128"):
        br = 128 if granularity == "block128x128" else 1
        padded = F.pad(xf.abs(), (0, -cols % 128, 0, -rows % br))
        amax = padded.view(padded.shape[0] // br, br, padded.shape[1] // 128, 128).amax(dim=(1, 3))
    else:
        raise ValueError(f"fp8 granularity {granularity!r}; allowed: tensor, row, block1x128, block128x128")
    # NOTE: torch.div, not ``fmax / t`` (Tensor.__rtruediv__ multiplies by the reciprocal: not IEEE division)
    scale = torch.div(torch.full_like(amax, fmax), amax.clamp(min=FP8_AMAX_EPS))
    full = scale
    if granularity.startswith("block"):
        br = 128 if granularity == "block128x128" else 1
        full = scale.repeat_interleave(br, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    q = (xf * full).clamp(-fmax, fmax).to(dtype)
    return q, scale.reciprocal()
