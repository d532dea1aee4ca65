"""LLaVA (VLM) on megatron-core: CPT from a checkpoint transformers saved gives transformers' first-step loss (fp32),
TP 2 gives the one-process losses, and the tiny recipe's loss falls on its synthetic image-caption data.

NOTE: every megatron job here runs in a rank (``ranks``) or a subprocess, never in pytest's own process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import loongforge
import pytest
import torch
import yaml

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "vlm" / "llava_tiny.yaml"
IMAGE_TOKEN, IMAGE_SEQ = 255, 16


def save_llava(out: Path, *, vocab: int = 256, image_token: int = IMAGE_TOKEN) -> Path:
    """A tiny LlavaForConditionalGeneration with every weight perturbed (no norm left at 1, no bias at 0)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                              image_size=32, patch_size=8, hidden_act="quick_gelu")
    text = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                       tie_word_embeddings=False)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token,
                      projector_hidden_act="gelu", vision_feature_layer=-2, vision_feature_select_strategy="default",
                      image_seq_length=IMAGE_SEQ, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm = name.endswith("norm.weight") or "layer_norm" in name or "layrnorm" in name
            p.copy_((1.0 if norm else 0.0) + 0.1 * torch.randn(p.shape, generator=g))
    model.save_pretrained(out)
    return out


def hf_batch(batches: list[dict], image_token: int = IMAGE_TOKEN) -> dict[str, torch.Tensor]:
    """Our micro-batches (one image token per image, GPT-shifted labels + loss mask) as one HF batch: the image
    token expanded to its embeddings, labels unshifted at the expanded positions (-100 elsewhere). megatron never
    trains the position after the image (its loss mask there is forced to 0), so neither does the HF batch."""
    ids, labels = [], []
    for b in batches:
        for tokens, lab, mask in zip(b["tokens"], b["labels"], b["loss_mask"], strict=True):
            row_ids, targets = [], {}
            for t, y, m in zip(tokens.tolist(), lab.tolist(), mask.tolist(), strict=True):
                image = t == image_token
                row_ids += [t] * (IMAGE_SEQ if image else 1)
                if m and not image:
                    targets[len(row_ids)] = y  # predicted at this token's (last) position: HF's label one later
            ids.append(row_ids)
            labels.append([targets.get(i, -100) for i in range(len(row_ids))])
    return {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels),
            "pixel_values": torch.cat([b["images"] for b in batches])}


def cpt_overrides(hf_dir: Path, *extra: str) -> list[str]:
    """Continue training the HF checkpoint ``hf_dir`` for 2 steps on CPU (no warmup, quiet)."""
    return [f"model={{hf: {hf_dir}}}", f"checkpoint.load={hf_dir}", "train.stage=cpt", "train.steps=2",
            "train.warmup_steps=0", "accelerator=cpu", "logging.console=false", *extra]


def _first_step_child(*, rank, world, overrides, run_dir) -> tuple[list[dict], float]:
    job, runtime = loongforge.build_job(loongforge.load_recipe(RECIPE, overrides), output_dir=run_dir)
    try:
        batches = job.schedule.microbatches(0, device=torch.device("cpu"))
        return batches, job.step()["loss"]
    finally:
        job.close()
        runtime.logger.close()


def first_step(ranks, tmp_path: Path, overrides: list[str]) -> tuple[list[dict], float]:
    """(the micro-batches of step 1, our loss of step 1), from a job in a rank (``ranks``)."""
    return ranks(_first_step_child, world=1, out=tmp_path / "ranks", overrides=overrides, run_dir=tmp_path / "run")[0]


def hf_loss(hf_dir: Path, batch: dict[str, torch.Tensor]) -> float:
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(**batch).loss.item()


@pytest.mark.parametrize("spec", ["loongforge", "local"])
def test_cpt_first_step_loss_equals_transformers(tmp_path, spec, ranks):
    """Both layer specs: ours (SDPA attention for CLIP and the LM, kernel RMSNorm / SwiGLU / RoPE; what auto picks)
    and megatron's local one."""
    hf_dir = save_llava(tmp_path / "hf")
    batches, ours = first_step(ranks, tmp_path, cpt_overrides(hf_dir, f"kernels.layers={spec}"))
    ref = hf_loss(hf_dir, hf_batch(batches))
    assert ours == pytest.approx(ref, rel=1e-5), (ours, ref)


def _train(out: Path, *overrides: str, nproc: int = 1) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "loongforge", "train", str(RECIPE), "--output", str(out), "--nproc", str(nproc),
           "accelerator=cpu", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_tp2_matches_one_process_and_the_loss_falls(tmp_path):
    one = _train(tmp_path / "one", "logging.interval=1")
    two = _train(tmp_path / "tp2", "logging.interval=1", "parallel.tp=2", nproc=2)
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-5)
    assert one[-1]["loss"] < 0.7 * one[0]["loss"], (one[0]["loss"], one[-1]["loss"])
    recipe = yaml.safe_load((tmp_path / "tp2" / "recipe.yaml").read_text())
    assert recipe["model"]["preset"] == "llava-tiny" and recipe["parallel"]["tp"] == 2


LAYOUTS = {
    # stage 0: CLIP, the projector, the embedding and LM layer 0; stage 1: LM layer 1 and the head
    "pp2": ["parallel.pp=2"],
    # heterogeneous: the language model split over 2 TP ranks, the vision tower whole on each of them, the two
    # copies encoding different images of each micro-batch
    "tp2_vision_tp1": ["parallel.tp=2", "parallel.components={vision: {tp: 1}}"],
}


CPT4 = ["train.stage=cpt", "train.steps=4", "train.warmup_steps=0", "train.lr_schedule=constant",
        "logging.interval=1", "checkpoint.save_format=[hf]"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """(HF dir, its 4-step single-process run directory, that run's metrics)."""
    root = tmp_path_factory.mktemp("llava_layouts")
    hf_dir = save_llava(root / "hf")
    load = [f"model={{hf: {hf_dir}}}", f"checkpoint.load={hf_dir}"]
    return hf_dir, root / "one", _train(root / "one", *load, *CPT4, "checkpoint.save_at_end=true")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_matches_one_process_resumes_exactly_and_exports_the_same(tmp_path, layout, one_process):
    """From the same HF weights, two processes in ``layout`` train the single-process losses; their HF export
    (gathered from both ranks) equals the single-process export; and a run stopped after a checkpoint at step 2
    and resumed (same run directory) gives bitwise the uninterrupted run's losses of steps 3-4."""
    from safetensors.torch import load_file

    hf_dir, one_dir, one = one_process
    over = [f"model={{hf: {hf_dir}}}", f"checkpoint.load={hf_dir}", *CPT4, *LAYOUTS[layout]]
    # NOTE: dist checkpoints too (CPT4 exports hf only): the resume below must have something to resume from.
    two = _train(tmp_path / "straight", *over, "checkpoint.save_at_end=true", "checkpoint.save_interval=2",
                 "checkpoint.save_format=[dist,hf]", nproc=2)
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-5)
    assert one[-1]["loss"] < one[0]["loss"]
    if layout == "tp2_vision_tp1":  # NOTE: encoder hetero-DP: each CLIP copy encodes its own images, timed per rank
        assert all({"encoder_time_r0", "encoder_time_r1"} <= set(r) for r in two), two[0]
    exported = [load_file(next((d / "hf").glob("*.safetensors"))) for d in (one_dir, tmp_path / "straight")]
    assert exported[0].keys() == exported[1].keys()
    # NOTE: atol 1e-4 of 4 steps x lr 3e-3: where a gradient is ~0 (single weights), Adam normalises rounding noise
    # of the layout's reduction order into lr-sized steps. CLIP's key biases have an exactly-zero gradient (softmax
    # cancels a per-query constant), so their steps are that noise alone: bounded by lr per step, 4 x 3e-3.
    for name, tensor in exported[0].items():
        atol = 4 * 3e-3 if name.endswith("self_attn.k_proj.bias") else 1e-4
        torch.testing.assert_close(exported[1][name], tensor, rtol=0, atol=atol, msg=name)

    # NOTE: "stopped after step 2": a copy of the run directory without its step-4 checkpoint (and metrics), so
    # the resume reads the step-2 checkpoint the straight run wrote (one 2-process start instead of two).
    split = tmp_path / "split"
    shutil.copytree(tmp_path / "straight", split)
    shutil.rmtree(split / "checkpoints" / "step_00000004")
    (split / "checkpoints" / "latest").unlink()
    kept = [line for line in (split / "metrics.jsonl").read_text().splitlines() if json.loads(line)["step"] <= 2]
    (split / "metrics.jsonl").write_text("\n".join(kept) + "\n")
    resumed = _train(split, *over, "checkpoint.save_format=[dist,hf]", nproc=2)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]  # steps 1-2 kept, 3-4 resumed (a restart appends 1-4)
    assert [r["loss"] for r in resumed if r["step"] > 2] == [r["loss"] for r in two if r["step"] > 2]


def test_unsupported_layouts_are_refused(capsys):
    from loongforge.cli import main

    for override, key in (("parallel.cp=2", "parallel.cp"), ("parallel.sp=true", "parallel.sp"),
                          ("parallel.components={vision: {tp: 1, pp: 2}}", "parallel.components.vision.pp"),
                          ("parallel.components={audio: {tp: 1}}", "parallel.components.audio"),
                          ("train.stage=lora", "train.stage"), ("kernels.layers=te", "kernels.layers")):
        assert main(["validate", str(RECIPE), override, "parallel.tp=2" if "sp" in override else "train.seed=1",
                     "--world-size", "2"]) == 2
        err = capsys.readouterr().err
        assert f"key '{key}'" in err and err.count("\n") == 1, err


def _layouts_and_encoded_images(*, rank, world, layouts, run_dir, ports):
    """For each (name, overrides): every step's loss, the images this rank's CLIP tower ran on in step 1 (each
    image's pixel sum, rounded), the order of its tower ("t") and language decoder ("d") forwards then, and the
    last step's metrics. Each job rendezvouses on its own port (a job's close ends the world)."""
    out = {}
    for (name, over), port in zip(layouts, ports, strict=True):
        os.environ["MASTER_PORT"] = str(port)
        job, runtime = loongforge.build_job(loongforge.load_recipe(RECIPE, over), output_dir=run_dir / name)
        try:
            seen, order = [], []
            chunk = job.chunks[0]
            hooks = [chunk.language_model.decoder.register_forward_pre_hook(
                lambda m, args, order=order: order.append("d"))]
            if chunk.add_encoder:  # NOTE: the patch convolution runs only when the tower really encodes
                hooks.append(chunk.vision_model.conv1.register_forward_pre_hook(
                    lambda m, args, seen=seen, order=order:
                    seen.extend(round(float(x), 3) for x in args[0].flatten(1).sum(1)) or order.append("t")))
            losses, metrics = [], {}
            for i in range(job.recipe.train.steps):
                metrics = job.step()
                losses.append(metrics["loss"])
                if i == 0:
                    for hook in hooks:
                        hook.remove()
            out[name] = (losses, seen, "".join(order), metrics)
        finally:
            job.close()
            runtime.logger.close()
    return out


def test_decoupled_encoder_under_pp2_equals_one_process(tmp_path, ranks, free_port):
    """Language pp 2 with parallel.components.vision.decoupled: the first stage runs the CLIP tower on all four
    micro-batches of a step before the pipeline
    schedule's first forward (each image once; the second stage encodes none) and sends the embeddings' gradients
    back through it after the last backward; 5 steps equal one process's losses, trained and with train.freeze
    [vision]."""
    hf_dir = save_llava(tmp_path / "hf")
    over = cpt_overrides(hf_dir, "train.steps=5")
    frozen = [*over, "train.freeze=[vision]"]
    layouts = [("whole", over), ("frozen", frozen)]
    one = ranks(_layouts_and_encoded_images, world=1, out=tmp_path / "r1", run_dir=tmp_path / "one",
                layouts=layouts, ports=[free_port() for _ in layouts])[0]
    pp2 = [(f"pp2_{name}", [*o, "parallel.pp=2", "parallel.components.vision.decoupled=true"])
           for name, o in layouts]
    two = ranks(_layouts_and_encoded_images, world=2, out=tmp_path / "r2", run_dir=tmp_path / "two",
                layouts=pp2, ports=[free_port() for _ in pp2], timeout_s=150)
    assert one["whole"][2] == "td" * 4  # NOTE: one process encodes inside each micro-batch's forward
    for name, _ in layouts:
        for r in range(2):
            got = two[r][f"pp2_{name}"][0]
            assert got == pytest.approx(one[name][0], rel=1e-5), (name, r, got, one[name][0])
        assert sorted(two[0][f"pp2_{name}"][1]) == sorted(one["whole"][1]) and len(one["whole"][1]) == 8, name
        assert two[1][f"pp2_{name}"][1] == [] and two[0][f"pp2_{name}"][2] == "tttt" + "dddd", two[0][f"pp2_{name}"]
    assert one["frozen"][0] != pytest.approx(one["whole"][0], rel=1e-5)


def _own_rank_runs(*, rank, world, layouts, run_dir, ports):
    """For each (name, overrides): every step's loss, the images this rank's CLIP tower ran on in step 1 (pixel
    sums, rounded; None: this rank holds no tower) and the HF export after the steps."""
    out = {}
    for (name, over), port in zip(layouts, ports, strict=True):
        os.environ["MASTER_PORT"] = str(port)
        job, runtime = loongforge.build_job(loongforge.load_recipe(RECIPE, over), output_dir=run_dir / name)
        try:
            tower = getattr(job.chunks[0], "vision_model", None)
            seen = None if tower is None else []
            hook = tower.conv1.register_forward_pre_hook(
                lambda m, args, seen=seen: seen.extend(round(float(x), 3) for x in args[0].flatten(1).sum(1))) \
                if tower is not None else None
            losses = []
            for _ in range(job.recipe.train.steps):
                losses.append(job.step()["loss"])
                if hook is not None:
                    hook.remove()
                    hook = None
            job.export("hf", run_dir / name / "hf")
            out[name] = (losses, seen)
        finally:
            job.close()
            runtime.logger.close()
    return out


def test_encoder_on_its_own_rank_equals_one_process(tmp_path, ranks, free_port):
    """CLIP and the projector on a rank of their own (parallel.components.vision.num_ranks 1; the language model on
    ranks 1-2, data parallel 2, megatron's LLaVAModel without its encoder): 5 steps equal one process's losses,
    trained and with train.freeze [vision]; step 1's 8 images are encoded once, on the encoder rank; the HF export
    gathers both rank sets' weights and equals the one-process export."""
    from safetensors.torch import load_file

    hf_dir = save_llava(tmp_path / "hf")
    over = cpt_overrides(hf_dir, "train.steps=5", "train.grad_clip=0.05")
    layouts = [("whole", over), ("frozen", [*over, "train.freeze=[vision]"])]
    one = ranks(_own_rank_runs, world=1, out=tmp_path / "r1", run_dir=tmp_path / "one", layouts=layouts,
                ports=[free_port() for _ in layouts])[0]
    split = "parallel.components={vision: {num_ranks: 1}, language: {num_ranks: 2}}"
    three = ranks(_own_rank_runs, world=3, out=tmp_path / "r3", run_dir=tmp_path / "three",
                  layouts=[(n, [*o, split]) for n, o in layouts], ports=[free_port() for _ in layouts],
                  timeout_s=240)
    for name, _ in layouts:
        for r in range(3):
            assert three[r][name][0] == pytest.approx(one[name][0], rel=1e-5), (name, r, three[r][name][0])
        assert sorted(three[0][name][1]) == sorted(one[name][1]) and len(one[name][1]) == 8, name
        assert three[1][name][1] is None and three[2][name][1] is None
        mine = load_file(next((tmp_path / "three" / name / "hf").glob("*.safetensors")))
        ref = load_file(next((tmp_path / "one" / name / "hf").glob("*.safetensors")))
        assert mine.keys() == ref.keys()
        for k, t in ref.items():
            # NOTE: CLIP's key biases: exactly-zero gradients, Adam steps of rounding noise (the layout test's note)
            atol = 5 * 3e-3 if k.endswith("self_attn.k_proj.bias") else 1e-6
            torch.testing.assert_close(mine[k], t, rtol=1e-5, atol=atol, msg=k)
    assert one["frozen"][0] != pytest.approx(one["whole"][0], rel=1e-5)


def _step_export_step(*, rank, world, hf_dir, run_dir, export_dir) -> tuple[list[dict], float]:
    """One CPT step, the online HF export, then (step 2's micro-batches, step 2's loss); in a rank."""

    job, runtime = loongforge.build_job(loongforge.load_recipe(RECIPE, cpt_overrides(hf_dir)), output_dir=run_dir)
    try:
        job.step()
        job.export("hf", export_dir)
        batches = job.schedule.microbatches(1, device=torch.device("cpu"))
        ours = job.step()["loss"]
    finally:
        job.close()
        runtime.logger.close()
    return batches, ours


def test_hf_export_round_trips_through_transformers(tmp_path, ranks):
    """After a CPT step, the online HF export (LlavaForConditionalGeneration, CLIP tower cut to the layers LLaVA runs)
    computes in transformers the loss our next step computes; offline HF -> megatron (tp 2) -> HF keeps the function."""
    from loongforge.cli import main
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    hf_dir = save_llava(tmp_path / "hf")
    batches, ours = ranks(_step_export_step, world=1, out=tmp_path / "ranks", hf_dir=hf_dir, run_dir=tmp_path / "run",
                          export_dir=tmp_path / "exported")[0]
    exported = LlavaConfig.from_pretrained(tmp_path / "exported")
    assert exported.vision_config.num_hidden_layers == 2 and exported.vision_feature_layer == -1
    ref = hf_loss(tmp_path / "exported", hf_batch(batches))
    assert ours == pytest.approx(ref, rel=1e-5), (ours, ref)

    assert main(["convert", str(hf_dir), str(tmp_path / "mg"), "--to", "megatron", "--tp", "2"]) == 0
    assert main(["convert", str(tmp_path / "mg"), str(tmp_path / "back"), "--to", "hf"]) == 0
    batch = hf_batch(batches)
    logits = []
    for d in (hf_dir, tmp_path / "back"):
        model = LlavaForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
        with torch.no_grad():
            logits.append(model(input_ids=batch["input_ids"], pixel_values=batch["pixel_values"]).logits)
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=1e-6)


def test_image_text_conversations_train_like_transformers(tmp_path, ranks):
    """data.format llava: LLaVA-style JSON records (image files + human/gpt turns with <image>), the tokenizer's
    chat template, CLIP preprocessing; the first CPT step's loss equals transformers' on the same batch."""
    from loongforge_megatron.data.tokenizer import train_bpe
    from PIL import Image
    
    colours = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (40, 60, 220), "white": (240, 240, 240)}
    data = tmp_path / "data"
    data.mkdir()
    records = []
    for i, (name, rgb) in enumerate(list(colours.items()) * 2):
        Image.new("RGB", (40 + 4 * i, 40), rgb).save(data / f"img{i}.png")  # resized + cropped to 32 by CLIP
        records.append({"image": f"img{i}.png", "conversations": [
            {"from": "human", "value": "<image>\nWhat colour is this?"}, {"from": "gpt", "value": f"It is {name}."}]})
    (data / "records.json").write_text(json.dumps(records))
    hf_dir = tmp_path / "hf"
    tok = train_bpe([r["conversations"][1]["value"] + " What colour is this?" for r in records], vocab_size=300,
                    out_dir=hf_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tok.save_pretrained(hf_dir)
    image_token = tok.convert_tokens_to_ids("<image>")
    save_llava(hf_dir, vocab=len(tok), image_token=image_token)
    batches, ours = first_step(ranks, tmp_path, cpt_overrides(hf_dir, "data.format=llava",
                                                       f"data.path={data / 'records.json'}", "data.seq_length=64"))
    assert all((b["tokens"] == image_token).sum(1).eq(1).all() for b in batches)
    assert sum(int(b["loss_mask"].sum()) for b in batches) >= 8  # the answers, not the prompts
    ref = hf_loss(hf_dir, hf_batch(batches, image_token))
    assert ours == pytest.approx(ref, rel=1e-5), (ours, ref)


def test_bf16_trains_and_hub_configs_are_completed(tmp_path):
    """bf16 (conv1 and the norms are built in fp32 by megatron: the model is cast whole), and a llava-hf config.json
    that lists only non-default text/vision fields (as llava-1.5-7b-hf does) resolves to the full architecture."""
    losses = [r["loss"] for r in _train(tmp_path / "bf16", "train.precision=bf16", "train.steps=4", "logging.interval=1")]
    assert all(0 < v < 10 for v in losses), losses
    hub = {"model_type": "llava", "image_token_index": 32000, "projector_hidden_act": "gelu",
           "text_config": {"model_type": "llama", "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
                           "vocab_size": 32064},
           "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                             "model_type": "clip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 24,
                             "patch_size": 14, "projection_dim": 768},
           "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "vocab_size": 32064}
    (tmp_path / "hub").mkdir()
    (tmp_path / "hub" / "config.json").write_text(json.dumps(hub))
    from loongforge_megatron.conversion.convert import read_hf_config
    from loongforge_megatron.conversion.layout import MegatronLayout
    from loongforge_megatron.models.hf_arch import arch_from_hf

    arch = arch_from_hf(tmp_path / "hub")
    assert (arch.num_layers, arch.hidden_size, arch.num_attention_heads, arch.vocab_size) == (32, 4096, 32, 32064)
    layout = MegatronLayout("llava", read_hf_config(tmp_path / "hub"), tp=2)
    names = [p.megatron for p in layout.params()]
    assert "vision_model.decoder.layers.22.mlp.linear_fc2.bias" in names
    assert "vision_model.decoder.layers.23.mlp.linear_fc2.bias" not in names  # vision_feature_layer -2


def test_image_text_records_are_shuffled_per_epoch_and_checked(tmp_path):
    """Every epoch visits each record once, in a seeded order that changes between epochs; a bad record is a
    one-line error naming it when it is read."""
    from types import SimpleNamespace

    from loongforge.errors import RecipeError
    from loongforge_megatron.data.tokenizer import train_bpe
    from loongforge_megatron.models.llava.model import ImageTextConversations
    from PIL import Image

    tok = train_bpe(["a b c d what is this"] * 4, vocab_size=280, out_dir=tmp_path / "tok")
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    Image.new("RGB", (32, 32), (10, 20, 30)).save(tmp_path / "x.png")
    records = [{"image": "x.png", "conversations": [{"from": "human", "value": "<image>\nwhat is this"},
                                                    {"from": "gpt", "value": f"{'abcd'[i % 4]}"}]} for i in range(6)]
    records.append({"image": "missing.png", "conversations": records[0]["conversations"]})
    (tmp_path / "r.json").write_text(json.dumps(records))
    arch = SimpleNamespace(vision={"image_token_index": tok.convert_tokens_to_ids("<image>"),
                                   "vision_config": {"image_size": 32, "patch_size": 8}})
    ds = ImageTextConversations(str(tmp_path / "r.json"), tokenizer=tok, arch=arch, seq_length=64, seed=3)
    first, second = [ds._record(i) for i in range(7)], [ds._record(7 + i) for i in range(7)]
    assert sorted(first) == sorted(second) == list(range(7)) and first != second
    bad = first.index(6)
    with pytest.raises(RecipeError, match="record 7: image .*missing.png' not found"):
        ds[bad]
    assert ds[first.index(0)]["tokens"].shape == (64 - 16 + 1,)
