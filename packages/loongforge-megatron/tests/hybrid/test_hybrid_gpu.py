"""GPU: a training step of a hybrid LM runs fla's chunked gated-delta-rule and causal-conv kernels (every DeltaNet
layer, forward and backward), and packed samples (THD) give the per-sample logits within bf16 tolerance; fla's op
equals the torch reference in fp32 within 2e-3."""

from __future__ import annotations

from typing import Any

import pytest
import torch

LENGTHS = (100, 37, 300, 75)


def _cuda_run(*, rank: int, world: int, recipe_path: str, run_dir: str) -> dict[str, Any]:
    import loongforge
    from loongforge_megatron.layers import gated_delta

    calls = {"rule": 0, "conv": 0}
    real = gated_delta.fla_ops()
    if real is None:
        raise RuntimeError("fla is not importable in the rank")

    def count(name, fn):
        def spy(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return spy

    spied = (count("rule", real[0]), count("conv", real[1]))
    gated_delta.fla_ops = lambda: spied
    out: dict[str, Any] = {}

    # ---- the op alone: fla (fp32 inputs) vs the torch reference, packed
    g = torch.Generator(device="cuda").manual_seed(0)
    t = sum(LENGTHS)
    q, k = (torch.randn(1, t, 2, 32, device="cuda", generator=g) for _ in range(2))
    v = torch.randn(1, t, 4, 32, device="cuda", generator=g)
    decay, beta = -torch.rand(1, t, 4, device="cuda", generator=g), torch.rand(1, t, 4, device="cuda", generator=g)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], device="cuda")
    fast = gated_delta.gated_delta_rule(q, k, v, g=decay, beta=beta, cu_seqlens=cu)
    gated_delta.fla_ops = lambda: None
    ref = gated_delta.gated_delta_rule(q, k, v, g=decay, beta=beta, cu_seqlens=cu)
    gated_delta.fla_ops = lambda: spied
    out["op_err"] = float((fast - ref).abs().max())

    # ---- a training step of the tiny Qwen3.5 (bf16): fla inside it
    calls.update(rule=0, conv=0)
    job, _ = loongforge.build_job(loongforge.load_recipe(recipe_path), output_dir=run_dir)
    try:
        out["loss"] = job.step()["loss"]
        out["step_calls"] = dict(calls)
        # ---- packed vs each sample alone, through the built model
        from loongforge_megatron.engine.model import unwrap
        from loongforge_megatron.engine.packing import packed_seq_params

        model = unwrap(job.chunks[0])
        tokens = torch.randint(0, 512, (1, t), device="cuda", generator=g)
        bounds = cu.tolist()
        pos = torch.cat([torch.arange(n, device="cuda") for n in LENGTHS])[None]
        with torch.no_grad():
            packed = model(tokens, pos, None, packed_seq_params=packed_seq_params(bounds, device="cuda"))
            alone = torch.cat([model(tokens[:, a:b], torch.arange(b - a, device="cuda")[None], None)
                               for a, b in zip(bounds, bounds[1:], strict=False)], dim=1)
        out["packed_err"] = float((packed.float() - alone.float()).abs().max())
        out["logit_scale"] = float(alone.float().abs().max())
    finally:
        job.close()
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fla_kernels_run_inside_the_step(ranks, tmp_path):
    pytest.importorskip("fla")
    import yaml

    recipe = {
        "backend": "megatron", "model": {"preset": "qwen3.5-tiny"},
        "data": {"format": "synthetic", "seq_length": 256},
        "train": {"stage": "pretrain", "steps": 1, "global_batch_size": 2, "micro_batch_size": 1, "precision": "bf16",
                  "lr": 1e-3},
        "checkpoint": {"save_at_end": False}, "accelerator": "cuda", "logging": {"tensorboard": False},
    }
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    out = ranks(_cuda_run, world=1, out=tmp_path / "ranks", recipe_path=str(path), run_dir=str(tmp_path / "run"))[0]
    print(f"\nfla vs torch reference max |err| {out['op_err']:.2e}; step calls {out['step_calls']}; "
          f"packed vs alone max |err| {out.get('packed_err')} (logits up to {out.get('logit_scale')})")
    assert out["op_err"] < 2e-3
    # 3 DeltaNet layers of 4 (qwen3.5-tiny), 2 micro-batches: forward calls (backward runs fla's own autograd)
    assert out["step_calls"]["rule"] == 6 and out["step_calls"]["conv"] == 6, out["step_calls"]
    assert "packed_err" in out and out["packed_err"] < 5e-2 * max(1.0, out["logit_scale"])
