from __future__ import annotations

import pytest
import torch
from loongforge_kernels import apply_rope
from loongforge_kernels.references import rope_ref

from .conftest import assert_close, run_both


def _freqs(max_s: int, rot: int) -> torch.Tensor:
    """What megatron's RotaryEmbedding returns: [s, 1, 1, rot], the angle table repeated over both halves."""
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    ang = torch.outer(torch.arange(max_s, dtype=torch.float32), inv)
    return torch.cat((ang, ang), dim=-1)[:, None, None, :]


# (s, b, h, d, rot_dim): full and partial rotary, odd head counts, one token.
SBHD = [(7, 2, 3, 64, 64), (5, 1, 4, 40, 24), (1, 1, 1, 32, 32), (6, 3, 5, 80, 16)]


@pytest.mark.parametrize("shape", SBHD, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_sbhd_matches_reference(triton_cpu, shape, dtype):
    s, b, h, d, rot = shape
    torch.manual_seed(0)
    x = torch.randn(s, b, h, d).to(dtype)
    freqs = _freqs(s + 3, rot)[:s]
    (y_t, y_r), [(dx_t, dx_r)] = run_both(
        lambda a: apply_rope(a, freqs, impl="triton"), lambda a: rope_ref(a, freqs), [x]
    )
    assert y_t.dtype == dtype
    assert_close(y_t, y_r, dtype, name="y")
    assert_close(dx_t, dx_r, dtype, name="dx")
    assert torch.equal(y_t[..., rot:], x[..., rot:])  # the tail passes through untouched


@pytest.mark.parametrize("packed_freqs", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_thd_matches_reference(triton_cpu, packed_freqs, dtype):
    torch.manual_seed(0)
    cu = torch.tensor([0, 3, 3, 4, 11], dtype=torch.int32)  # with an empty and a 1-token sequence
    x = torch.randn(11, 3, 48).to(dtype)
    freqs = _freqs(11 if packed_freqs else 8, 32)
    (y_t, y_r), [(dx_t, dx_r)] = run_both(
        lambda a: apply_rope(a, freqs, cu_seqlens=cu, impl="triton"),
        lambda a: rope_ref(a, freqs, cu_seqlens=cu),
        [x],
    )
    assert_close(y_t, y_r, dtype, name="y")
    assert_close(dx_t, dx_r, dtype, name="dx")


def test_reference_matches_megatron():
    """Our reference is megatron-core's unfused RoPE (fp32), sbhd and THD."""
    rope_utils = pytest.importorskip("megatron.core.models.common.embeddings.rope_utils")

    class _OneRank:  # a context-parallel group of size 1
        def size(self):
            return 1

        def rank(self):
            return 0

    torch.manual_seed(0)
    x = torch.randn(6, 2, 3, 40)
    freqs = _freqs(6, 24)
    torch.testing.assert_close(rope_ref(x, freqs), rope_utils._apply_rotary_pos_emb_bshd(x, freqs))
    cu = torch.tensor([0, 2, 7], dtype=torch.int32)
    xt = torch.randn(7, 3, 40)
    for f in (_freqs(5, 24), _freqs(7, 24)):
        expected = rope_utils._apply_rotary_pos_emb_thd(xt, cu, f, cp_group=_OneRank())
        torch.testing.assert_close(rope_ref(xt, f, cu_seqlens=cu), expected)


def test_rope_rejects_bad_shapes(triton_cpu):
    with pytest.raises(ValueError, match="rot_dim"):
        apply_rope(torch.randn(2, 1, 1, 8), _freqs(2, 16), impl="triton")
    with pytest.raises(ValueError, match="sbhd"):
        apply_rope(torch.randn(2, 1, 8), _freqs(2, 8), impl="triton")
