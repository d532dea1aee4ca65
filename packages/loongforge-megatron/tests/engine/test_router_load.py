"""Router-load arithmetic (the counting itself is checked end to end in tests/test_llm_parallel_layouts.py)."""

from __future__ import annotations

import pytest
import torch
from loongforge_megatron.engine.router_load import imbalance


def test_imbalance_over_experts_and_ep_ranks():
    counts = torch.tensor([[0, 0, 0, 0], [10, 10, 10, 10], [40, 0, 0, 0], [30, 10, 20, 20]])
    got = imbalance(counts, ep=2)
    assert got["expert"] == [None, 0.0, 3.0, pytest.approx(0.5)]
    # ep ranks hold experts {0, 1} and {2, 3}
    assert got["ep"] == [None, 0.0, 1.0, 0.0]
    assert got["max_expert"] == 3.0 and got["max_ep"] == 1.0
    single = imbalance(counts, ep=1)
    assert single["ep"] == [None] * 4 and single["max_ep"] is None
