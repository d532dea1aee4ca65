"""Packed sequences on megatron's local attention: the block-diagonal mask equals separate sequences."""

from __future__ import annotations

from typing import Any

import torch
from loongforge_megatron.engine.batch import packed_attention_mask

LENGTHS = (12, 20)  # two documents packed into one sequence of 32


def test_packed_attention_mask_blocks() -> None:
    mask = packed_attention_mask(torch.tensor([0, 2, 5]), batch_size=1, seq_length=6)[0, 0]
    allowed = (~mask).int().tolist()
    assert allowed == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],  # padding after the last document attends to itself only
    ]


def _packed_vs_separate(*, rank: int, world: int) -> dict[str, Any]:
    from loongforge.accelerator.cpu import CpuAccelerator
    from loongforge.parallel.plan import resolve_plan
    from loongforge_megatron import engine
    from loongforge_megatron.device_adapters import adapted
    from loongforge_megatron.engine.step import forward_step
    from megatron.core.packed_seq_params import PackedSeqParams

    from .test_parallel_layouts import transformer_config

    seq = sum(LENGTHS)
    plan = resolve_plan(world_size=1)
    with adapted(CpuAccelerator()):
        engine.initialize(plan, accelerator=CpuAccelerator(), seed=7)
        model = engine.build_model(
            transformer_config=transformer_config(plan, kind="dense"),
            layer_spec=engine.local_layer_spec(),
            vocab_size=128,
            max_sequence_length=seq,
        )[0]
        g = torch.Generator().manual_seed(3)
        tokens = torch.randint(0, 128, (1, seq), generator=g)
        labels = torch.randint(0, 128, (1, seq), generator=g)
        cu = torch.tensor([0, LENGTHS[0], seq], dtype=torch.int32)

        def batch(t, lab, **extra):
            s = t.shape[1]
            return {
                "tokens": t,
                "labels": lab,
                "loss_mask": torch.ones(1, s),
                "position_ids": torch.arange(s)[None],
                **extra,
            }

        with torch.no_grad():
            packed_params = PackedSeqParams(
                qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=20, max_seqlen_kv=20
            )
            packed, _ = forward_step(iter([batch(tokens, labels, packed_seq_params=packed_params)]), model)
            parts = [slice(0, LENGTHS[0]), slice(LENGTHS[0], seq)]
            separate = torch.cat(
                [forward_step(iter([batch(tokens[:, p], labels[:, p])]), model)[0] for p in parts], dim=1
            )
            plain, _ = forward_step(iter([batch(tokens, labels)]), model)
        engine.destroy(process_group=True)
    return {"packed": packed, "separate": separate, "plain": plain}


def test_packed_equals_separate_sequences(ranks, tmp_path) -> None:
    out = ranks(_packed_vs_separate, world=1, out=tmp_path)[0]
    torch.testing.assert_close(out["packed"], out["separate"], rtol=1e-5, atol=1e-5)
    # the second document really is isolated: without the mask its losses differ
    assert not torch.allclose(out["plain"][:, LENGTHS[0] :], out["separate"][:, LENGTHS[0] :], atol=1e-4)
