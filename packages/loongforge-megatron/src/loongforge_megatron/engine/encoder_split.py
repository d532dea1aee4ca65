"""Encoder hetero-DP: the ``hdp`` copies of a vision tower inside one language-model TP group encode *different*
images of the micro-batch, then every rank gets every image's embeddings.

The images are shared out by cost (longest first onto the least loaded copy: deterministic, the same on every
rank), each copy encodes its own, and :class:`GatherRows` all-gathers the embedding rows back into the micro-batch's
image order. Its backward keeps this rank's rows of the gradient: the language model's TP ranks hold the same
gradient of their (replicated) input embeddings, so no reduction is needed there. The towers' parameter gradients
are partial per copy and are summed over the hdp group before the data-parallel reduction
(:func:`sync_encoder_grads`). No image is encoded twice.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

ENCODER_ATTR = "_loongforge_encoder_groups"


def share_images(costs: Sequence[float], parts: int) -> list[list[int]]:
    """Image indices per copy (each list in image order): longest first onto the least loaded copy, ties to the
    lower copy, so every rank computes the same split."""
    loads, out = [0.0] * parts, [[] for _ in range(parts)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        j = min(range(parts), key=lambda j: (loads[j], j))
        loads[j] += costs[i]
        out[j].append(i)
    return [sorted(o) for o in out]


class GatherRows(torch.autograd.Function):
    """Forward: every copy's rows ``[n_r, ...]`` all-gathered over ``group`` and put in image order (``order``:
    for each output row, its position in the rank-major concatenation). Backward: this rank's rows of the
    gradient (the same on every rank of the group)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, counts: list[int], order: torch.Tensor, group: Any) -> torch.Tensor:
        rank, width = dist.get_rank(group), local.shape[1:]
        most = max(counts)
        padded = local.new_zeros(most, *width)
        padded[: local.shape[0]] = local
        gathered = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(gathered, padded.contiguous(), group=group)
        flat = torch.cat([g[:n] for g, n in zip(gathered, counts, strict=True)])
        ctx.rows = (sum(counts[:rank]), counts[rank])
        ctx.order = order
        return flat.index_select(0, order)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start, n = ctx.rows
        flat = torch.empty_like(grad).index_copy_(0, ctx.order, grad)
        return flat[start:start + n], None, None, None


def gather_rows(local: torch.Tensor, *, rows_of: Sequence[int], shares: list[list[int]], group: Any) -> torch.Tensor:
    """Every image's rows from every copy (``rows_of[i]``: image i's rows; ``shares``: :func:`share_images`)."""
    counts = [sum(rows_of[i] for i in share) for share in shares]
    starts, pos = [], 0
    for share in shares:
        for i in share:
            starts.append((i, pos))
            pos += rows_of[i]
    first = dict(starts)
    order = torch.cat([torch.arange(first[i], first[i] + rows_of[i]) for i in range(len(rows_of))]) \
        if len(rows_of) else torch.zeros(0, dtype=torch.long)
    return GatherRows.apply(local, counts, order.to(local.device), group)


class EncoderTimer:
    """Seconds this rank spent in its tower's forward since the last :meth:`take` (the encoder's share of work):
    host wall time on the CPU, device events elsewhere (read at :meth:`take`, so the forward never waits)."""

    def __init__(self) -> None:
        self.seconds, self.images, self.events = 0.0, 0, []

    def take(self) -> tuple[float, int]:
        for start, end in self.events:
            end.synchronize()
            self.seconds += start.elapsed_time(end) / 1000
        out = (self.seconds, self.images)
        self.seconds, self.images, self.events = 0.0, 0, []
        return out


def timed(tower: torch.nn.Module, timer: EncoderTimer | None, images: int, *args: Any) -> Any:
    """``tower(*args)`` with its time added to ``timer``."""
    if timer is None:
        return tower(*args)
    timer.images += images
    if args[0].is_cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = tower(*args)
        end.record()
        timer.events.append((start, end))
        return out
    t0 = time.perf_counter()
    out = tower(*args)
    timer.seconds += time.perf_counter() - t0
    return out


def encoder_times(chunks: Sequence[torch.nn.Module], *, device: torch.device) -> dict[int, tuple[float, int]]:
    """{rank: (tower seconds, images encoded)} since the last call, for every rank that holds a timed tower.
    Collective over the world (ranks without a tower take part)."""
    mine = [m for c in chunks for m in c.modules() if isinstance(getattr(m, "encoder_timer", None), EncoderTimer)]
    seconds, images = 0.0, 0
    for m in mine:
        s, n = m.encoder_timer.take()
        seconds, images = seconds + s, images + n
    t = torch.tensor([seconds, float(images), float(bool(mine))], dtype=torch.float64, device=device)
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return {r: (float(o[0]), int(o[1])) for r, o in enumerate(out) if float(o[2])}


def sync_encoder_grads(chunks: Sequence[torch.nn.Module]) -> None:
    """Sum each hetero-DP tower's parameter gradients over its hdp group (every copy saw different images), before
    the data-parallel reduction. Reads megatron DDP's ``main_grad`` (``grad`` outside DDP).

    NOTE: the data-parallel reduction starts in ``finalize_model_grads``, after this (the job's DDP does not
    overlap it with the backward); both are sums, so the order does not change the result."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    for chunk in chunks:
        for module in chunk.modules():
            groups = getattr(module, ENCODER_ATTR, None)
            if groups is None or groups.hdp == 1:
                continue
            grads = [g for p in module.parameters() if p.requires_grad
                     for g in (getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None else p.grad,)
                     if g is not None]
            if not grads:
                continue
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=groups.hdp_group)
            for g, s in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
                g.copy_(s)


def split_batch(module: torch.nn.Module, groups: Any) -> None:
    """Encoder hetero-DP for a tower that takes a batch of same-sized images ``[b, ...]`` and returns ``[b, ...]``
    (equal cost per image): forward hooks give it this copy's images and gather every copy's outputs. The module
    keeps its parameter names (no wrapper), so name maps and checkpoints are unchanged."""
    from loongforge_megatron.engine.decoupled_encoder import REPLAY_ATTR

    setattr(module, ENCODER_ATTR, groups)
    module.encoder_timer = EncoderTimer()
    state: dict[str, Any] = {}

    def before(mod, args):
        if getattr(mod, REPLAY_ATTR, False):  # NOTE: the decoupled encoder's output, split and gathered already
            return None
        images, *rest = args
        shares = share_images([1.0] * images.shape[0], groups.hdp)
        mine = shares[groups.hdp_rank]
        state.update(shares=shares, count=images.shape[0], t0=time.perf_counter(), images=len(mine))
        if images.is_cuda:
            state["start"] = torch.cuda.Event(enable_timing=True)
            state["start"].record()
        return (images[mine], *rest)

    def after(mod, args, output):
        if getattr(mod, REPLAY_ATTR, False):
            return None
        timer = mod.encoder_timer
        timer.images += state["images"]
        if "start" in state:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            timer.events.append((state.pop("start"), end))
        else:
            timer.seconds += time.perf_counter() - state["t0"]
        return gather_rows(output, rows_of=[1] * state["count"], shares=state["shares"], group=groups.hdp_group)

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after)
