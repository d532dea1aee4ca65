"""The loongforge spec's RoPE (``spec.rope``): the registry's ``rope`` op replaces megatron's unfused rotation and
gives megatron's results (fwd + bwd); where the kernel does not apply, megatron's own path runs.

NOTE: the test bodies that need megatron's model-parallel state run in a rank (``in_world``), never in
pytest's own process."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from loongforge.accelerator.cpu import CpuAccelerator


class SpyAccelerator(CpuAccelerator):
    """The CPU accelerator with a counting ``rope`` override (overrides win in ``select_op``)."""

    def __init__(self):
        super().__init__()
        self.rope_calls = 0

    def kernel_overrides(self):
        from loongforge.kernels import select_op

        torch_rope = select_op("rope", provider="torch", device_type="cpu")

        def rope(*args, **kwargs):
            self.rope_calls += 1
            return torch_rope(*args, **kwargs)

        return {"rope": rope}


def _config(**over):
    from megatron.core.transformer import TransformerConfig

    kw = dict(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        normalization="RMSNorm",
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=True,
        qk_layernorm=True,
    )
    return TransformerConfig(**{**kw, **over})


def _pair(config, acc):
    """(ours from the loongforge spec, megatron's SelfAttention with the same submodules and weights)."""
    from loongforge_megatron.layers import loongforge_layer_spec
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.spec_utils import build_module

    spec = loongforge_layer_spec(qk_layernorm=True, accelerator=acc).submodules.self_attention
    ours = build_module(spec, config=config, layer_number=1)
    base_spec = dataclasses.replace(
        spec, module=SelfAttention, params={"attn_mask_type": spec.params["attn_mask_type"]}
    )
    theirs = build_module(base_spec, config=config, layer_number=1)
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def _fwd_bwd(attn, x, freqs):
    x = x.clone().requires_grad_(True)
    out, _ = attn(x, attention_mask=None, rotary_pos_emb=freqs)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    grads = {n: p.grad.clone() for n, p in attn.named_parameters()}
    return out.detach(), x.grad, grads


def test_spec_uses_kernel_rope_except_mla():
    from loongforge_megatron.layers import loongforge_layer_spec
    from loongforge_megatron.layers.rope import KernelRoPESelfAttention
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    attn = loongforge_layer_spec(provider="torch").submodules.self_attention
    assert attn.module is KernelRoPESelfAttention and attn.params["provider"] == "torch"
    mla = loongforge_layer_spec(multi_latent_attention=True).submodules.self_attention
    assert mla.module is MLASelfAttention


def _spec_rope_matches_megatron(*, rotary_percent):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    config = _config()
    acc = SpyAccelerator()
    ours, theirs = _pair(config, acc)
    freqs = RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=rotary_percent)(
        8
    )  # [s, 1, 1, rot]
    x = torch.randn(8, 2, config.hidden_size)
    got, want = _fwd_bwd(ours, x, freqs), _fwd_bwd(theirs, x, freqs)
    assert acc.rope_calls == 2  # q and k went through the registry's rope op
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], msg=name)


@pytest.mark.parametrize("rotary_percent", [1.0, 0.5], ids=["full", "partial"])
def test_layers_rope_matches_megatron(in_world, tmp_path, rotary_percent):
    in_world(_spec_rope_matches_megatron, out=tmp_path, rotary_percent=rotary_percent)


def _interleaved_rope_falls_back_to_megatron():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    config = _config(rotary_interleaved=True)
    acc = SpyAccelerator()
    ours, theirs = _pair(config, acc)
    freqs = RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=1.0, rotary_interleaved=True)(6)
    x = torch.randn(6, 1, config.hidden_size)
    got, want = _fwd_bwd(ours, x, freqs), _fwd_bwd(theirs, x, freqs)
    assert acc.rope_calls == 0
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


def test_interleaved_rope_falls_back_to_megatron(in_world, tmp_path):
    in_world(_interleaved_rope_falls_back_to_megatron, out=tmp_path)


def _thd_rotation_matches_megatron(*, packed_freqs):
    from megatron.core import parallel_state as mpu
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.packed_seq_params import PackedSeqParams

    config = _config()
    acc = SpyAccelerator()
    ours, _ = _pair(config, acc)
    cu = torch.tensor([0, 3, 7, 12], dtype=torch.int32)
    n = 12 if packed_freqs else 7
    inv = 1.0 / (10000 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    ang = torch.outer(torch.arange(n, dtype=torch.float32), inv)
    freqs = torch.cat((ang, ang), dim=-1)[:, None, None, :]
    packed = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=5, max_seqlen_kv=5
    )
    q_f, _, cu_q, _ = ours._kernel_rope((), {"rotary_pos_emb": freqs, "packed_seq_params": packed})
    x = torch.randn(12, 1, 4, 16, requires_grad=True)
    got = ours._rotate(x, q_f, cu_q)
    (g_got,) = torch.autograd.grad(got.sum() * 1.0 + (got * got).sum(), x)
    want = apply_rotary_pos_emb(
        x.squeeze(1), freqs, config, cu_seqlens=cu, cp_group=mpu.get_context_parallel_group()
    ).unsqueeze(1)
    (g_want,) = torch.autograd.grad(want.sum() * 1.0 + (want * want).sum(), x)
    assert acc.rope_calls == 1
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(g_got, g_want)


@pytest.mark.parametrize("packed_freqs", [False, True])
def test_thd_rotation_matches_megatron(in_world, tmp_path, packed_freqs):
    in_world(_thd_rotation_matches_megatron, out=tmp_path, packed_freqs=packed_freqs)


def _spec_row_linears_pass_their_group(*, num_experts):
    import warnings

    from loongforge_megatron.layers import loongforge_layer_spec, prepare_config
    from loongforge_megatron.layers.megatron_layers import row_parallel_linear
    from megatron.core.tensor_parallel.layers import RowParallelLinear
    from megatron.core.transformer.spec_utils import build_module

    over = dict(num_moe_experts=num_experts, moe_router_topk=2) if num_experts else {}
    config = prepare_config(_config(qk_layernorm=False, gated_linear_unit=True, **over))
    layer = build_module(loongforge_layer_spec(num_experts=num_experts, provider="torch"), config=config,
                         layer_number=1)
    rows = [m for m in layer.modules() if isinstance(m, RowParallelLinear)]
    assert rows and all(type(m) is row_parallel_linear() for m in rows)
    assert len(rows) == 1 + (num_experts or 1)  # linear_proj, then one linear_fc2 per (expert) MLP
    x = torch.randn(8, 2, config.hidden_size, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        out, _ = layer(x, attention_mask=None)
        out.sum().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("num_experts", [None, 2], ids=["dense", "moe"])
def test_spec_row_linears_pass_their_group(in_world, tmp_path, num_experts):
    """megatron 0.19's RowParallelLinear hands tp_group=None to its linear function: a default-group lookup and a
    DeprecationWarning on every forward (a graph break under torch.compile). The spec's row linears do not."""
    in_world(_spec_row_linears_pass_their_group, out=tmp_path, num_experts=num_experts)
