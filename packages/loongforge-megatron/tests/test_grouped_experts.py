"""Grouped-GEMM MoE experts (``kernels.moe_grouped_gemm``) against megatron's ``SequentialMLP`` (CPU, gloo, fp32).

- the grouped linear equals one matmul per expert, forward and backward, with experts that get no tokens;
- Qwen3-MoE and DeepSeek-V3 tiny models (loaded from checkpoints transformers saved) train 5 steps with the same
  losses and grad norms either way (<= 1e-5 relative), and the grouped model's state dict has SequentialMLP's names;
- EP=2 with grouped experts gives the single-process grouped losses;
- HF -> megatron (grouped) -> HF is bit-exact; a random init equals SequentialMLP's draw for draw.
"""

from __future__ import annotations

import pytest
import torch
import yaml

STEPS = 5
LOSS_RTOL = 1e-5


def test_grouped_linear_matches_per_expert_matmuls():
    from loongforge_megatron.layers.grouped_experts import grouped_linear

    g = torch.Generator().manual_seed(0)
    counts = [3, 0, 5, 1, 0, 7, 2]  # 7 experts (not a power of two), two without tokens
    x = torch.randn(sum(counts), 16, generator=g, requires_grad=True)
    w = torch.randn(len(counts), 24, 16, generator=g, requires_grad=True)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    y = grouped_linear(x, w, offs)
    y.sum().backward()  # NOTE: an expanded (stride-0) gradient, which grouped_mm itself cannot take
    dx, dw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    ref = torch.cat([xe @ w[e].T for e, xe in enumerate(x.split(counts))])
    ref.sum().backward()
    torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dx, x.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dw, w.grad, rtol=1e-6, atol=1e-6)
    assert torch.count_nonzero(dw[1]) == 0 and torch.count_nonzero(dw[4]) == 0


def _recipe(tmp_path, hf_dir, name: str, *, grouped: bool | None, parallel: dict | None = None, load: bool = True,
            dispatcher: str = "auto", router_fusion: bool = True, model: dict | None = None):
    r = {
        "backend": "megatron",
        "model": {"hf": str(hf_dir), "moe_token_dispatcher": dispatcher, **(model or {})},
        "data": {"format": "synthetic", "seq_length": 32},
        "train": {"stage": "cpt" if load else "pretrain", "steps": STEPS, "global_batch_size": 4,
                  "micro_batch_size": 2, "precision": "fp32", "lr": 1e-3, "seed": 7},
        "checkpoint": {"save_at_end": False, **({"load": str(hf_dir)} if load else {})},
        "parallel": parallel or {},
        "accelerator": "cpu",
        "kernels": {"moe_grouped_gemm": grouped, "moe_router_fusion": router_fusion},
        "logging": {"tensorboard": False},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(r))
    return path


def _train(*, rank, world, recipe_path, run_dir, export_dir=None, steps=STEPS):
    """Losses and grad norms of STEPS steps, the experts' module type and the state dict's expert tensors."""
    import loongforge

    job, _ = loongforge.build_job(loongforge.load_recipe(recipe_path), output_dir=run_dir)
    try:
        model = job.chunks[0]
        kinds = sorted({type(m).__name__ for n, m in model.named_modules() if n.endswith("mlp.experts")}
                       | {type(m.token_dispatcher).__name__ for m in model.modules() if hasattr(m, "token_dispatcher")}
                       | {type(m).__name__ for n, m in model.named_modules() if n.endswith("mlp.router")})
        initial = {k: v.detach().clone() for k, v in model.state_dict().items()
                   if ".experts." in k and not k.endswith("_extra_state")}
        metrics = [job.step() for _ in range(steps)]
        if export_dir is not None:
            job.export("hf", export_dir)
        return {"losses": [m["loss"] for m in metrics], "grad_norms": [m["grad_norm"] for m in metrics],
                "kinds": kinds, "initial": initial}
    finally:
        job.close()


def _close(a: list[float], b: list[float], rtol: float) -> bool:
    return all(abs(x - y) <= rtol * abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("family,dispatcher", [("qwen3_moe", "auto"), ("deepseek_v3", "auto"),
                                               ("qwen3_moe", "alltoall")])
def test_grouped_experts_train_like_sequential_mlp(tmp_path, family, dispatcher, tiny_hf, ranks):
    """SequentialMLP + megatron's all-to-all dispatcher vs grouped experts with the default (permute) dispatcher
    and with megatron's."""
    hf = tiny_hf(family, tmp_path / "hf")
    runs = {}
    for name, grouped, disp, fused in (("sequential", False, "alltoall", False), ("grouped", None, dispatcher, True)):
        # None: the default picks grouped here
        runs[name] = ranks(_train, world=1, out=tmp_path / name, recipe_path=_recipe(
            tmp_path, hf, name, grouped=grouped, dispatcher=disp, router_fusion=fused), run_dir=tmp_path / f"run_{name}")[0]
    seq, grp = runs["sequential"], runs["grouped"]
    expect = ["FusedTopKRouter", "GroupedMLP",
              "PermuteDispatcher" if dispatcher == "auto" else "MoEAlltoAllTokenDispatcher"]
    assert seq["kinds"] == ["MoEAlltoAllTokenDispatcher", "SequentialMLP", "TopKRouter"], seq["kinds"]
    assert grp["kinds"] == sorted(expect), grp["kinds"]
    # the same per-expert names, shapes and (loaded) values
    assert sorted(grp["initial"]) == sorted(seq["initial"])
    for k, v in seq["initial"].items():
        assert torch.equal(grp["initial"][k], v), k
    assert _close(grp["losses"], seq["losses"], LOSS_RTOL), (grp["losses"], seq["losses"])
    assert _close(grp["grad_norms"], seq["grad_norms"], 1e-4), (grp["grad_norms"], seq["grad_norms"])
    # NOTE: steps 2-5 see the updated weights, so equal losses there also say the expert gradients agree


@pytest.mark.slow
def test_grouped_experts_ep2_equals_one_process(tmp_path, tiny_hf, ranks):
    hf = tiny_hf("qwen3_moe", tmp_path / "hf")
    one = ranks(_train, world=1, out=tmp_path / "one", recipe_path=_recipe(tmp_path, hf, "one", grouped=True),
                run_dir=tmp_path / "run_one")[0]
    two = ranks(_train, world=2, out=tmp_path / "two",
                recipe_path=_recipe(tmp_path, hf, "two", grouped=True, parallel={"ep": 2}), run_dir=tmp_path / "run_two")
    assert one["kinds"] == ["FusedTopKRouter", "GroupedMLP", "PermuteDispatcher"]
    assert two[0]["kinds"] == ["FusedTopKRouter", "GroupedMLP", "MoEAlltoAllTokenDispatcher"]  # all-to-all under EP
    assert two[0]["losses"] == two[1]["losses"]
    assert _close(two[0]["losses"], one["losses"], LOSS_RTOL), (two[0]["losses"], one["losses"])


@pytest.mark.slow
def test_shared_expert_overlap_ep2_equals_one_process(tmp_path, tiny_hf, ranks):
    """DeepSeek-V3 under EP=2 with the shared experts computed while the all-to-all dispatches (megatron's
    overlapped schedule of the MoE layer) trains like one process without overlap."""
    hf = tiny_hf("deepseek_v3", tmp_path / "hf")
    one = ranks(_train, world=1, out=tmp_path / "one", recipe_path=_recipe(tmp_path, hf, "one", grouped=True),
                run_dir=tmp_path / "run_one")[0]
    two = ranks(_train, world=2, out=tmp_path / "two", recipe_path=_recipe(
        tmp_path, hf, "two", grouped=True, parallel={"ep": 2}, model={"moe_shared_expert_overlap": True}),
        run_dir=tmp_path / "run_two")
    assert "MoEAlltoAllTokenDispatcher" in two[0]["kinds"]
    assert two[0]["losses"] == two[1]["losses"]
    assert _close(two[0]["losses"], one["losses"], LOSS_RTOL), (two[0]["losses"], one["losses"])
    assert _close(two[0]["grad_norms"], one["grad_norms"], 1e-4), (two[0]["grad_norms"], one["grad_norms"])


@pytest.mark.slow
def test_grouped_experts_hf_roundtrip_is_bit_exact(tmp_path, tiny_hf, ranks):
    """Loaded into grouped experts (EP=2) and exported before any step, the HF tensors come back bit for bit."""
    import transformers as tf
    from safetensors.torch import load_file

    hf = tiny_hf("qwen3_moe", tmp_path / "hf")
    path = _recipe(tmp_path, hf, "rt", grouped=True, parallel={"ep": 2})
    res = ranks(_train, world=2, out=tmp_path / "ranks", recipe_path=path, run_dir=tmp_path / "run",
                export_dir=tmp_path / "export", steps=0)
    assert "GroupedMLP" in res[0]["kinds"]
    src = {}
    for f in sorted(hf.glob("*.safetensors")):
        src.update(load_file(f))
    out = {}
    for f in sorted((tmp_path / "export").glob("*.safetensors")):
        out.update(load_file(f))
    assert sorted(out) == sorted(src)
    for k, v in src.items():
        assert torch.equal(out[k], v), k
    tf.AutoModelForCausalLM.from_pretrained(tmp_path / "export")  # transformers reads it


def _random_init_experts(*, grouped: bool):
    """The expert tensors of a random-init MoE layer built by megatron (CPU init), by state-dict name."""
    from loongforge_megatron.layers.grouped_experts import with_grouped_experts
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_layer import TransformerLayer

    torch.manual_seed(3)
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                               num_moe_experts=5, moe_router_topk=2, moe_ffn_hidden_size=16, gated_linear_unit=True,
                               add_bias_linear=False, use_cpu_initialization=True, moe_token_dispatcher_type="alltoall")
    spec = get_gpt_layer_local_spec(num_experts=5, moe_grouped_gemm=False)
    if grouped:
        spec = with_grouped_experts(spec)
    layer = TransformerLayer(config, spec.submodules)
    return {k: v.clone() for k, v in layer.mlp.experts.state_dict().items() if not k.endswith("_extra_state")}


@pytest.mark.slow
def test_grouped_random_init_equals_sequential_mlp(tmp_path, in_world):
    seq = in_world(_random_init_experts, out=tmp_path / "seq", grouped=False)
    grp = in_world(_random_init_experts, out=tmp_path / "grp", grouped=True)
    assert sorted(grp) == sorted(seq) and len(seq) == 10
    for k, v in seq.items():
        assert torch.equal(grp[k], v), k


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_linear_bf16_cuda_matches_per_expert_matmuls():
    from loongforge_megatron.layers.grouped_experts import grouped_linear

    g = torch.Generator(device="cuda").manual_seed(0)
    counts = [300, 0, 517, 1, 0, 77, 1024]
    x = torch.randn(sum(counts), 256, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (0.05 * torch.randn(len(counts), 384, 256, device="cuda", generator=g)).bfloat16().requires_grad_()
    offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    dy = torch.randn(sum(counts), 384, device="cuda", generator=g).bfloat16()
    y = grouped_linear(x, w, offs)
    y.backward(dy)
    ref = torch.cat([xe.float() @ w[e].float().T for e, xe in enumerate(x.split(counts))])
    dx = torch.cat([de.float() @ w[e].float() for e, de in enumerate(dy.split(counts))])
    dw = torch.stack([de.float().T @ xe.float() for de, xe in zip(dy.split(counts), x.split(counts), strict=True)])
    for got, want in ((y, ref), (x.grad, dx), (w.grad, dw)):
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


@pytest.mark.slow
def test_permute_dispatch_with_token_dropping_equals_alltoall(tmp_path, tiny_hf, ranks):
    """Capacity factor 0.5 (tokens dropped every step): the permute dispatcher gives megatron's all-to-all losses."""
    hf = tiny_hf("qwen3_moe", tmp_path / "hf")
    runs = {}
    for disp in ("alltoall", "permute"):
        path = _recipe(tmp_path, hf, disp, grouped=True, dispatcher=disp)
        r = yaml.safe_load(path.read_text())
        r["model"]["moe_capacity_factor"] = 0.5
        path.write_text(yaml.safe_dump(r))
        runs[disp] = ranks(_train, world=1, out=tmp_path / disp, recipe_path=path, run_dir=tmp_path / f"run_{disp}")[0]
    assert "PermuteDispatcher" in runs["permute"]["kinds"]
    assert _close(runs["permute"]["losses"], runs["alltoall"]["losses"], LOSS_RTOL), runs


@pytest.mark.parametrize("overrides,key", [
    (["model.moe_token_dispatcher=permute", "kernels.moe_grouped_gemm=false"], "model.moe_token_dispatcher"),
    (["kernels.moe_grouped_gemm=true", "train.stage=lora"], "kernels.moe_grouped_gemm"),
    (["model.moe_expert_bias=true"], "model"),  # aux-loss-free balancing needs sigmoid scores
    (["model.moe_pad_to_capacity=true"], "model"),  # padding applies with a capacity factor
    (["model.moe_shared_expert_overlap=true"], "model"),  # Qwen3-MoE has no shared experts to overlap
    (["model.mtp_num_layers=1"], "model.mtp_num_layers"),  # Qwen3-MoE has no HF layout for MTP layers
])
def test_recipe_checks_name_the_key(overrides, key, capsys):
    from pathlib import Path

    from loongforge.cli import main

    recipe = Path(__file__).resolve().parents[3] / "recipes/llm/tiny/qwen3_moe_tiny.yaml"
    assert main(["validate", str(recipe), *overrides]) == 2
    err = capsys.readouterr().err
    assert f"key '{key}'" in err and "Traceback" not in err, err


def test_routing_options_reach_megatron_config():
    from types import SimpleNamespace

    from loongforge_megatron.models.gpt.translate import transformer_config
    from loongforge_megatron.models.registry import presets

    spec, fields = presets()["deepseek-v3-tiny"]
    arch = spec.arch({**fields, "moe_aux_loss_coeff": 1e-4, "moe_aux_loss_type": "seq_aux_loss",
                   "moe_z_loss_coeff": 1e-3, "moe_capacity_factor": 1.25, "moe_token_drop_policy": "position",
                   "moe_expert_bias_update_rate": 2e-3, "moe_token_dispatcher": "allgather", "mtp_num_layers": 1,
                   "mtp_loss_weight": 0.3})
    plan = SimpleNamespace(tp=1, pp=1, vpp=1, first_stage_layers=None, last_stage_layers=None, cp=1, ep=1, etp=1,
                           sp=False, recompute=None)
    c = transformer_config(arch, plan=plan, precision="fp32", cpu_init=True)
    assert (c.moe_router_load_balancing_type, c.moe_aux_loss_coeff, c.moe_z_loss_coeff) == ("seq_aux_loss", 1e-4, 1e-3)
    assert (c.moe_expert_capacity_factor, c.moe_token_drop_policy) == (1.25, "position")
    assert (c.moe_router_enable_expert_bias, c.moe_router_bias_update_rate) == (True, 2e-3)
    assert c.moe_token_dispatcher_type == "allgather"
    assert (c.mtp_num_layers, c.mtp_loss_scaling_factor) == (1, 0.3)
    arch = spec.arch({**fields, "moe_shared_expert_overlap": True})
    assert transformer_config(arch, plan=plan, precision="fp32", cpu_init=True).moe_shared_expert_overlap


def _train_cli(recipe_path, out_dir) -> dict[int, float]:
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-m", "loongforge", "train", str(recipe_path), "--output", str(out_dir)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return {int(r["step"]): r["loss"] for r in map(json.loads, filter(str.strip, lines)) if "loss" in r}


@pytest.mark.slow
def test_grouped_experts_resume_is_bitwise_exact(tmp_path, tiny_hf):
    """A run resumed from its step-2 checkpoint (grouped experts, Adam state of the stacked weights) continues
    with the uninterrupted run's losses, bitwise."""
    import shutil

    hf = tiny_hf("qwen3_moe", tmp_path / "hf")
    path = _recipe(tmp_path, hf, "resume", grouped=True)
    r = yaml.safe_load(path.read_text())
    r["train"]["steps"] = 4
    r["checkpoint"].update(save_interval=2, keep_last=5)
    path.write_text(yaml.safe_dump(r))
    straight, resumed = tmp_path / "A", tmp_path / "B"
    ref = _train_cli(path, straight)
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "checkpoints" / "step_00000002", resumed / "checkpoints" / "step_00000002")
    (resumed / "checkpoints" / "latest").write_text("step_00000002")
    got = _train_cli(path, resumed)
    assert sorted(got) == [3, 4], got
    for step, loss in got.items():
        assert loss == ref[step], (step, loss, ref[step])
