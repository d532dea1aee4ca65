"""Encoder hetero-DP's image split: every image on exactly one copy, longest first onto the least loaded one, the
same on every rank."""

from __future__ import annotations

from loongforge_megatron.engine.encoder_split import share_images


def test_images_are_shared_out_once_each_by_cost():
    costs = [16.0, 64.0, 4.0, 4.0, 36.0]
    shares = share_images(costs, 2)
    assert sorted(i for s in shares for i in s) == list(range(len(costs)))
    loads = [sum(costs[i] for i in s) for s in shares]
    assert shares == [[1], [0, 2, 3, 4]] and loads == [64.0, 60.0]
    assert share_images(costs, 2) == shares  # deterministic
    assert share_images([1.0], 3) == [[0], [], []]  # fewer images than copies: the others encode none
    assert share_images([], 2) == [[], []]
