"""Ring attention (``layers/ring_attention.py``) over gloo equals one process's attention, forward and backward:
one sequence per row and packed samples, over a ring of 3 and over a sub-group of 2 (its ranks are not the
world's), and a joint text-image attention (text keys on every rank merged by log-sum-exp), in one launch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

HEADS, DIM = 2, 8


def _inputs(tokens: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(2, tokens, HEADS, DIM, generator=g, dtype=torch.float64) for _ in range(4))
    return q, k, v, dout


def _reference(q, k, v, dout, bounds: list[int] | None):
    """Attention per sample (``bounds``: the packed samples' token boundaries) and its q / k / v gradients."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    bounds = bounds or [0, q.shape[1]]
    outs = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        qs, ks, vs = (t[:, a:b].transpose(1, 2) for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2))
    out = torch.cat(outs, dim=1)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _ring_ranks(*, rank: int, world: int) -> dict:
    import torch.distributed as dist
    from loongforge_megatron.layers.ring_attention import ring_attention

    dist.init_process_group("gloo")
    pair = dist.new_group([1, 2])
    results = {}
    try:
        for name, group, bounds in (("ring3", dist.group.WORLD, None), ("ring3_packed", dist.group.WORLD,
                                                                          [0, 5, 6, 13, 18]),
                                    ("pair_packed", pair, [0, 3, 10, 12])):
            if rank not in dist.get_process_group_ranks(group):
                continue
            cp, r = group.size(), group.rank()
            q, k, v, dout = _inputs(bounds[-1] if bounds else 6 * cp)
            s = q.shape[1] // cp
            segments = None
            if bounds:
                segments = torch.repeat_interleave(torch.arange(len(bounds) - 1), torch.tensor(bounds).diff())
            mine = [t[:, r * s:(r + 1) * s].clone().requires_grad_() for t in (q, k, v)]
            out = ring_attention(*mine, group=group, segments=segments)
            out.backward(dout[:, r * s:(r + 1) * s])
            want = _reference(q, k, v, dout, bounds)
            results[name] = [(got, ref[:, r * s:(r + 1) * s]) for got, ref in
                             zip((out.detach(), *(t.grad for t in mine)), want, strict=True)]
        results["joint"] = _joint(rank=rank, group=dist.group.WORLD)
    finally:
        dist.destroy_process_group()
    return results


def _joint(*, rank: int, group) -> list:
    """Text tokens every rank holds (queries and keys, two padded) + image tokens split over the ring: the text
    block merged with the ring's by log-sum-exp. Only rank 0 back-propagates the text rows (they are replicas),
    so the text keys' gradients sum over the ranks to the reference's."""
    from loongforge_megatron.layers.ring_attention import attention_lse, merge_attention, ring_attention

    cp, n_txt = group.size(), 4
    q, k, v, dout = _inputs(n_txt + 6 * cp)
    keep = torch.ones(2, n_txt, dtype=torch.bool)
    keep[:, -2:] = False
    s = 6
    rows = [*range(n_txt), *range(n_txt + rank * s, n_txt + (rank + 1) * s)]
    mine = [t[:, rows].clone().requires_grad_() for t in (q, k, v)]
    qm, km, vm = mine
    out = merge_attention(attention_lse(qm, km[:, :n_txt], vm[:, :n_txt], key_mask=keep),
                          ring_attention(qm, km[:, n_txt:], vm[:, n_txt:], group=group, return_lse=True))
    grad = dout[:, rows].clone()
    if rank:
        grad[:, :n_txt] = 0
    out.backward(grad)
    full_keep = torch.cat([keep, torch.ones(2, 6 * cp, dtype=torch.bool)], dim=1)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in ref),
                                          attn_mask=full_keep[:, None, None, :]).transpose(1, 2)
    want.backward(dout)
    mine_rows = slice(n_txt, None) if rank else slice(None)  # NOTE: rank 0 owns the text rows' output and dq
    pairs = [(out.detach()[:, mine_rows], want.detach()[:, rows][:, mine_rows]),
             (qm.grad[:, mine_rows], ref[0].grad[:, rows][:, mine_rows])]
    pairs += [(t.grad[:, n_txt:], r.grad[:, rows][:, n_txt:]) for t, r in zip(mine[1:], ref[1:], strict=True)]
    return pairs, [(t.grad[:, :n_txt], r.grad[:, :n_txt]) for t, r in zip(mine[1:], ref[1:], strict=True)]


def test_ring_attention_equals_one_process_forward_and_backward(tmp_path, ranks):
    got = ranks(_ring_ranks, world=3, out=tmp_path / "ring")
    seen = set()
    for rank_results in got:
        for ours, ref in rank_results["joint"][0]:
            torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-6)
        for name, pairs in rank_results.items():
            if name == "joint":
                continue
            seen.add(name)
            for what, (ours, ref) in zip(("out", "dq", "dk", "dv"), pairs, strict=True):
                torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-6, msg=f"{name} {what}")
    assert seen == {"ring3", "ring3_packed", "pair_packed"}
    # the text keys' gradients: each rank's share, summed
    for i in range(2):
        total = sum(r["joint"][1][i][0] for r in got)
        torch.testing.assert_close(total.double(), got[0]["joint"][1][i][1], rtol=1e-5, atol=1e-6)
