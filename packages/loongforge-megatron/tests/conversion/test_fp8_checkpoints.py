"""Block-scaled FP8 checkpoints in the published DeepSeek-V3 format (``weight_scale_inv`` per 128x128 block, sizes
that are not multiples of 128): a transformers-saved DeepSeek-V3 model, quantized here by plain torch, loads online
(tp 2) and through ``convert`` exactly as its dequantized copy does, each rank dequantizing only its slice;
``convert --to hf --fp8`` gives the same bytes back; bad files are one-line errors (exit 2)."""

from __future__ import annotations

import json
import math
import re
import shutil

import loongforge
import pytest
import torch
import yaml
from loongforge.cli import main
from loongforge.errors import CheckpointError
from safetensors import safe_open
from safetensors.torch import load_file, save_file

BLOCK = 128
# NOTE: the linears the published checkpoints store as FP8 (everything else stays in the checkpoint's dtype)
PUBLISHED_FP8 = re.compile(r"^model\.layers\.\d+\.(self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)|"
                           r"mlp\.((experts\.\d+|shared_experts)\.)?(gate_proj|up_proj|down_proj))\.weight$")
QUANT = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK]}


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference quantizer (plain torch, as transformers' Fp8Quantize computes it, with ceil-divided blocks):
    per block inv = 1 / (448 / amax), fp8 = w * (448 / amax)."""
    rows, cols = w.shape
    gr, gc = math.ceil(rows / BLOCK), math.ceil(cols / BLOCK)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    inv = torch.empty(gr, gc)
    for i in range(gr):
        for j in range(gc):
            blk = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK].float()
            scale = 448.0 / blk.abs().max()
            inv[i, j] = 1.0 / scale
            q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = (blk * scale).clamp(-448, 448).to(q.dtype)
    return q, inv


def _dequantize(q: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    s = inv.repeat_interleave(BLOCK, 0)[: q.shape[0]].repeat_interleave(BLOCK, 1)[:, : q.shape[1]]
    return q.float() * s


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(FP8 checkpoint, its float32 dequantization) of a tiny DeepSeek-V3 saved by transformers: hidden 136 and
    a 200-wide dense MLP, so weights span one full and one partial 128 block."""
    import transformers as tf

    root = tmp_path_factory.mktemp("fp8")
    torch.manual_seed(0)
    cfg = tf.DeepseekV3Config(
        vocab_size=300, hidden_size=136, intermediate_size=200, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=40,
        n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=256,
        tie_word_embeddings=False, routed_scaling_factor=2.5)
    model = tf.DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():  # NOTE: non-trivial norms / router bias, so a swapped tensor cannot pass as equal
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.01 * torch.randn_like(b))
    model.save_pretrained(root / "saved")
    tensors = load_file(root / "saved" / "model.safetensors")
    config = json.loads((root / "saved" / "config.json").read_text())
    fp8, ref = {}, {}
    for name, t in tensors.items():
        if PUBLISHED_FP8.match(name):
            q, inv = _quantize(t)
            fp8[name], fp8[name + "_scale_inv"] = q, inv
            ref[name] = _dequantize(q, inv)
        else:
            fp8[name] = ref[name] = t
    for name, tensors_, cfg_ in (("fp8", fp8, {**config, "quantization_config": QUANT}), ("ref", ref, config)):
        (root / name).mkdir()
        save_file(tensors_, root / name / "model.safetensors", metadata={"format": "pt"})
        (root / name / "config.json").write_text(json.dumps(cfg_, indent=2))
    return root / "fp8", root / "ref"


def _recipe(tmp_path, hf_dir, parallel):
    r = {"backend": "megatron", "model": {"hf": str(hf_dir)}, "parallel": parallel,
         "data": {"format": "synthetic", "seq_length": 32},
         "train": {"stage": "cpt", "steps": 1, "global_batch_size": 2, "micro_batch_size": 2, "precision": "fp32",
                   "lr": 1e-3, "seed": 7},
         "checkpoint": {"load": str(hf_dir), "save_at_end": False}, "accelerator": "cpu",
         "logging": {"tensorboard": False}}
    path = tmp_path / "cpt.yaml"
    path.write_text(yaml.safe_dump(r))
    return path


def _first_step(*, rank, world, recipe_path, run_dir):
    """(step 1's micro-batches, its loss), in a rank."""
    recipe = loongforge.load_recipe(recipe_path)
    job, _ = loongforge.build_job(recipe, output_dir=run_dir)
    try:
        batches = job.schedule.microbatches(0, device=torch.device("cpu"))
        out = job.step()
    finally:
        job.close()
    return batches, out["loss"]


def test_online_tp2_first_step_loss_equals_the_dequantized_reference(tmp_path, ckpt, ranks, reference_loss):
    fp8, ref = ckpt
    out = ranks(_first_step, world=2, out=tmp_path / "ranks", recipe_path=_recipe(tmp_path, fp8, {"tp": 2, "sp": True}),
                run_dir=tmp_path / "run")
    batches, ours = out[0]
    assert ours == out[1][1]
    assert ours == pytest.approx(reference_loss(ref, batches), rel=1e-5)


def test_an_fp8_training_recipe_starts_from_the_fp8_checkpoint(tmp_path, ckpt, capsys):
    """``validate`` (what ``train`` runs first) accepts blockwise FP8 training from the FP8 checkpoint: its config is
    read for the model and its weights' headers (scales included) are checked against it."""
    fp8, _ = ckpt
    recipe = yaml.safe_load(_recipe(tmp_path, fp8, {"tp": 2, "sp": True}).read_text())
    recipe["train"]["fp8"] = {"recipe": "blockwise"}
    recipe["train"]["precision"] = "bf16"
    recipe.pop("accelerator")
    path = tmp_path / "fp8.yaml"
    path.write_text(yaml.safe_dump(recipe))
    capsys.readouterr()
    assert main(["validate", str(path)]) == 0, capsys.readouterr().err
    bad = _rewrite(fp8, tmp_path / "bad", tensors=lambda t: t.pop(S) is None)
    recipe["checkpoint"]["load"] = recipe["model"]["hf"] = str(bad)
    path.write_text(yaml.safe_dump(recipe))
    assert main(["validate", str(path)]) == 2
    assert f"has no '{S}'" in capsys.readouterr().err


def test_each_rank_dequantizes_only_its_slice(ckpt, monkeypatch):
    from loongforge_megatron.conversion import fp8_blocks, shard_state_dict_for_rank

    fp8, ref = ckpt
    readers = []
    init = fp8_blocks.Fp8Reader.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        readers.append(self)

    monkeypatch.setattr(fp8_blocks.Fp8Reader, "__init__", spy)
    with safe_open(fp8 / "model.safetensors", "pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys() if f.get_slice(k).get_dtype() == "F8_E4M3"}
    for rank in range(2):
        ours = shard_state_dict_for_rank(fp8, tp_rank=rank, tp_size=2, ep_rank=rank, ep_size=2, dtype=torch.float32)
        want = shard_state_dict_for_rank(ref, tp_rank=rank, tp_size=2, ep_rank=rank, ep_size=2, dtype=torch.float32)
        assert ours.keys() == want.keys() and all(torch.equal(ours[k], want[k]) for k in want)
        log = readers[-1].dequantized
        rows: dict[str, list[tuple[int, int]]] = {}
        for name, first, n in log:
            rows.setdefault(name, []).append((first, n))
        # column-parallel: just this rank's half of the rows (gate and up of a 200-wide MLP: rows 0..99 / 100..199)
        assert rows["model.layers.0.mlp.gate_proj.weight"] == [(100 * rank, 100)]
        assert rows["model.layers.0.self_attn.q_b_proj.weight"] == [(24 * rank, 24)]
        # routed experts: only this EP rank's two of the four
        experts = {int(m.group(1)) for name in rows if (m := re.search(r"experts\.(\d+)\.", name))}
        assert experts == {2 * rank, 2 * rank + 1}
        # row-parallel: just this rank's half of the columns
        cols = dict(readers[-1].dequantized_columns)
        assert cols["model.layers.0.self_attn.o_proj.weight"] == tuple(range(16 * rank, 16 * rank + 16))
        assert cols["model.layers.0.mlp.down_proj.weight"] == tuple(range(100 * rank, 100 * rank + 100))
        # no FP8 weight was dequantized whole: each is split over the two TP ranks
        assert all(n < shapes[name][0] for name, _, n in log), log
        assert all(len(c) < shapes[name][1] for name, c in cols.items())


def test_convert_equals_the_dequantized_checkpoint_and_exports_the_same_bytes(tmp_path, ckpt):
    from loongforge.checkpoint import SafetensorsReader
    from loongforge_megatron.conversion import hf_to_megatron, megatron_to_hf

    fp8, ref = ckpt
    for name, src in (("fp8", fp8), ("ref", ref)):
        hf_to_megatron(src, tmp_path / f"mg-{name}", tp=2, ep=2)
    files = sorted((tmp_path / "mg-ref").glob("mp_rank_*/model.safetensors"))
    assert len(files) == 4
    for path in files:
        want = load_file(path)
        got = load_file(tmp_path / "mg-fp8" / path.relative_to(tmp_path / "mg-ref"))
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), path

    assert main(["convert", str(tmp_path / "mg-fp8"), str(tmp_path / "back"), "--to", "hf", "--fp8"]) == 0
    back, orig = SafetensorsReader(tmp_path / "back"), SafetensorsReader(fp8)
    assert sorted(back.keys()) == sorted(orig.keys())
    for k in orig.keys():
        a, b = back.get(k), orig.get(k)
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a,
                                                  b.view(torch.uint8) if b.dtype.itemsize == 1 else b), k
    assert json.loads((tmp_path / "back" / "config.json").read_text())["quantization_config"] == QUANT

    plain = megatron_to_hf(tmp_path / "mg-fp8", tmp_path / "plain")
    assert "quantization_config" not in json.loads((plain / "config.json").read_text())
    got, want = SafetensorsReader(plain), SafetensorsReader(ref)
    assert sorted(got.keys()) == sorted(want.keys()) and all(torch.equal(got.get(k), want.get(k)) for k in want.keys())


def test_a_bf16_checkpoint_round_trips_its_fp8_bytes_through_a_float32_conversion(tmp_path, ckpt):
    """The published checkpoints say bf16: converted in bf16 their FP8 bytes come back and the scales within bf16's
    rounding; with ``--dequantize-dtype float32`` the scales too."""
    from loongforge.checkpoint import SafetensorsReader

    src = _rewrite(ckpt[0], tmp_path / "bf16", config=lambda c: c.update(dtype="bfloat16"))
    for dtype in ("bfloat16", "float32"):
        flags = [] if dtype == "bfloat16" else ["--dequantize-dtype", dtype]
        assert main(["convert", str(src), str(tmp_path / f"mg-{dtype}"), "--to", "megatron", *flags]) == 0
        rank0 = load_file(tmp_path / f"mg-{dtype}" / "mp_rank_00_000_000" / "model.safetensors")
        assert rank0["decoder.layers.0.mlp.linear_fc1.weight"].dtype == getattr(torch, dtype)
        assert main(["convert", str(tmp_path / f"mg-{dtype}"), str(tmp_path / f"back-{dtype}"), "--to", "hf",
                     "--fp8"]) == 0
        back, orig = SafetensorsReader(tmp_path / f"back-{dtype}"), SafetensorsReader(src)
        for k in orig.keys():
            a, b = back.get(k), orig.get(k)
            if k.endswith("_scale_inv") and dtype == "bfloat16":
                assert torch.allclose(a, b, rtol=2**-8, atol=0), k
            else:
                assert torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a,
                                   b.view(torch.uint8) if b.dtype.itemsize == 1 else b), k
    assert main(["convert", str(src), str(tmp_path / "x"), "--to", "hf", "--dequantize-dtype", "float32"]) == 2
    assert main(["convert", str(src), str(tmp_path / "x"), "--to", "megatron", "--fp8"]) == 2


def test_an_export_quantizes_trained_weights_per_block(tmp_path, ckpt):
    """Weights that are not an FP8 checkpoint's dequantization get ``amax / 448`` per block (the partial edge
    block too), and dequantize back to within FP8's precision."""
    from loongforge_megatron.conversion.fp8_blocks import dequantize, quantize

    w = torch.randn(200, 136) * 0.02
    q, scale = quantize(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (2, 2)
    assert torch.equal(scale[1, 1], w[128:, 128:].abs().max() / 448)
    assert (dequantize(q, scale, block=(BLOCK, BLOCK)) - w).abs().max() <= w.abs().max() / 16


# NOTE: MiniMax-M2's published FP8 layout: attention projections and the experts' w1 / w2 / w3; its config names
# e4m3 "float8_e4m3fn" and keeps the router, its bias and the head unquantized
M2_FP8 = re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|block_sparse_moe\.experts\.\d+\.w[123])\.weight$")
M2_QUANT = {"activation_scheme": "dynamic", "fmt": "float8_e4m3fn", "quant_method": "fp8",
            "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]}


def test_minimax_m2_fp8_checkpoint_converts_like_its_dequantization_and_exports_its_own_layout(tmp_path):
    """A MiniMax-M2 checkpoint in its published FP8 layout (experts' w1 / w2 / w3 quantized too) converts to the
    megatron shards of its dequantized copy (tp 2 ep 2), and ``convert --to hf --fp8`` writes the same tensors,
    bytes and quantization_config back."""
    import transformers as tf
    from loongforge.checkpoint import SafetensorsReader
    from loongforge_megatron.conversion import hf_to_megatron

    torch.manual_seed(0)
    cfg = tf.MiniMaxM2Config(vocab_size=300, hidden_size=136, intermediate_size=40, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=4,
                             num_experts_per_tok=2, rotary_dim=16, max_position_embeddings=128)
    model = tf.MiniMaxM2ForCausalLM(cfg)
    model.save_pretrained(tmp_path / "saved")
    tensors = load_file(tmp_path / "saved" / "model.safetensors")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    fp8, ref = {}, {}
    for name, t in tensors.items():
        if M2_FP8.match(name):
            q, inv = _quantize(t)
            fp8[name], fp8[name + "_scale_inv"] = q, inv
            ref[name] = _dequantize(q, inv)
        else:
            fp8[name] = ref[name] = t
    assert sum(1 for n in fp8 if n.endswith(".w1.weight_scale_inv")) == 8
    for name, tensors_, cfg_ in (("fp8", fp8, {**config, "quantization_config": M2_QUANT}), ("ref", ref, config)):
        (tmp_path / name).mkdir()
        save_file(tensors_, tmp_path / name / "model.safetensors", metadata={"format": "pt"})
        (tmp_path / name / "config.json").write_text(json.dumps(cfg_, indent=2))
        hf_to_megatron(tmp_path / name, tmp_path / f"mg-{name}", tp=2, ep=2)
    for path in sorted((tmp_path / "mg-ref").glob("mp_rank_*/model.safetensors")):
        want, got = load_file(path), load_file(tmp_path / "mg-fp8" / path.relative_to(tmp_path / "mg-ref"))
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), path
    assert main(["convert", str(tmp_path / "mg-fp8"), str(tmp_path / "back"), "--to", "hf", "--fp8"]) == 0
    back, orig = SafetensorsReader(tmp_path / "back"), SafetensorsReader(tmp_path / "fp8")
    assert sorted(back.keys()) == sorted(orig.keys())
    for k in orig.keys():
        a, b = back.get(k), orig.get(k)
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a,
                                                  b.view(torch.uint8) if b.dtype.itemsize == 1 else b), k
    assert json.loads((tmp_path / "back" / "config.json").read_text())["quantization_config"] == M2_QUANT


def _rewrite(src, dst, *, tensors=None, config=None):
    shutil.copytree(src, dst)
    if tensors is not None:
        t = load_file(dst / "model.safetensors")
        tensors(t)
        save_file(t, dst / "model.safetensors", metadata={"format": "pt"})
    if config is not None:
        c = json.loads((dst / "config.json").read_text())
        config(c)
        (dst / "config.json").write_text(json.dumps(c))
    return dst


W = "model.layers.0.mlp.gate_proj.weight"
S = W + "_scale_inv"
BAD_FILES = {
    "missing-scale": (dict(tensors=lambda t: t.pop(S) is None), f"FP8 tensor '{W}' has no '{S}'"),
    "scale-shape": (dict(tensors=lambda t: t.update({S: torch.ones(1, 2)})), f"'{S}' has shape (1, 2)"),
    "scale-narrow": (dict(tensors=lambda t: t.update({S: torch.ones(2, 1)})), "needs (2, 2)"),
    "scale-int": (dict(tensors=lambda t: t.update({S: torch.ones(2, 2, dtype=torch.int32)})), "float32 scales"),
    "scale-of-bf16": (dict(tensors=lambda t: t.update({W: t[W].float()})), "not float8_e4m3fn"),
    "orphan-scale": (dict(tensors=lambda t: t.update({"model.norm.weight_x_scale_inv": torch.ones(1)})),
                     "has no weight"),
    "e5m2": (dict(tensors=lambda t: t.update({W: t[W].to(torch.float8_e5m2)})), "stored as float8_e5m2"),
    "no-quant-config": (dict(config=lambda c: c.pop("quantization_config")), "no quantization_config"),
    "method-awq": (dict(config=lambda c: c["quantization_config"].update(quant_method="awq")),
                   "'quantization_config.quant_method' is 'awq'"),
    "fmt-e5m2": (dict(config=lambda c: c["quantization_config"].update(fmt="e5m2")), "'quantization_config.fmt'"),
    "block-one-dim": (dict(config=lambda c: c["quantization_config"].update(weight_block_size=[128])),
                      "'quantization_config.weight_block_size' is [128]"),
    "block-zero": (dict(config=lambda c: c["quantization_config"].update(weight_block_size=[0, 128])),
                   "weight_block_size"),
    "block-64": (dict(config=lambda c: c["quantization_config"].update(weight_block_size=[64, 64])),
                 "in 64x64 blocks needs"),
    "block-null": (dict(config=lambda c: c["quantization_config"].update(weight_block_size=None)),
                   "per-tensor FP8 scales are not read"),
    "static": (dict(config=lambda c: c["quantization_config"].update(activation_scheme="static")),
               "activation_scheme"),
    "quant-config-list": (dict(config=lambda c: c.update(quantization_config=[1])), "expected an object"),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_bad_fp8_files_are_one_line_errors(tmp_path, ckpt, case, capsys):
    change, says = BAD_FILES[case]
    bad = _rewrite(ckpt[0], tmp_path / "bad", **change)
    capsys.readouterr()
    assert main(["convert", str(bad), str(tmp_path / "out"), "--to", "megatron"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and says in err and str(bad) in err, err
    from loongforge_megatron.conversion import shard_state_dict_for_rank

    with pytest.raises(CheckpointError, match=re.escape(says)):
        shard_state_dict_for_rank(bad, tp_rank=0, tp_size=1)
