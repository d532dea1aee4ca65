"""Fused MoE top-k routing: Triton kernel -> autograd Function -> ``moe_router_topk``.

One program per token: the score function (softmax / sigmoid), the expert bias of aux-loss-free balancing,
DeepSeek's group-limited selection, the top-k, the renormalisation and the scaling factor, in registers,
reading the logits row once (megatron's torch path launches ~15 kernels for this). The backward differentiates
the plain-torch reference at the chosen indices (a few elementwise ops on [T, k] and one scatter).
Semantics are megatron-core's ``topk_routing_with_score_function`` (see ``references.moe_router_topk_ref``).
"""

from __future__ import annotations

import torch

from loongforge_kernels._dispatch import jit, next_pow2, resolve, tl
from loongforge_kernels.references import moe_router_topk_ref

_SOFTMAX, _SIGMOID = 0, 1


@jit
def _router_kernel(
    LOGITS,
    BIAS,
    PROBS,
    IDX,
    stride,
    n_exp,
    group_size,
    scaling,
    TOPK: tl.constexpr,
    SCORE: tl.constexpr,
    PRE_SOFTMAX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    N_GROUPS: tl.constexpr,
    GROUP_TOPK: tl.constexpr,
    PER_GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_G)[:, None]
    j = tl.arange(0, BLOCK_E)[None, :]
    eidx = g * group_size + j  # [BLOCK_G, BLOCK_E] expert index tile (one row per group)
    valid = (g < N_GROUPS) & (j < group_size)
    x = tl.load(LOGITS + t * stride + eidx, mask=valid, other=float("-inf")).to(tl.float32)
    big = n_exp + BLOCK_G * BLOCK_E
    if SCORE == 0:
        m = tl.max(tl.max(x, 1), 0)
        e = tl.where(valid, tl.exp(x - m), 0.0)
        soft = e / tl.sum(tl.sum(e, 1), 0)
        if PRE_SOFTMAX:
            scores = soft
        else:
            scores = x
        sel = tl.where(valid, scores, float("-inf"))
    else:
        scores = 1.0 / (1.0 + tl.exp(-x))
        sel = scores
        if HAS_BIAS:
            sel = sel + tl.load(BIAS + eidx, mask=valid, other=0.0).to(tl.float32)
        sel = tl.where(valid, sel, float("-inf"))
    if GROUP_TOPK > 0:
        # group score: sum of the group's top PER_GROUP selection scores
        work = sel
        gsum = tl.zeros([BLOCK_G], dtype=tl.float32)
        for _ in tl.static_range(PER_GROUP):
            gm = tl.max(work, 1)
            gsum += gm
            first = tl.min(tl.where(work == gm[:, None], j, BLOCK_E), 1)
            work = tl.where(j == first[:, None], float("-inf"), work)
        gsum = tl.where(tl.arange(0, BLOCK_G) < N_GROUPS, gsum, float("-inf"))
        keep = tl.zeros([BLOCK_G], dtype=tl.int32)
        for _ in tl.static_range(GROUP_TOPK):
            best = tl.max(gsum, 0)
            gi = tl.min(tl.where(gsum == best, tl.arange(0, BLOCK_G), BLOCK_G), 0)
            keep = tl.where(tl.arange(0, BLOCK_G) == gi, 1, keep)
            gsum = tl.where(tl.arange(0, BLOCK_G) == gi, float("-inf"), gsum)
        sel = tl.where(keep[:, None] > 0, sel, float("-inf"))
    # top-k, best first; ties go to the lower expert index. The chosen scores (softmax after the top-k: logits)
    # stay in registers.
    ks = tl.arange(0, BLOCK_K)
    vals = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    for k in tl.static_range(TOPK):
        best = tl.max(tl.max(sel, 1), 0)
        i = tl.min(tl.min(tl.where(sel == best, eidx, big), 1), 0)
        hit = eidx == i
        val = tl.sum(tl.sum(tl.where(hit, scores, 0.0), 1), 0)
        vals = tl.where(ks == k, val, vals)
        ids = tl.where(ks == k, i.to(tl.int64), ids)
        sel = tl.where(hit, float("-inf"), sel)
    kmask = ks < TOPK
    if SCORE == 0:
        if not PRE_SOFTMAX:
            top = tl.max(tl.where(kmask, vals, float("-inf")), 0)
            ev = tl.where(kmask, tl.exp(vals - top), 0.0)
            vals = ev / tl.sum(ev, 0)
    else:
        if TOPK > 1:
            vals = vals / (tl.sum(tl.where(kmask, vals, 0.0), 0) + 1e-20)
    tl.store(PROBS + t * TOPK + ks, vals * scaling, mask=kmask)
    tl.store(IDX + t * TOPK + ks, ids, mask=kmask)


class MoERouterTopKFunction(torch.autograd.Function):
    """Fused forward; backward through the reference at the saved indices."""

    @staticmethod
    def forward(ctx, logits, expert_bias, topk, score_function, pre_softmax, num_groups, group_topk, scaling):
        x = logits if logits.stride(-1) == 1 else logits.contiguous()
        n_tok, n_exp = x.shape
        groups = num_groups if group_topk else 1
        if n_exp % groups:
            raise ValueError(f"moe_router_topk: {n_exp} experts do not split into {groups} groups")
        group_size = n_exp // groups
        probs = torch.empty(n_tok, topk, dtype=torch.float32, device=x.device)
        idx = torch.empty(n_tok, topk, dtype=torch.int64, device=x.device)
        if n_tok:
            _router_kernel[(n_tok,)](
                x, expert_bias if expert_bias is not None else x, probs, idx, x.stride(0), n_exp, group_size,
                float(scaling or 1.0), TOPK=topk, SCORE=_SOFTMAX if score_function == "softmax" else _SIGMOID,
                PRE_SOFTMAX=bool(pre_softmax), HAS_BIAS=expert_bias is not None, N_GROUPS=groups,
                GROUP_TOPK=group_topk or 0, PER_GROUP=topk // group_topk if group_topk else 1,
                BLOCK_G=next_pow2(groups), BLOCK_E=next_pow2(group_size), BLOCK_K=next_pow2(topk),
                num_warps=4 if n_exp <= 256 else 8,
            )
        ctx.save_for_backward(logits, idx)
        ctx.cfg = dict(topk=topk, score_function=score_function, pre_softmax=pre_softmax, scaling_factor=scaling)
        ctx.mark_non_differentiable(idx)
        return probs.to(logits.dtype), idx

    @staticmethod
    def backward(ctx, dprobs, _didx):
        logits, idx = ctx.saved_tensors
        with torch.enable_grad():
            x = logits.detach().requires_grad_()
            probs, _ = moe_router_topk_ref(x, indices=idx, **ctx.cfg)
            (dx,) = torch.autograd.grad(probs, x, dprobs)
        return dx, None, None, None, None, None, None, None


def moe_router_topk(
    logits: torch.Tensor,
    *,
    topk: int,
    score_function: str = "softmax",
    pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    scaling_factor: float | None = None,
    expert_bias: torch.Tensor | None = None,
    impl: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of ``logits`` [T, E]: ``(probs [T, k] in logits' dtype, indices [T, k] int64)``, best first
    (megatron-core's semantics; see ``references.moe_router_topk_ref``)."""
    if logits.dim() != 2:
        raise ValueError(f"moe_router_topk: logits must be [tokens, experts], got {tuple(logits.shape)}")
    n_exp = logits.shape[1]
    if not 1 <= topk <= n_exp:
        raise ValueError(f"moe_router_topk: topk {topk} must be in [1, {n_exp}]")
    if score_function not in ("softmax", "sigmoid"):
        raise ValueError(f"moe_router_topk: score_function {score_function!r}; allowed: softmax, sigmoid")
    if group_topk and (not num_groups or n_exp % num_groups or topk % group_topk or group_topk > num_groups):
        raise ValueError(f"moe_router_topk: group_topk {group_topk} / num_groups {num_groups} do not fit {n_exp} "
                         f"experts and topk {topk}")
    if expert_bias is not None and score_function != "sigmoid":
        raise ValueError("moe_router_topk: expert_bias applies to sigmoid scores")
    kw = dict(topk=topk, score_function=score_function, pre_softmax=pre_softmax, num_groups=num_groups,
              group_topk=group_topk, scaling_factor=scaling_factor, expert_bias=expert_bias)
    if resolve(impl, logits) == "triton":
        bias = expert_bias.float().contiguous() if expert_bias is not None else None
        return MoERouterTopKFunction.apply(logits, bias, topk, score_function, pre_softmax, num_groups, group_topk,
                                           scaling_factor)
    return moe_router_topk_ref(logits, **kw)
