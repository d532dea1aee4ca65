"""``kernels.grad_accum_fusion`` without Apex: megatron's parallel linears add each weight gradient into the
fp32 ``main_grad`` through our stand-in for ``fused_weight_gradient_mlp_cuda`` (CPU here: the unfused addmm)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

TINY = Path(__file__).resolve().parents[4] / "recipes" / "llm" / "tiny"


def _train_child(*, rank, world, run_dir, over):
    """One rank (``ranks``): megatron's process-wide state stays out of the pytest process. Returns the losses and the main_grad shapes the stand-in accumulated into."""
    import loongforge
    from loongforge_megatron.device_adapters import grad_accum

    calls = []
    real = grad_accum.wgrad_gemm_accum
    grad_accum.wgrad_gemm_accum = lambda *a: calls.append(tuple(a[2].shape)) or real(*a)
    recipe = loongforge.load_recipe(TINY / "llama_tiny.yaml", [
        "accelerator=cpu", "train.steps=3", "train.global_batch_size=4", "train.micro_batch_size=2",
        "logging.console=false", "logging.tensorboard=false", "checkpoint.save_at_end=false", *over])
    job, runtime = loongforge.build_job(recipe, output_dir=run_dir)
    try:
        losses = [job.step()["loss"] for _ in range(3)]
    finally:
        job.close()
        runtime.logger.close()
    from megatron.core.tensor_parallel import layers

    restored = layers._grad_accum_fusion_available is False and not hasattr(layers, "fused_weight_gradient_mlp_cuda")
    return {"losses": losses, "calls": calls, "restored": restored}


def _train(ranks, tmp_path: Path, name: str, *over: str) -> dict:
    return ranks(_train_child, world=1, out=tmp_path / f"{name}-ranks", run_dir=tmp_path / name, over=list(over))[0]


def test_fused_accumulation_trains_the_unfused_losses(tmp_path, ranks):
    """Same losses with and without the fusion (two micro-batches a step: the second accumulates into the first's
    main_grad); every parallel linear's weight gradient went through the stand-in; megatron's own flag is back
    to 'no Apex' after the run."""
    plain = _train(ranks, tmp_path, "plain")
    assert not plain["calls"]
    fused = _train(ranks, tmp_path, "fused", "kernels.grad_accum_fusion=true")
    assert fused["losses"] == pytest.approx(plain["losses"], rel=1e-6), (plain, fused)
    assert len(fused["calls"]) > 0 and all(len(s) == 2 for s in fused["calls"])
    assert fused["restored"] and plain["restored"]


def test_frozen_weights_accumulate_nothing(tmp_path, ranks):
    """A weight without main_grad (frozen: DDP gives it no buffer) accumulates nothing, whatever megatron hands
    over; LoRA (frozen base weights, trained adapters) trains the unfused losses with the fusion on."""
    from loongforge_megatron.device_adapters.grad_accum import wgrad_gemm_accum

    wgrad_gemm_accum(torch.ones(3, 2), torch.ones(3, 4), None)
    main = torch.ones(4, 2)
    wgrad_gemm_accum(torch.ones(3, 2), torch.ones(3, 4), main)
    assert torch.equal(main, torch.full((4, 2), 4.0))  # 1 + sum over 3 tokens
    lora = ["train.stage=lora", "model.preset=null", "model.num_layers=2", "model.hidden_size=64",
            "model.ffn_hidden_size=128", "model.num_attention_heads=4", "model.num_query_groups=2", "model.vocab_size=512"]
    plain = _train(ranks, tmp_path, "plain", *lora)
    fused = _train(ranks, tmp_path, "fused", *lora, "kernels.grad_accum_fusion=true")
    assert fused["losses"] == pytest.approx(plain["losses"], rel=1e-6), (plain, fused)


def test_the_embodied_backend_refuses_it(capsys):
    from loongforge.cli import main

    recipe = Path(__file__).resolve().parents[4] / "recipes" / "embodied" / "tiny_vla_synthetic.yaml"
    assert main(["validate", str(recipe), "kernels.grad_accum_fusion=true"]) == 2
    assert "kernels.grad_accum_fusion" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_accumulates_in_fp32_in_place(dtype):
    """On CUDA the stand-in's addmm (16-bit inputs, fp32 out, out = main_grad) adds into the buffer in place, to
    fp32 accuracy (an unfused 16-bit weight gradient would round each product sum to 8 / 11 bits first)."""
    from loongforge_megatron.device_adapters.grad_accum import wgrad_gemm_accum

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 512, device="cuda", generator=g).to(dtype)
    dy = torch.randn(4096, 768, device="cuda", generator=g).to(dtype)
    main = torch.randn(768, 512, device="cuda", generator=g)
    ptr, ref = main.data_ptr(), main + dy.double().t().matmul(x.double()).float()
    wgrad_gemm_accum(x, dy, main)
    assert main.data_ptr() == ptr and main.dtype == torch.float32
    torch.testing.assert_close(main, ref, rtol=1e-5, atol=1e-3)


def test_refused_with_train_compile(capsys):
    """Under train.compile megatron's linear backward writes main_grad outside the compiled graph: dynamo broke the
    graph at every linear (23 breaks on dit-tiny, 0.60x on DiT-XL/2 on an H200), so validate refuses it."""
    from loongforge.cli import main

    dit = Path(__file__).resolve().parents[4] / "recipes" / "diffusion" / "dit_tiny.yaml"
    assert main(["validate", str(dit), "train.compile=true", "kernels.grad_accum_fusion=true"]) == 2
    err = capsys.readouterr().err
    assert "key 'kernels.grad_accum_fusion'" in err and "train.compile" in err and err.count("\n") == 1, err
    assert main(["validate", str(dit), "kernels.grad_accum_fusion=true"]) == 0, capsys.readouterr().err
