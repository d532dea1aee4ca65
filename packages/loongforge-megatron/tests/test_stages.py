"""Training stages: SFT masks prompt tokens and packing does not change the loss; LoRA trains only adapters and
its merged export equals W + (alpha/r)·B A.

NOTE: every megatron job here runs in a rank (``ranks``) or a subprocess, never in pytest's own process:
megatron-core's process-wide state would leak into later tests."""

from __future__ import annotations

import json

import loongforge
import pytest
import torch
import yaml

RECORDS = [
    {"instruction": "Add the numbers", "input": "2 and 3", "output": "five"},
    {"instruction": "Say hello", "output": "hello there, friend"},
    {"conversations": [{"from": "human", "value": "What is a list?"}, {"from": "gpt", "value": "an ordered sequence"},
                       {"from": "human", "value": "and a tuple?"}, {"from": "gpt", "value": "an immutable one"}]},
    {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "name a colour"},
                  {"role": "assistant", "content": "blue"}]},
    {"instruction": "Reverse abc", "output": "cba"},
    {"instruction": "Count to three", "output": "one two three"},
]


@pytest.fixture(scope="module")
def sft_tokenizer(tmp_path_factory):
    from loongforge_megatron.data.tokenizer import train_bpe

    out = tmp_path_factory.mktemp("tok")
    text = [json.dumps(r) for r in RECORDS] * 20 + ["user assistant system hello numbers colour"] * 20
    train_bpe(text, vocab_size=300, out_dir=out)
    return out


def write_recipe(tmp_path, body: dict) -> str:
    base = {
        "backend": "megatron",
        "model": {"preset": "llama-tiny"},
        "train": {"steps": 1, "micro_batch_size": 1, "precision": "fp32", "lr": 1e-3, "seed": 3},
        "checkpoint": {"save_at_end": False},
        "accelerator": "cpu",
        "logging": {"tensorboard": False},
    }
    for k, v in body.items():
        base[k] = {**base.get(k, {}), **v} if isinstance(v, dict) else v
    path = tmp_path / f"r{len(list(tmp_path.iterdir()))}.yaml"
    path.write_text(yaml.safe_dump(base))
    return str(path)


def sft_data(tmp_path, tok, *, pack: bool) -> dict:
    src = tmp_path / "sft.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in RECORDS))
    return {"format": "sft", "path": str(tmp_path / f"sft-{pack}"), "seq_length": 128, "tokenizer": str(tok),
            "source": {"kind": "jsonl", "paths": [str(src)]}, "pack": pack}


def test_prompt_tokens_carry_no_loss(tmp_path, sft_tokenizer):
    from loongforge_megatron.data.datasets import PackedSFTDataset
    from loongforge_megatron.data.prepare import prepare
    from loongforge_megatron.data.tokenizer import load_tokenizer

    recipe = loongforge.load_recipe(write_recipe(tmp_path, {"data": sft_data(tmp_path, sft_tokenizer, pack=False),
                                                             "train": {"stage": "sft", "global_batch_size": 6}}))
    prepare(recipe)
    tok = load_tokenizer(sft_tokenizer)
    ds = PackedSFTDataset(recipe.data.path, seq_length=128, pad_id=tok.pad_token_id, pack=False)
    assert len(ds) == len(RECORDS)
    for i, rec in enumerate(RECORDS):
        item = ds[i]
        trained = tok.decode(item["labels"][item["loss_mask"] > 0])
        ignored = tok.decode(item["labels"][(item["loss_mask"] == 0) & (item["tokens"] != tok.pad_token_id)])
        answers = ([rec["output"]] if "output" in rec else
                   [m.get("value", m.get("content")) for m in rec.get("conversations", rec.get("messages", []))
                    if m.get("from", m.get("role")) in ("gpt", "assistant")])
        prompts = ([rec["instruction"]] if "instruction" in rec else
                   [m.get("value", m.get("content")) for m in rec.get("conversations", rec.get("messages", []))
                    if m.get("from", m.get("role")) not in ("gpt", "assistant")])
        for a in answers:
            assert a in trained
        for p in prompts:
            assert p not in trained and p in ignored


def _sft_loss(*, rank, world, recipe_path, run_dir):
    """One SFT step's loss, in a rank (``ranks``): the megatron job never runs in pytest's process."""
    job, _ = loongforge.build_job(loongforge.load_recipe(recipe_path), output_dir=run_dir)
    try:
        return job.step()["loss"]
    finally:
        job.close()


def test_packed_and_unpacked_losses_are_equal(tmp_path, sft_tokenizer, ranks):
    losses = {}
    for pack in (False, True):
        data = sft_data(tmp_path, sft_tokenizer, pack=pack)
        from loongforge_megatron.data.datasets import PackedSFTDataset
        from loongforge_megatron.data.prepare import prepare

        probe = loongforge.load_recipe(write_recipe(tmp_path, {"data": data, "train": {"stage": "sft", "global_batch_size": 1}}))
        prepare(probe)
        rows = len(PackedSFTDataset(data["path"], seq_length=128, pad_id=0, pack=pack))
        # one global batch holds every row, so both runs see exactly the same (token, label) pairs
        recipe_path = write_recipe(tmp_path, {"data": data, "train": {"stage": "sft", "global_batch_size": rows}})
        losses[pack] = ranks(_sft_loss, world=1, out=tmp_path / f"ranks-{pack}", recipe_path=recipe_path,
                             run_dir=tmp_path / f"run-{pack}")[0]
        if pack:
            assert rows < len(RECORDS)
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)


def test_packed_rows_restart_positions_at_every_sample(tmp_path, sft_tokenizer):
    """Packed rows carry their samples' boundaries (multiples of pad_to = 2 * cp) and positions restart at each."""
    from loongforge_megatron.data.datasets import PackedSFTDataset
    from loongforge_megatron.data.prepare import prepare

    data = sft_data(tmp_path, sft_tokenizer, pack=True)
    prepare(loongforge.load_recipe(write_recipe(tmp_path, {"data": data, "train": {"stage": "sft", "global_batch_size": 1}})))
    ds = PackedSFTDataset(data["path"], seq_length=128, pad_id=0, pack=True, pad_to=4)
    lengths = [len(ds.tokens[i]) for i in range(len(ds.tokens))]
    assert len(ds) < len(lengths) and 0 < ds.efficiency < 1
    real = 0
    for i in range(len(ds)):
        row = ds[i]
        bounds = row["cu_seqlens"].tolist()
        assert bounds[0] == 0 and bounds[-1] == 128 and all(b % 4 == 0 for b in bounds)
        assert len(bounds) == len(ds.rows[i]) + 1
        for a, b, sample in zip(bounds, bounds[1:-1] + [None], ds.rows[i], strict=False):
            n = min(lengths[sample], 128 - a)
            assert row["position_ids"][a : a + n].tolist() == list(range(n))  # restarts at every sample
            if b is not None:  # its last label (padding or the next sample's first token) is never trained
                assert row["loss_mask"][a + n - 1 : b].sum() == 0
        real += int(row["num_tokens"])
    assert real == sum(lengths)  # every sample fits a row of 128 here


def _sft_cp_loss(*, rank, world, recipe_path, run_dir):
    job, _ = loongforge.build_job(loongforge.load_recipe(recipe_path), output_dir=run_dir)
    try:
        metrics = job.step()
        return metrics["loss"], metrics.get("packing_efficiency")
    finally:
        job.close()


def _sft_recipe(tmp_path, tok, *, pack: bool, layout: str = "cp", world: int = 1) -> str:
    """The recipe of one SFT step over every row once (pp: two rows per micro-batch, every row twice: the
    token-weighted mean is the same)."""
    from loongforge_megatron.data.datasets import PackedSFTDataset
    from loongforge_megatron.data.prepare import prepare

    data = sft_data(tmp_path, tok, pack=pack)
    prepare(loongforge.load_recipe(write_recipe(tmp_path, {"data": data, "train": {"stage": "sft", "global_batch_size": 1}})))
    pad_to = 2 * world if pack and layout == "cp" else 1
    rows = len(PackedSFTDataset(data["path"], seq_length=128, pad_id=0, pack=pack, pad_to=pad_to))
    mbs = 2 if pack and layout == "pp" else 1
    return write_recipe(tmp_path, {"data": data, "parallel": {layout: world},
                                   "train": {"stage": "sft", "global_batch_size": rows * mbs, "micro_batch_size": mbs}})


@pytest.fixture(scope="module")
def unpacked_sft(tmp_path_factory, sft_tokenizer, ranks):
    """(loss, packing efficiency) of one process on one sample per row."""
    tmp = tmp_path_factory.mktemp("unpacked")
    recipe = _sft_recipe(tmp, sft_tokenizer, pack=False)
    return ranks(_sft_cp_loss, world=1, out=tmp / "ranks", recipe_path=recipe, run_dir=tmp / "run")[0]


@pytest.mark.parametrize("layout", ["cp", "pp"])
def test_packed_sft_on_two_ranks_equals_one_process(tmp_path, sft_tokenizer, ranks, unpacked_sft, layout):
    """cp 2 (every sample padded to a multiple of 4 and split in mirrored chunks) or pp 2 (packed rows sent between
    stages as one row of micro_batch_size * seq_length tokens) on two gloo ranks gives the loss of one process on
    the unpacked rows; the step logs its packing efficiency."""
    recipe = _sft_recipe(tmp_path, sft_tokenizer, pack=True, layout=layout, world=2)
    unpacked, eff_unpacked = unpacked_sft
    for loss, eff in ranks(_sft_cp_loss, world=2, out=tmp_path / "ranks", recipe_path=recipe, run_dir=tmp_path / "run"):
        assert loss == pytest.approx(unpacked, rel=1e-5)
        assert eff_unpacked < eff < 1  # packing filled the rows better than one sample per row


def _lora_train_and_merge(*, rank, world, recipe_path, run_dir, export_dir, hf_dir):
    """The LoRA job and its checks, in a rank (``ranks``): the megatron job never runs in pytest's process."""
    from loongforge_megatron.lora import LoRAParallelLinear, merged_state_dict
    from safetensors.torch import load_file

    job, _ = loongforge.build_job(loongforge.load_recipe(recipe_path), output_dir=run_dir)
    try:
        module = job.chunks[0]
        before = {k: v.clone() for k, v in module.state_dict().items() if "_extra_state" not in k}
        for _ in range(3):
            job.step()
        after = {k: v for k, v in module.state_dict().items() if "_extra_state" not in k}
        changed = {k for k in before if not torch.equal(before[k], after[k])}
        assert changed and all(".lora_A" in k or ".lora_B" in k for k in changed), sorted(changed)[:5]
        assert any(".lora_B" in k for k in changed)
        layer = module.decoder.layers[0].self_attention.linear_proj
        assert isinstance(layer, LoRAParallelLinear)
        expected = layer.base.weight + (8 / 4) * layer.lora_B @ layer.lora_A
        merged = merged_state_dict(module)
        assert torch.allclose(merged["decoder.layers.0.self_attention.linear_proj.weight"], expected, rtol=0, atol=1e-6)
        job.export("hf", export_dir)
        exported = load_file(export_dir / "model.safetensors")
        assert torch.allclose(exported["model.layers.0.self_attn.o_proj.weight"], expected, rtol=0, atol=1e-6)
        base_hf = load_file(hf_dir / "model.safetensors")
        assert not torch.equal(exported["model.layers.0.self_attn.o_proj.weight"], base_hf["model.layers.0.self_attn.o_proj.weight"])
        assert torch.equal(exported["model.embed_tokens.weight"], base_hf["model.embed_tokens.weight"])
    finally:
        job.close()


def _lora_recipe(tmp_path, hf_dir, *, steps: int, **checkpoint):
    """A LoRA recipe on the tiny HF Llama in ``hf_dir`` (synthetic data, adapters on every linear)."""
    return write_recipe(tmp_path, {
        "model": {"hf": str(hf_dir), "preset": None},
        "data": {"format": "synthetic", "seq_length": 32},
        "train": {"stage": "lora", "steps": steps, "global_batch_size": 2, "lr": 5e-2,
                  "lora": {"rank": 4, "alpha": 8, "targets": ["qkv", "proj", "fc1", "fc2"]}},
        "checkpoint": {"load": str(hf_dir), **checkpoint},
    })


def test_lora_trains_only_adapters_and_merges(tmp_path, tiny_hf, ranks):
    hf_dir = tiny_hf("llama", tmp_path / "hf")
    recipe_path = _lora_recipe(tmp_path, hf_dir, steps=3)
    ranks(_lora_train_and_merge, world=1, out=tmp_path / "ranks", recipe_path=recipe_path, run_dir=tmp_path / "run",
          export_dir=tmp_path / "export", hf_dir=hf_dir)


def test_lora_peft_export_reproduces_merged_export(tmp_path, tiny_hf):
    """The PEFT export is base + (alpha/r)·B A of the merged export, and PEFT itself loads it: its adapter
    tensors are ours, and its merged model gives the merged export's logits."""
    import subprocess
    import sys

    import transformers as tf
    from peft import PeftModel
    from safetensors.torch import load_file

    hf_dir = tiny_hf("llama", tmp_path / "hf")
    recipe_path = _lora_recipe(tmp_path, hf_dir, steps=2, save_format=["hf", "peft"], save_at_end=True)
    # NOTE: a subprocess, as a user runs it: the megatron job stays out of pytest's process
    proc = subprocess.run([sys.executable, "-m", "loongforge", "train", recipe_path, "--output", str(tmp_path / "run")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    merged_dir, peft_dir = tmp_path / "run" / "hf", tmp_path / "run" / "peft"
    merged = load_file(merged_dir / "model.safetensors")
    base = load_file(hf_dir / "model.safetensors")
    adapters = load_file(peft_dir / "adapter_model.safetensors")
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    adapted = set()
    for name in sorted(merged):
        prefix = "base_model.model." + name[: -len("weight")]
        if prefix + "lora_A.weight" not in adapters:
            assert torch.equal(merged[name], base[name]), name
            continue
        a, b = adapters[prefix + "lora_A.weight"], adapters[prefix + "lora_B.weight"]
        want = base[name] + (8 / 4) * b @ a
        assert torch.allclose(merged[name], want, rtol=0, atol=1e-5), name
        adapted.add(name.split(".")[-2])
    assert adapted == set(config["target_modules"])

    peft_model = PeftModel.from_pretrained(tf.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32),
                                           peft_dir)
    # PEFT names its tensors <ours without .weight>.<adapter name>.weight; every one of ours must land, unchanged
    loaded = {k.replace(".default.weight", ".weight"): v for k, v in peft_model.state_dict().items() if ".lora_" in k}
    assert sorted(loaded) == sorted(adapters)
    for k, t in adapters.items():
        assert torch.equal(loaded[k], t), k
    peft_merged = peft_model.merge_and_unload().eval()
    ours = tf.AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want_logits, got_logits = ours(input_ids=tokens).logits, peft_merged(input_ids=tokens).logits
    assert not torch.allclose(want_logits, tf.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
                              .eval()(input_ids=tokens).logits, rtol=0, atol=1e-4)  # the adapters changed the model
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)
