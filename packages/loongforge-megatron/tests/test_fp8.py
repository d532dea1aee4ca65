"""train.fp8 on the megatron backend without a GPU: recipe checks, the one-line CPU error, the fp8 command's
registration, the GEMM shapes the profile times and the policy file's errors. ``loongforge_kernels``'
``test_gpu_fp8.py`` and ``benchmarks/fp8_throughput.py`` run the FP8 GEMMs on a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

TINY = {
    "backend": "megatron",
    "model": {"family": "llama", "num_layers": 1, "hidden_size": 64, "ffn_hidden_size": 128,
              "num_attention_heads": 4, "vocab_size": 256},
    "data": {"format": "synthetic", "seq_length": 32},
    "train": {"steps": 1, "global_batch_size": 1, "fp8": {"recipe": "rowwise"}},
    "checkpoint": {"save_at_end": False},
    "accelerator": "cpu",
}


def _cli(*args: str, cwd) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run([sys.executable, "-m", "loongforge", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_fp8_recipe_on_cpu_fails_with_one_line(tmp_path):
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(TINY))
    r = _cli("train", "r.yaml", "--output", "out", cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and "train.fp8" in lines[-1] and "cpu" in lines[-1], lines[-3:]
    assert "Traceback" not in r.stderr


def test_fp8_section_is_validated():
    from loongforge.recipe.schema import TrainConfig
    from pydantic import ValidationError

    assert TrainConfig(fp8={}).fp8.recipe == "tensorwise"
    with pytest.raises(ValidationError, match="blockwise takes grad_dtype e4m3"):
        TrainConfig(fp8={"recipe": "blockwise", "grad_dtype": "e5m2"})
    with pytest.raises(ValidationError, match="tensorwise"):
        TrainConfig(fp8={"recipe": "delayed"})


def test_fp8_output_layer_under_the_fused_loss_is_refused(tmp_path, capsys):
    """The loongforge spec computes the output layer inside its fused linear cross-entropy: an FP8 output layer
    would never run, so the recipe is refused at validate (megatron's local spec runs it)."""
    from loongforge.cli import main

    recipe = {**TINY, "train": {**TINY["train"], "fp8": {"recipe": "rowwise", "output_layer": True}}}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["validate", str(tmp_path / "r.yaml")]) == 2
    err = capsys.readouterr().err
    assert "key 'train.fp8.output_layer'" in err and "fused linear cross-entropy" in err and err.count("\n") == 1
    assert main(["validate", str(tmp_path / "r.yaml"), "kernels.layers=local"]) == 0


@pytest.mark.parametrize(("override", "fragment"), [("kernels.layers=te", "kernels.layers te"),
                                                    ("train.compile=true", "train.compile")])
def test_fp8_conflicts_are_refused_at_validate(tmp_path, capsys, override, fragment):
    """What the FP8 linears cannot run with is refused by ``loongforge validate``, not first after launch."""
    from loongforge.cli import main

    (tmp_path / "r.yaml").write_text(yaml.safe_dump(TINY))
    assert main(["validate", str(tmp_path / "r.yaml"), override]) == 2
    err = capsys.readouterr().err
    assert "key 'train.fp8'" in err and fragment in err and err.count("\n") == 1, err


def test_fp8_profile_command_is_registered_and_needs_a_gpu(tmp_path):
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(TINY))
    assert "fp8" in _cli("--help", cwd=tmp_path).stdout
    r = _cli("fp8", "profile", "r.yaml", cwd=tmp_path)
    assert r.returncode == 2 and "train.fp8" in r.stderr.strip().splitlines()[-1], r.stderr[-2000:]


def test_gemm_shapes_follow_the_tp_split():
    from loongforge_megatron.fp8_profile import gemm_shapes
    from loongforge_megatron.models.registry import presets

    spec, fields = presets()["llama3.1-8b"]
    arch = spec.arch({**fields, "num_layers": 8})
    assert gemm_shapes(arch, tp=1, tokens=8192) == {
        "qkv": (8192, 6144, 4096), "proj": (8192, 4096, 4096), "fc1": (8192, 28672, 4096), "fc2": (8192, 4096, 14336)}
    s2 = gemm_shapes(arch, tp=2, tokens=8192, output_layer=True)
    assert s2["qkv"] == (8192, 3072, 4096) and s2["fc2"] == (8192, 4096, 7168) and s2["output"][1] == 128256 // 2


def test_policy_file_errors_name_the_key(tmp_path):
    from loongforge.errors import RecipeError
    from loongforge_megatron.fp8_policy import load_policy

    with pytest.raises(RecipeError, match="train.fp8.policy.*does not exist"):
        load_policy(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(RecipeError, match="not a policy file"):
        load_policy(tmp_path / "bad.json")
    (tmp_path / "ok.json").write_text(json.dumps({"gemms": {}}))
    assert load_policy(tmp_path / "ok.json") == {"gemms": {}}


def _swap_body(policy: str | None) -> dict:
    import torch
    from loongforge.recipe.schema import Fp8Config
    from loongforge_megatron.layers.fp8 import Fp8Kernels, Fp8ParallelLinear, apply_fp8
    from loongforge_megatron.layers.megatron_layers import row_parallel_linear
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True)
    init = torch.nn.init.normal_
    model = torch.nn.Module()
    model.fc1 = ColumnParallelLinear(64, 256, config=cfg, init_method=init, bias=False, gather_output=False)
    model.fc2 = row_parallel_linear()(256, 64, config=cfg, init_method=init, bias=False, input_is_parallel=True,
                                      skip_bias_add=True)
    model.odd = ColumnParallelLinear(64, 100, config=cfg, init_method=init, bias=False, gather_output=False)
    model.output_layer = ColumnParallelLinear(64, 512, config=cfg, init_method=init, bias=False, gather_output=False)
    keys = set(model.state_dict())
    x = torch.randn(16, 2, 64)
    before = model.fc2(model.fc1(x)[0])[0]
    fp8 = Fp8Config(recipe="tensorwise", policy=policy)
    kernels = Fp8Kernels.select(fp8, provider="auto", device_type="cpu")
    n8, n = apply_fp8([model], fp8, kernels=kernels, tokens=32)
    after = model.fc2(model.fc1(x)[0])[0]  # CPU tensors: megatron's own linear
    return {"counts": (n8, n), "keys_same": set(model.state_dict()) == keys, "equal": torch.equal(before, after),
            "fp8": sorted(k for k, m in model.named_children() if isinstance(m, Fp8ParallelLinear)),
            "gemms": {k: m.fp8_gemms for k, m in model.named_children() if isinstance(m, Fp8ParallelLinear)},
            "row_base": isinstance(model.fc2, RowParallelLinear) and type(model.fc2).__name__}


def test_apply_fp8_swaps_decoder_linears(in_world, tmp_path):
    r = in_world(_swap_body, out=tmp_path, policy=None)
    assert r["fp8"] == ["fc1", "fc2"]  # not the output layer, not 100 outputs (not a multiple of 16)
    assert r["counts"] == (6, 9) and r["keys_same"] and r["equal"]
    assert r["row_base"] == "Fp8OwnGroupRowParallelLinear"


def test_apply_fp8_follows_the_policy(in_world, tmp_path):
    from loongforge_megatron.layers.fp8 import gemm_key

    faster = {"fp8_faster": True}
    slower = {"fp8_faster": False}
    policy = {"gemms": {gemm_key(32, 256, 64): {"fwd": faster, "dgrad": slower, "wgrad": faster},
                        gemm_key(32, 64, 256): {"fwd": slower, "dgrad": slower, "wgrad": slower}}}
    (tmp_path / "p.json").write_text(json.dumps(policy))
    r = in_world(_swap_body, out=tmp_path / "run", policy=str(tmp_path / "p.json"))
    assert r["fp8"] == ["fc1"] and r["gemms"]["fc1"] == (True, False, True) and r["counts"] == (2, 9)


def _grouped_body(cases: list[tuple[str | None, str, bool]]) -> list[dict]:
    return [_grouped_case(*case) for case in cases]


def _grouped_case(policy: str | None, recipe: str, experts: bool) -> dict:
    import torch
    from loongforge.recipe.schema import Fp8Config
    from loongforge_megatron.layers.fp8 import Fp8Kernels, apply_fp8
    from loongforge_megatron.layers.grouped_experts import GroupedMLP
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_moe_experts=4, moe_router_topk=2,
                            moe_ffn_hidden_size=32, ffn_hidden_size=32, gated_linear_unit=True, add_bias_linear=False,
                            use_cpu_initialization=True)
    pgs = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["ep", "expt_tp", "expt_dp"])
    model = torch.nn.Module()
    model.experts = GroupedMLP(4, cfg, pg_collection=pgs)
    x = torch.randn(10, 64)
    tokens = torch.tensor([3, 0, 5, 2])
    before = model.experts(x, tokens, None)[0]
    notes: list[str] = []
    fp8 = Fp8Config(recipe=recipe, policy=policy, experts=experts)
    kernels = Fp8Kernels.select(fp8, provider="auto", device_type="cpu")
    counts = apply_fp8([model], fp8, kernels=kernels, tokens=16, notes=notes)
    after = model.experts(x, tokens, None)[0]  # CPU tensors: bf16 grouped_mm path
    return {"counts": counts, "gemms": model.experts.fp8_gemms, "notes": notes, "equal": torch.equal(before, after)}


def test_apply_fp8_picks_fp8_grouped_experts(in_world, tmp_path):
    """train.fp8.experts switches grouped MoE experts to FP8 grouped GEMMs; the policy (keyed by experts, routed rows =
    tokens x top-k, N, K) picks per GEMM; blockwise keeps them bf16 and says why."""
    from loongforge_megatron.layers.fp8 import grouped_gemm_key

    faster, slower = {"fp8_faster": True}, {"fp8_faster": False}
    policy = {"gemms": {grouped_gemm_key(4, 32, 64, 64): {"fwd": faster, "dgrad": slower, "wgrad": faster}}}
    (tmp_path / "p.json").write_text(json.dumps(policy))
    every, pol, blk, off = in_world(_grouped_body, out=tmp_path / "run", cases=[
        (None, "rowwise", True), (str(tmp_path / "p.json"), "tensorwise", True), (None, "blockwise", True),
        (None, "rowwise", False)])
    assert off["gemms"] is None and off["counts"] == (0, 6) and off["notes"] == []  # train.fp8.experts defaults off
    assert every["gemms"] == ((True, True, True), (True, True, True)) and every["counts"] == (6, 6) and every["equal"]
    assert pol["gemms"] == ((True, False, True), (False, False, False)) and pol["counts"] == (2, 6)
    assert blk["gemms"] is None and blk["counts"] == (0, 6)
    assert blk["notes"] == ["MoE experts stay bf16 (blockwise: torch has no blockwise FP8 grouped GEMM on Hopper)"]


def test_expert_gemm_shapes():
    from loongforge_megatron.fp8_profile import expert_gemm_shapes
    from loongforge_megatron.models.registry import presets

    spec, fields = presets()["qwen3-30b-a3b"]
    arch = spec.arch({**fields, "num_layers": 4})
    assert expert_gemm_shapes(arch, ep=1, etp=1, tokens=8192) == {
        "expert_fc1": (128, 65536, 1536, 2048), "expert_fc2": (128, 65536, 2048, 768)}
    assert expert_gemm_shapes(arch, ep=2, etp=1, tokens=4096)["expert_fc1"] == (64, 32768, 1536, 2048)


def test_fp8_weight_grad_goes_into_main_grad(monkeypatch):
    """Under gradient-accumulation fusion the FP8 linear's weight grad lands in ``main_grad`` as megatron's DDP
    expects: written over the buffer while ``grad_added_to_main_grad`` is False (DDP just zeroed it; stale values
    must not survive), added on the next micro-batch; the flag is set and DDP gets a dummy grad. On CPU through an
    emulated scaled-mm (dequantize, then matmul)."""
    import torch
    from loongforge.kernels import select_op
    from loongforge_kernels import fp8_linear as fl
    from loongforge_megatron.layers.fp8 import _Fp8TPLinear

    def emulated(a, sa, b, sb, out_dtype, fast_accum, out=None):
        y = ((a.float() * sa) @ (b.float() * sb).t()).to(out_dtype)
        return y if out is None else out.copy_(y)

    monkeypatch.setattr(fl, "_scaled_mm", emulated)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, generator=gen).to(torch.bfloat16)
    w = torch.nn.Parameter((torch.randn(48, 32, generator=gen) / 8).to(torch.bfloat16))
    g = torch.randn(64, 48, generator=gen).to(torch.bfloat16)
    ops = select_op("fp8_linear", provider="torch", device_type="cpu")("tensorwise")  # NOTE: the registry's op
    y = _Fp8TPLinear.apply(x, w, None, False, False, False, None, ops, fl.ALL_FP8)
    y.backward(g)
    plain = w.grad.float()
    w.grad = None
    w.main_grad, w.grad_added_to_main_grad = torch.full((48, 32), 5.0), False
    for micro_batch in (1, 2):
        _Fp8TPLinear.apply(x, w, None, True, False, False, None, ops, fl.ALL_FP8).backward(g)
        assert w.grad_added_to_main_grad and w.grad is not None and w.grad.shape == w.shape
        torch.testing.assert_close(w.main_grad, micro_batch * plain, atol=1e-2, rtol=1e-2)
        w.grad = None
