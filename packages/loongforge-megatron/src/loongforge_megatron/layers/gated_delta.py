"""The gated delta rule and its short causal convolution, over padded batches or packed samples (``cu_seqlens``).

Two implementations of each op, one contract:

- fla's chunked Triton kernels (``fla.ops.gated_delta_rule.chunk_gated_delta_rule``,
  ``fla.modules.convolution.causal_conv1d``) on CUDA when ``fla-core`` is installed, varlen through their own
  ``cu_seqlens``;
- an exact torch reference everywhere else: the chunked algorithm (UT transform per chunk of 64, a scan over chunks)
  in fp32, run once per packed sample so the recurrent state and the convolution window restart at every boundary.

The recurrence per value head, with ``S`` the ``[dk, dv]`` state (q scaled by ``dk ** -0.5``, q / k L2-normalized)::

    S_t = exp(g_t) * S_{t-1} + k_t^T (beta_t * (v_t - exp(g_t) * k_t S_{t-1}))      o_t = q_t S_t

Shapes follow fla: ``[b, t, heads, dim]``; ``g`` / ``beta`` ``[b, t, v_heads]``. Query / key heads may be fewer
than value heads (each serves ``v_heads / k_heads`` consecutive value heads).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK = 64


@functools.cache
def fla_ops():
    """fla's ``(chunk_gated_delta_rule, causal_conv1d)``, or None when fla is not installed."""
    try:
        from fla.modules.convolution import causal_conv1d
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule, causal_conv1d


def uses_fla(x: Tensor) -> bool:
    """Whether ``x``'s ops run through fla's kernels (CUDA and fla installed)."""
    return x.is_cuda and fla_ops() is not None


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """fla's L2 normalization: ``x / sqrt(sum(x^2) + eps)`` over the last dim."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _bounds(cu_seqlens: Tensor | Sequence[int] | None, total: int) -> list[int]:
    if cu_seqlens is None:
        return [0, total]
    return [int(b) for b in (cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else cu_seqlens)]


def causal_conv1d(x: Tensor, weight: Tensor, *, cu_seqlens: Tensor | None = None,
                  bounds: Sequence[int] | None = None) -> Tensor:
    """Depthwise causal convolution + SiLU of ``x [b, t, d]`` with ``weight [d, width]``; with ``cu_seqlens``
    (``b`` must be 1) no window reaches across a sample boundary."""
    if uses_fla(x):
        y, _ = fla_ops()[1](x=x, weight=weight, bias=None, activation="silu", cu_seqlens=cu_seqlens)
        return y
    b = _bounds(bounds if bounds is not None else cu_seqlens, x.shape[1])
    width = weight.shape[-1]
    outs = []
    for lo, hi in zip(b, b[1:], strict=False):
        if hi == lo:
            continue
        seg = x[:, lo:hi].transpose(1, 2).to(weight.dtype)
        y = F.conv1d(seg, weight.unsqueeze(1), padding=width - 1, groups=seg.shape[1])[..., : hi - lo]
        outs.append(F.silu(y).transpose(1, 2).to(x.dtype))
    return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]


def _chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    """The chunked gated delta rule of one sequence batch, zero initial state; fp32 ``[b, h, t, d]`` inputs
    (q / k already L2-normalized and repeated to the value heads)."""
    b, h, t, dk = k.shape
    dv = v.shape[-1]
    q = q * dk ** -0.5
    pad = (CHUNK - t % CHUNK) % CHUNK
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    n = (t + pad) // CHUNK
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(b, h, n, CHUNK, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    g = g.reshape(b, h, n, CHUNK).cumsum(-1)
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    decay = (g.unsqueeze(-1) - g.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay
    attn = (q @ k.transpose(-1, -2)) * decay
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_decay = torch.linalg.solve_triangular(system, k_beta * g.exp().unsqueeze(-1), upper=False, unitriangular=True)
    q = q * g.exp().unsqueeze(-1)
    k = k * (g[..., -1:] - g).exp().unsqueeze(-1)
    chunk_decay = g[..., -1].exp()[..., None, None]
    state = q.new_zeros(b, h, dk, dv)
    out = []
    for i in range(n):
        v_new = values[:, :, i] - k_decay[:, :, i] @ state
        out.append(q[:, :, i] @ state + attn[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    return torch.stack(out, dim=2).reshape(b, h, -1, dv)[:, :, :t]


def gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, *, g: Tensor, beta: Tensor, cu_seqlens: Tensor | None = None,
                     bounds: Sequence[int] | None = None) -> Tensor:
    """``o [b, t, v_heads, dv]`` of the gated delta rule (q / k L2-normalized here), the state reset at every
    ``cu_seqlens`` boundary (``b`` 1 then). ``bounds``: the same boundaries as host ints, when the caller has them."""
    hk, hv = k.shape[2], v.shape[2]
    if hv != hk:
        q, k = (x.repeat_interleave(hv // hk, dim=2) for x in (q, k))
    if uses_fla(q):
        o, _ = fla_ops()[0](q, k, v, g=g, beta=beta, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True)
        return o
    dtype = q.dtype
    q, k = l2norm(q.float()), l2norm(k.float())
    q, k, v, g, beta = (x.transpose(1, 2).float() for x in (q, k, v, g, beta))
    b = _bounds(bounds if bounds is not None else cu_seqlens, q.shape[2])
    outs = [_chunked(q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], g[:, :, lo:hi], beta[:, :, lo:hi])
            for lo, hi in zip(b, b[1:], strict=False) if hi > lo]
    out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    return out.transpose(1, 2).to(dtype)
