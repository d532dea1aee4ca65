"""GPU: packed sequences run on ``torch.nn.attention.varlen.varlen_attn`` (flash varlen) in bf16, equal the
unpacked samples' loss, and take no mask path; a tokens/s figure of packed vs padded batches is printed.

Tolerances (bf16 activations, fp32 reference of the same kernels' inputs): attention outputs within 2e-2 absolute
of the fp32 per-sample reference; the packed mean loss within 1e-2 relative of the unpacked one (per-token losses
within 5e-2 absolute)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest
import torch

LENGTHS = (100, 300, 37, 587, 64, 960)  # 2048 tokens, one THD micro-batch
VOCAB = 512


def _cuda_run(*, rank: int, world: int) -> dict[str, Any]:
    import torch.nn.attention.varlen as varlen_mod
    from loongforge.accelerator.cuda import CudaAccelerator
    from loongforge.parallel.plan import resolve_plan
    from loongforge_megatron import engine
    from loongforge_megatron.device_adapters import adapted
    from loongforge_megatron.engine import step as step_mod
    from loongforge_megatron.engine.model import build_chunks
    from loongforge_megatron.engine.packing import packed_seq_params
    from loongforge_megatron.engine.weights import seeded_init
    from loongforge_megatron.layers import loongforge_layer_spec, prepare_config
    from loongforge_megatron.layers.varlen import segment_attention, varlen_attention

    from .test_parallel_layouts import transformer_config

    out: dict[str, Any] = {}
    calls = {"varlen": 0, "sdpa": 0, "mask": 0}
    real_varlen, real_sdpa, real_mask = (varlen_mod.varlen_attn, torch.nn.functional.scaled_dot_product_attention,
                                         step_mod.packed_attention_mask)

    def count(name, fn):
        def spy(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return spy

    varlen_mod.varlen_attn = count("varlen", real_varlen)
    torch.nn.functional.scaled_dot_product_attention = count("sdpa", real_sdpa)
    step_mod.packed_attention_mask = count("mask", real_mask)

    # ---- the attention op alone: flash varlen (bf16) vs the exact per-segment fallback (fp32), GQA
    g = torch.Generator(device="cuda").manual_seed(0)
    bounds = [0, 5, 133, 140, 400]
    q, k, v = (torch.randn(400, h, 64, device="cuda", generator=g) for h in (8, 2, 2))
    cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    errs = []
    for causal in (True, False):
        ref = segment_attention(q, k, v, bounds_q=bounds, bounds_k=bounds, causal=causal)
        got = varlen_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), cu_seqlens_q=cu, cu_seqlens_k=cu,
                               max_seqlen_q=260, max_seqlen_k=260, causal=causal)
        errs.append(float((got.float() - ref).abs().max()))
    # a query chunk shorter than its keys (context parallelism): aligned to the end of the keys
    cu_q, cu_k = (torch.tensor(b, dtype=torch.int32, device="cuda") for b in ([0, 32], [0, 128]))
    ref = segment_attention(q[96:128], k[:128], v[:128], bounds_q=[0, 32], bounds_k=[0, 128], causal=True)
    got = varlen_attention(q[96:128].bfloat16(), k[:128].bfloat16(), v[:128].bfloat16(), cu_seqlens_q=cu_q,
                           cu_seqlens_k=cu_k, max_seqlen_q=32, max_seqlen_k=128, causal=True)
    errs.append(float((got.float() - ref).abs().max()))
    out["attention_max_err"] = errs

    acc = CudaAccelerator()
    with adapted(acc):
        plan = resolve_plan(world_size=1)
        engine.initialize(plan, accelerator=acc, seed=7)
        total = sum(LENGTHS)
        config = prepare_config(transformer_config(plan, kind="bf16"))
        # NOTE: the plain-torch kernel provider: no Triton JIT on the clock; attention is what is measured here
        spec = loongforge_layer_spec(provider="torch", accelerator=acc)
        model = build_chunks(transformer_config=config, layer_spec=spec,
                             vocab_size=VOCAB, max_sequence_length=total, device="cuda")[0]
        seeded_init([model], config=config, seed=5)
        gen = torch.Generator().manual_seed(3)
        tokens = torch.randint(0, VOCAB, (total,), generator=gen)
        labels = torch.randint(0, VOCAB, (total,), generator=gen)
        cum = torch.tensor((0, *LENGTHS)).cumsum(0).tolist()

        def forward(batch):
            batch = step_mod.model_inputs(batch, model)
            return model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"],
                         packed_seq_params=batch.get("packed_seq_params"))

        with torch.no_grad():
            before = dict(calls)
            packed = forward({"tokens": tokens[None], "labels": labels[None], "loss_mask": torch.ones(1, total),
                              "position_ids": torch.cat([torch.arange(n) for n in LENGTHS])[None],
                              "packed_seq_params": packed_seq_params(cum, total=total)})[0].float()
            out["packed_calls"] = {k: calls[k] - before[k] for k in calls}
            separate = torch.cat([forward({"tokens": tokens[a:b][None], "labels": labels[a:b][None],
                                           "loss_mask": torch.ones(1, b - a), "position_ids": torch.arange(b - a)[None]})[0]
                                  for a, b in zip(cum, cum[1:], strict=False)]).float()
        out["packed_loss"], out["separate_loss"] = float(packed.mean()), float(separate.mean())
        out["token_max_err"] = float((packed - separate).abs().max())

        # ---- tokens/s: the same samples packed (THD rows of 4096) vs padded to the longest (2048), fwd + bwd
        big = prepare_config(dataclasses.replace(config, hidden_size=1024, ffn_hidden_size=2816, num_attention_heads=16,
                                                 num_query_groups=4, kv_channels=64))
        bm = build_chunks(transformer_config=big, layer_spec=spec,
                          vocab_size=32000, max_sequence_length=4096, device="cuda")[0]
        lens = torch.randint(128, 2049, (64,), generator=gen).tolist()
        rows, cur = [], []
        for n in lens:  # greedy in order, 4096 a row
            if sum(cur) + n > 4096:
                rows.append(cur)
                cur = []
            cur.append(n)
        rows.append(cur)

        def packed_batches():
            for i in range(0, len(rows), 4):
                group, bounds, toks = rows[i : i + 4], [0], 0
                for row in group:
                    for n in row:
                        bounds.append(bounds[-1] + n)
                    bounds[-1] += 4096 - sum(row)  # the row's tail padding joins its last sample
                    toks += 4096
                yield {"tokens": torch.randint(0, 32000, (1, toks)), "labels": torch.randint(0, 32000, (1, toks)),
                       "loss_mask": torch.ones(1, toks), "position_ids": torch.zeros(1, toks, dtype=torch.long),
                       "packed_seq_params": packed_seq_params(bounds, total=toks)}

        def padded_batches():
            for i in range(0, len(lens), 8):
                b = len(lens[i : i + 8])
                yield {"tokens": torch.randint(0, 32000, (b, 2048)), "labels": torch.randint(0, 32000, (b, 2048)),
                       "loss_mask": torch.ones(b, 2048), "position_ids": torch.arange(2048).expand(b, -1)}

        def timed(make):
            batches = list(make())
            for batch in batches[:1]:  # warm-up
                b = step_mod.model_inputs(batch, bm)
                bm(b["tokens"], b["position_ids"], None, labels=b["labels"],
                   packed_seq_params=b.get("packed_seq_params")).sum().backward()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for batch in batches:
                b = step_mod.model_inputs(batch, bm)
                bm(b["tokens"], b["position_ids"], None, labels=b["labels"],
                   packed_seq_params=b.get("packed_seq_params")).sum().backward()
            torch.cuda.synchronize()
            return time.perf_counter() - t0, sum(int(b["tokens"].numel()) for b in batches)

        t_packed, cap_packed = timed(packed_batches)
        t_padded, cap_padded = timed(padded_batches)
        real = sum(lens)
        out["tokens_per_s"] = {"packed": real / t_packed, "padded": real / t_padded,
                               "packed_capacity": cap_packed, "padded_capacity": cap_padded, "real_tokens": real}
        engine.destroy(process_group=True)
    varlen_mod.varlen_attn, torch.nn.functional.scaled_dot_product_attention = real_varlen, real_sdpa
    step_mod.packed_attention_mask = real_mask
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_varlen_attn_packed_path_equals_unpacked_in_bf16(ranks, tmp_path):
    out = ranks(_cuda_run, world=1, out=tmp_path)[0]
    print(f"\nattention max |err| (causal, full, short-q) {out['attention_max_err']}")
    print(f"packed loss {out['packed_loss']:.6f} unpacked {out['separate_loss']:.6f} "
          f"per-token max |err| {out['token_max_err']:.4f}; packed forward calls {out['packed_calls']}")
    t = out["tokens_per_s"]
    print(f"real tokens/s fwd+bwd, 1024-hidden 4-layer GPT (vocab 32000): packed {t['packed']:.0f} ({t['packed_capacity']} slots) "
          f"vs padded {t['padded']:.0f} ({t['padded_capacity']} slots) for {t['real_tokens']} tokens; "
          f"ratio {t['packed'] / t['padded']:.2f}")
    assert max(out["attention_max_err"]) < 2e-2
    calls = out["packed_calls"]
    # every layer's attention went through flash varlen; no SDPA call, no block-diagonal [t, t] mask built
    assert calls["varlen"] == 4 and calls["sdpa"] == 0 and calls["mask"] == 0, calls
    assert out["packed_loss"] == pytest.approx(out["separate_loss"], rel=1e-2)
    assert out["token_max_err"] < 5e-2
