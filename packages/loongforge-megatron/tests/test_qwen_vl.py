"""Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE on megatron-core: HF -> megatron -> HF is bit-exact at tp 1 and tp 2 / pp 2
(MoE: / ep 2, the fused 3-D experts in either orientation); the first step of ``loongforge train`` on two image-text
records (images of different sizes) gives the loss transformers computes on what its own ``AutoProcessor`` makes of
the same records (MoE: the LM cross-entropy, with the router's aux loss on); ``train.freeze [vision]`` keeps the
tower bit-identical; packed micro-batches (the records back to back, MRoPE positions per record) give the padded
rows' loss, at tp 2 (MoE: ep 2) and pp 2 too; LoRA on the language model merges to W + (alpha/r)·B A and loads in
PEFT.

NOTE: every megatron job here runs in a rank (``ranks``) or a subprocess, never in pytest's own process."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import loongforge
import pytest
import torch
from vl_records import (
    TEXTS,
    hf_inputs,
    make_records,
    processor_loss,
    save_processor,
)

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "vlm" / "qwen2_5_vl_tiny.yaml"


def save_qwen_vl(out: Path, *, vocab: int = 320, ids: dict[str, int] | None = None, tie: bool = False,
                 kv_heads: int = 2) -> Path:
    """A tiny Qwen2_5_VLForConditionalGeneration with every weight perturbed (no norm at 1, no bias at 0)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = ids or {"image_token_id": 300, "video_token_id": 301, "vision_start_token_id": 302, "vision_end_token_id": 303}
    cfg = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=512,
                         rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                         tie_word_embeddings=tie, bos_token_id=None, eos_token_id=None),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=64,
                           patch_size=4, spatial_merge_size=2, temporal_patch_size=2, window_size=16,
                           fullatt_block_indexes=[2]),
        tie_word_embeddings=tie, **ids)
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm = name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight"))
            p.copy_((1.0 if norm else 0.0) + 0.1 * torch.randn(p.shape, generator=g))
    model.save_pretrained(out)
    return out


def save_qwen3_vl(out: Path, *, vocab: int, ids: dict[str, int], moe: bool = False) -> Path:
    """A tiny Qwen3VLForConditionalGeneration (deepstack after LM layers 0 and 1), every weight perturbed; ``moe``:
    a Qwen3VLMoeForConditionalGeneration (4 experts, top 2, each [24, 64]: transformers saves them fused, 3-D)."""
    import transformers as tf

    prefix = "Qwen3VLMoe" if moe else "Qwen3VL"
    experts = dict(moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2) if moe else {}
    cfg = getattr(tf, prefix + "Config")(
        text_config=dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                          "mrope_interleaved": True}, **experts),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=64,
                           patch_size=4, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                           deepstack_visual_indexes=[0, 1]),
        tie_word_embeddings=False, **ids)
    torch.manual_seed(0)
    model = getattr(tf, prefix + "ForConditionalGeneration")(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm = name.endswith(("norm.weight", "norm1.weight", "norm2.weight"))
            p.copy_((1.0 if norm else 0.0) + 0.1 * torch.randn(p.shape, generator=g))
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
def hf_dir(tmp_path_factory, request):
    out = tmp_path_factory.mktemp(request.param) / "hf"
    ids, vocab = save_processor(out, TEXTS, family=request.param)
    if request.param == "qwen2_5_vl":
        return save_qwen_vl(out, vocab=vocab, ids=ids)
    return save_qwen3_vl(out, vocab=vocab, ids=ids, moe=request.param == "qwen3_vl_moe")


def is_moe(hf_dir: Path) -> bool:
    return json.loads((hf_dir / "config.json").read_text())["model_type"] == "qwen3_vl_moe"


def overrides(hf_dir: Path, records: Path, *extra: str) -> list[str]:
    """Continue training the HF checkpoint ``hf_dir`` on ``records`` on CPU: one global batch of both records."""
    return [f"model={{hf: {hf_dir}}}", f"checkpoint.load={hf_dir}", "data.format=conversations",
            f"data.path={records}", "data.seq_length=96", "train.global_batch_size=2", "train.steps=3",
            "train.warmup_steps=0", "accelerator=cpu", "logging.console=false", *extra]


def _steps(*, rank, world, overrides, run_dir, export_dir):
    """(step 1's micro-batches, every step's loss) of a job in a rank, then the online HF export."""
    job, runtime = loongforge.build_job(loongforge.load_recipe(RECIPE, overrides), output_dir=run_dir)
    try:
        batches = job.schedule.microbatches(0, device=torch.device("cpu"))
        losses = [job.step()["loss"] for _ in range(job.recipe.train.steps)]
        job.export("hf", export_dir)
        return batches, losses
    finally:
        job.close()
        runtime.logger.close()


def test_sft_first_step_loss_equals_transformers_and_frozen_vision_stays(tmp_path, hf_dir, ranks):
    """Both records in one micro-batch (rows padded): tokens and pixels are the processor's and the first SFT step's
    loss is transformers' on the processor's batch; with train.freeze [vision] the exported tower after 3 steps is
    the source's, bit for bit, while the language model moved."""
    from safetensors.torch import load_file

    records = make_records(tmp_path / "data")
    # NOTE: MoE: with the router's load-balancing loss on, the logged loss is still the LM cross-entropy (megatron
    # adds the aux loss's gradient in the backward only), what transformers' loss is (no output_router_logits)
    aux = ["model.moe_aux_loss_coeff=0.01"] if is_moe(hf_dir) else []
    over = overrides(hf_dir, records, "train.stage=sft", "train.micro_batch_size=2", "train.freeze=[vision]",
                     "data.pack=false", *aux)
    batches, losses = ranks(_steps, world=1, out=tmp_path / "ranks", run_dir=tmp_path / "run", overrides=over,
                            export_dir=tmp_path / "exported")[0]
    (b,) = batches
    ref = processor_loss(hf_dir, records, b, pixels="pixel_values")
    assert losses[0] == pytest.approx(ref, rel=1e-5), (losses[0], ref)
    assert losses[-1] < losses[0]
    source, trained = load_file(hf_dir / "model.safetensors"), load_file(tmp_path / "exported" / "model.safetensors")
    assert trained.keys() == source.keys()
    for name, tensor in source.items():
        assert torch.equal(trained[name], tensor) == name.startswith(("visual.", "model.visual.")), name


def make_video_records(root: Path) -> Path:
    """A ShareGPT record with a 4-frame video (fps 2) and an OpenAI one with an image and a 3-frame video (fps 1, an
    odd frame count: the processor pads it to its temporal patches), frames of other sizes than the image."""
    from PIL import Image

    make_records(root)
    g = torch.Generator().manual_seed(1)
    for name, (w, h), n in (("a", (24, 16), 4), ("b", (16, 24), 3)):
        for k in range(n):
            noise = (torch.rand(h, w, 3, generator=g) * 255).to(torch.uint8).numpy()
            Image.fromarray(noise).save(root / f"{name}{k}.png")
    records = [
        {"conversations": [{"from": "human", "value": "<video>\nWhat happens?"},
                           {"from": "gpt", "value": "It is noise."}], "videos": [[f"a{k}.png" for k in range(4)]]},
        {"messages": [{"role": "user", "content": [{"type": "image", "image": "red.png"},
                                                   {"type": "text", "text": "What colour is this? And this?"},
                                                   {"type": "video", "video": {"frames": ["b0.png", "b1.png", "b2.png"],
                                                                               "fps": 1}}]},
                      {"role": "assistant", "content": "Red. Green and blue."}]},
    ]
    (root / "videos.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return root / "videos.jsonl"


@pytest.mark.parametrize("hf_dir", ["qwen2_5_vl", "qwen3_vl"], indirect=True)  # NOTE: the MoE one shares Qwen3-VL's
def test_video_records_first_step_loss_equals_transformers(tmp_path, hf_dir, ranks):
    """Records with videos (frame files; one next to an image): tokens, video patches and multimodal positions are
    what transformers' processor and get_rope_index make of them (Qwen3-VL: timestamped frame groups), and the first
    step's loss is transformers' on the processor's batch."""
    records = make_video_records(tmp_path / "data")
    over = overrides(hf_dir, records, "train.stage=sft", "train.micro_batch_size=2", "train.steps=1",
                     "data.pack=false", "data.seq_length=160")
    (b,), losses = ranks(_steps, world=1, out=tmp_path / "ranks", run_dir=tmp_path / "run", overrides=over,
                         export_dir=tmp_path / "exported")[0]
    video = json.loads((hf_dir / "config.json").read_text())["video_token_id"]
    assert int((b["tokens"] == video).sum()) > 0
    ref = processor_loss(hf_dir, records, b, pixels="pixel_values_videos")
    assert losses[0] == pytest.approx(ref, rel=1e-5), (losses[0], ref)


FUSED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def test_hf_megatron_hf_is_bit_exact(tmp_path, hf_dir):
    """HF -> megatron -> HF at tp 1 and tp 2 / pp 2 (MoE: / ep 2) gives the source's tensors bit for bit.

    Qwen3-VL-MoE: transformers 5's ``save_pretrained`` writes the fused experts as its modules hold them
    (gate_up_proj [E, 2I, H], down_proj [E, H, I]); the export writes the published checkpoints' [E, H, 2I] /
    [E, I, H], which transformers loads into the source's parameters bit for bit, and a file in that layout
    converts to the same megatron shards."""
    from loongforge.cli import main
    from safetensors.torch import load_file, save_file

    source = load_file(hf_dir / "model.safetensors")
    moe = is_moe(hf_dir)
    layouts = [("tp1", []), ("tp2_pp2", ["--tp", "2", "--pp", "2"] + (["--ep", "2"] if moe else []))]
    for name, layout in layouts:
        assert main(["convert", str(hf_dir), str(tmp_path / name), "--to", "megatron", *layout]) == 0
        assert main(["convert", str(tmp_path / name), str(tmp_path / f"{name}_hf"), "--to", "hf"]) == 0
        back = {}
        for f in (tmp_path / f"{name}_hf").glob("*.safetensors"):
            back.update(load_file(f))
        assert back.keys() == source.keys(), name
        for key, tensor in source.items():
            if key.endswith(FUSED):
                e, i, h = (4, 48, 64) if key.endswith("gate_up_proj") else (4, 64, 24)
                assert tensor.shape == (e, i, h) and back[key].shape == (e, h, i), key
                assert torch.equal(back[key].transpose(1, 2), tensor), (name, key)
            else:
                assert torch.equal(back[key], tensor), (name, key)
    if not moe:
        return
    from transformers import AutoModelForImageTextToText

    want = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32).state_dict()
    got = AutoModelForImageTextToText.from_pretrained(tmp_path / "tp2_pp2_hf", dtype=torch.float32).state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    hub = tmp_path / "hub_layout"
    hub.mkdir()
    for f in hf_dir.iterdir():
        if f.name != "model.safetensors":
            (hub / f.name).write_bytes(f.read_bytes())
    save_file({k: t.transpose(1, 2).contiguous() if k.endswith(FUSED) else t for k, t in source.items()},
              hub / "model.safetensors", metadata={"format": "pt"})
    assert main(["convert", str(hub), str(tmp_path / "from_hub"), "--to", "megatron"]) == 0
    shards = sorted(p.relative_to(tmp_path / "tp1") for p in (tmp_path / "tp1").rglob("*.safetensors"))
    for rel in shards:
        a, b = load_file(tmp_path / "tp1" / rel), load_file(tmp_path / "from_hub" / rel)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), rel


@pytest.mark.parametrize("hf_dir", ["qwen2_5_vl"], indirect=True)  # NOTE: both families read records alike
def test_bad_records_are_one_line_errors_naming_record_and_file(tmp_path, hf_dir):
    from loongforge.errors import RecipeError
    from loongforge_megatron.models.hf_arch import arch_from_hf
    from loongforge_megatron.models.qwen_vl.data import Conversations, load_processor

    good = make_records(tmp_path)
    (tmp_path / "broken.png").write_bytes(b"not a png")
    turn = [{"from": "gpt", "value": "x"}]
    bad = [({"conversations": [{"from": "human", "value": "<image>"}, *turn], "images": ["gone.png"]}, "not found"),
           ({"conversations": [{"from": "human", "value": "<image>"}, *turn], "images": ["broken.png"]}, "unreadable"),
           ({"conversations": [{"from": "human", "value": "hi"}, *turn], "images": ["red.png"]},
            "0 '<image>' placeholders but 1 images"),
           ({"conversations": [{"from": "human", "value": "<image>"}, *turn], "images": ["../red.png"]},
            "not a path inside"),
           ({"text": "no turns"}, "neither 'messages'"),
           ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "neither text, an image nor a video"),
           ({"conversations": [{"from": "human", "value": "<video>"}, *turn], "videos": [["red.png", "noise.png"]]},
            "video 1: frames of different sizes"),
           ({"conversations": [{"from": "human", "value": "<video>"}, *turn], "videos": [["red.png", "gone.png"]]},
            "video 1 frame"),
           ({"conversations": [{"from": "human", "value": "<video>"}, *turn]}, "1 '<video>' placeholders but 0"),
           ({"messages": [{"role": "user", "content": [{"type": "video", "video": {"frames": ["red.png"], "fps": 0}}]}]},
            "'fps' must be a positive number"),
           ({"messages": [{"role": "user", "content": [{"type": "video", "video": "red.png"}]}]},
            "a video is a non-empty list of frame files")]
    lines = good.read_text().splitlines()
    (tmp_path / "bad.jsonl").write_text("\n".join(lines + [json.dumps(r) for r, _ in bad]) + "\n")
    arch = arch_from_hf(hf_dir)
    ds = Conversations(str(tmp_path / "bad.jsonl"), processor=load_processor(hf_dir), arch=arch, seq_length=96, seed=0)
    assert ds.encode(0)["ids"].count(arch.vision["image_token_id"]) == 6  # a 24 x 16 image: 6 merged patches
    for n, (_, what) in enumerate(bad, start=len(lines) + 1):
        with pytest.raises(RecipeError) as err:
            ds.encode(n - 1)
        msg = str(err.value)
        assert f"bad.jsonl: record {n}" in msg and what in msg and "\n" not in msg, msg
    with pytest.raises(RecipeError, match="an image's tokens end after data.seq_length 8"):
        Conversations(str(good), processor=load_processor(hf_dir), arch=arch, seq_length=8, seed=0)[0]


def _losses(*, rank, world, overrides, run_dir):
    """Every step's loss of a job in a rank (and its first micro-batch)."""
    job, runtime = loongforge.build_job(loongforge.load_recipe(RECIPE, overrides), output_dir=run_dir)
    try:
        batch = job.schedule.microbatches(0, device=torch.device("cpu"))[0]
        return batch, [job.step()["loss"] for _ in range(job.recipe.train.steps)]
    finally:
        job.close()
        runtime.logger.close()


def _packed_and_padded(*, rank, world, overrides, run_dir):
    return [_losses(rank=rank, world=world, overrides=[*overrides, f"data.pack={p}"], run_dir=run_dir / str(p))
            for p in ("true", "false")]


def test_packed_micro_batch_equals_padded_rows(tmp_path, hf_dir, ranks):
    """Both records in one micro-batch: packed (one row, no padding, positions restarting at each record) and
    padded rows give the same loss over 2 steps."""
    records = make_records(tmp_path / "data")
    over = overrides(hf_dir, records, "train.stage=sft", "train.micro_batch_size=2", "train.steps=2")
    (packed, p_losses), (padded, u_losses) = ranks(_packed_and_padded, world=1, out=tmp_path / "ranks",
                                                   run_dir=tmp_path / "run", overrides=over)[0]
    bounds = packed["packed_seq_params"].cu_seqlens_q.tolist()
    lengths = [int(padded["loss_mask"][r].nonzero().max()) + 2 for r in range(2)]  # through each row's last label
    assert len(bounds) == 3 and packed["tokens"].shape == (1, bounds[-1]) and bounds[-1] < 2 * 96
    assert packed["position_ids"].shape == (1, 3, bounds[-1])
    for a, b in itertools.pairwise(bounds):
        assert packed["position_ids"][0, :, a].tolist() == [0, 0, 0]
        row = next(r for r in range(2) if padded["tokens"][r, : b - a].tolist() == packed["tokens"][0, a:b].tolist())
        assert torch.equal(packed["position_ids"][0, :, a:b], padded["position_ids"][row, :, : b - a])
        assert b - a >= lengths[row] - 1
    assert p_losses == pytest.approx(u_losses, rel=1e-5, abs=1e-6), (p_losses, u_losses)


def _steps_with_workers(*, rank, world, overrides, run_dir):
    return [_losses(rank=rank, world=world, overrides=[*overrides, f"data.num_workers={w}"], run_dir=run_dir / str(w))
            for w in (0, 1)]


@pytest.mark.parametrize("hf_dir", ["qwen2_5_vl"], indirect=True)  # NOTE: the data path is the families' one
def test_micro_batches_made_ahead_by_a_worker_are_the_steps_own(tmp_path, hf_dir, ranks):
    """data.num_workers 1: a spawned worker makes the next steps' (packed) micro-batches while the model trains; the
    losses are those of batches made in the step. A bad record read by the worker fails as its own one-line error."""
    from loongforge.errors import RecipeError
    from loongforge_megatron.data.datasets import BatchSchedule
    from loongforge_megatron.models.hf_arch import arch_from_hf
    from loongforge_megatron.models.qwen_vl.data import Conversations, load_processor

    records = make_records(tmp_path / "data")
    over = overrides(hf_dir, records, "train.stage=sft", "train.micro_batch_size=1", "train.steps=3")
    (_, here), (_, ahead) = ranks(_steps_with_workers, world=1, out=tmp_path / "ranks", run_dir=tmp_path / "run",
                                  overrides=over)[0]
    assert ahead == here, (ahead, here)
    lines = records.read_text().splitlines()
    (tmp_path / "data" / "bad.jsonl").write_text("\n".join([*lines, '{"text": "no turns"}']) + "\n")
    ds = Conversations(str(tmp_path / "data" / "bad.jsonl"), processor=load_processor(hf_dir),
                       arch=arch_from_hf(hf_dir), seq_length=96, seed=0, pack=True)
    schedule = BatchSchedule(ds, global_batch_size=3, micro_batch_size=3, dp_size=1, dp_rank=0, workers=1, steps=2)
    with pytest.raises(RecipeError) as err:
        schedule.microbatches(0, device=torch.device("cpu"))
    schedule.close()
    assert "bad.jsonl: record 3" in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("hf_dir", ["qwen2_5_vl", "qwen3_vl"], indirect=True)
def test_balance_costs_count_the_records_tokens_and_patches(tmp_path, hf_dir):
    """data.balance's cost of a record, from its text and its images' headers, counts the tokens and patches the
    record is made of."""
    from loongforge_megatron.models.hf_arch import arch_from_hf
    from loongforge_megatron.models.qwen_vl.data import Conversations, load_processor

    records = make_records(tmp_path / "data")
    ds = Conversations(str(records), processor=load_processor(hf_dir), arch=arch_from_hf(hf_dir), seq_length=96,
                       seed=0, pack=True)
    for idx in range(2):
        rec = ds.encode(ds._record(idx))
        n = min(len(rec["ids"]), 96)
        assert ds.cost_features(idx) == (float(n * n), float(n), float(rec["pixel_values"].shape[0]))


# NOTE: deepstack layers on the first stage; MoE: the experts over two expert-parallel ranks (megatron's all-to-all
# dispatcher; one process runs the fused permute dispatch), and under tp 2 with sequence parallelism (what megatron's
# MoE layers need under tp)
@pytest.mark.parametrize("hf_dir", ["qwen3_vl", "qwen3_vl_moe"], indirect=True)
def test_tp2_pp2_cp2_and_ep2_equal_one_process(tmp_path, hf_dir, ranks):
    """Packed SFT steps at tp 2 (the tower whole on both ranks, and split over them: heads, MLPs and mergers), at tp
    2 with sequence parallelism (each packed row padded to an even length, its tokens and deepstack features split
    over the two ranks), at pp 2 and at cp 2 (each record padded to a multiple
    of 4 and cut into megatron's load-balanced chunks; the images' embeddings and MRoPE positions follow their
    tokens) on two gloo ranks each give one process's losses; Qwen3-VL-MoE at ep 2, tp 2 + sp and pp 2."""
    records = make_records(tmp_path / "data")
    over = overrides(hf_dir, records, "train.stage=sft", "train.micro_batch_size=1", "train.steps=2")
    one = ranks(_losses, world=1, out=tmp_path / "r1", run_dir=tmp_path / "one", overrides=over)[0][1]
    layouts = (("tp2", ["parallel.tp=2"]), ("tp2_sp", ["parallel.tp=2", "parallel.sp=true"]),
               ("tp2_split_tower", ["parallel.tp=2", "parallel.components.vision.tp=2"]),
               ("pp2", ["parallel.pp=2"]), ("cp2", ["parallel.cp=2"]), ("dp2_balanced", ["data.balance=true"]))
    if is_moe(hf_dir):
        layouts = (("ep2", ["parallel.ep=2"]), layouts[1], layouts[3])
    for name, layout in layouts:
        two = ranks(_losses, world=2, out=tmp_path / name, run_dir=tmp_path / f"run_{name}",
                    overrides=[*over, *layout])
        for _, losses in two:
            assert losses == pytest.approx(one, rel=1e-5), (name, losses, one)


def _lora_exports(*, rank, world, overrides, run_dir, export_root):
    job, runtime = loongforge.build_job(loongforge.load_recipe(RECIPE, overrides), output_dir=run_dir)
    try:
        losses = [job.step()["loss"] for _ in range(job.recipe.train.steps)]
        job.export("hf", export_root / "hf")
        job.export("peft", export_root / "peft")
        return losses
    finally:
        job.close()
        runtime.logger.close()


@pytest.mark.parametrize("hf_dir", ["qwen2_5_vl", "qwen3_vl"], indirect=True)  # NOTE: PEFT has no fused experts
def test_lora_on_the_language_model_merges_and_loads_in_peft(tmp_path, hf_dir, ranks):
    """train.stage lora: adapters on the language model's linears only; the HF export is W + (alpha/r)·B A of the
    PEFT export's factors (the tower and norms unchanged), and PEFT loads the adapters into transformers' model:
    its merged model gives our merged export's logits."""
    import transformers as tf
    from peft import PeftModel
    from safetensors.torch import load_file

    records = make_records(tmp_path / "data")
    over = overrides(hf_dir, records, "train.stage=lora", "train.micro_batch_size=2", "train.steps=2", "train.lr=0.05",
                     "train.lora={rank: 4, alpha: 8}")
    ranks(_lora_exports, world=1, out=tmp_path / "ranks", run_dir=tmp_path / "run", overrides=over, export_root=tmp_path)
    base, merged = load_file(hf_dir / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    adapters = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert {m.split(".")[-1] for m in config["target_modules"]} == {"down_proj", "gate_proj", "k_proj", "o_proj",
                                                                     "q_proj", "up_proj", "v_proj"}
    assert all(".language_model." in m for m in config["target_modules"])
    assert merged.keys() == base.keys()
    from loongforge_megatron.models.qwen_vl.names import module_path

    adapted = 0
    for name in sorted(base):
        prefix = "base_model.model." + module_path(name)[: -len("weight")]
        if prefix + "lora_A.weight" not in adapters:
            assert torch.equal(merged[name], base[name]), name
            continue
        a, b = adapters[prefix + "lora_A.weight"], adapters[prefix + "lora_B.weight"]
        assert torch.allclose(merged[name], base[name] + (8 / 4) * b @ a, rtol=0, atol=1e-6), name
        assert not torch.equal(merged[name], base[name]), name
        adapted += 1
    assert adapted == len(adapters) // 2 and adapted > 0
    model = tf.AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(model, tmp_path / "peft")
    loaded = {k.replace(".default.weight", ".weight"): v for k, v in peft_model.state_dict().items() if ".lora_" in k}
    assert sorted(loaded) == sorted(adapters)
    batch = hf_inputs(hf_dir, records)
    batch.pop("labels")
    ours = tf.AutoModelForImageTextToText.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        want, got = ours(**batch).logits, peft_model.merge_and_unload().eval()(**batch).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _fused_and_plain_output_layer(*, rank, world, run_dir):
    """Per tiny preset: (output dims, loss sums, token counts, grads) of one micro-batch through the job's forward step
    (the loongforge spec's fused linear cross-entropy) and through the plain one (logits + megatron's CE)."""
    from loongforge_megatron.models.qwen_vl.model import forward_step

    out = {}
    for name in ("qwen2_5_vl_tiny", "qwen3_vl_tiny", "qwen3_vl_moe_tiny"):
        recipe = RECIPE.with_name(f"{name}.yaml")
        job, runtime = loongforge.build_job(loongforge.load_recipe(recipe, ["accelerator=cpu", "logging.console=false"]),
                                            output_dir=run_dir / name)
        try:
            model, batch = job.model[0], job.schedule.microbatches(0, device=torch.device("cpu"))[0]
            params = [p for p in model.parameters() if p.requires_grad]
            rows = []
            for step in (job.forward_step_fn, forward_step):
                output, loss = step(iter([batch]), model)
                loss_sum, tokens, _ = loss(output)
                rows.append((output.dim(), loss_sum.item(), int(tokens), torch.autograd.grad(loss_sum, params)))
            out[name] = rows
        finally:
            job.close()
            runtime.logger.close()
    return out


def test_fused_output_layer_gives_the_plain_loss_and_grads(tmp_path, ranks):
    """The loongforge spec's VL step runs the output layer as the fused linear cross-entropy, given the loss mask (a
    masked token-sum, no [tokens, vocab] logits): in fp32 on the CPU its loss and every gradient equal the plain
    output layer + cross-entropy's, for Qwen2.5-VL, Qwen3-VL (deepstack) and Qwen3-VL-MoE."""
    got = ranks(_fused_and_plain_output_layer, world=1, out=tmp_path / "ranks", run_dir=tmp_path / "run")[0]
    for name, (fused, plain) in got.items():
        assert (fused[0], plain[0]) == (0, 2), name  # a scalar sum vs per-token losses [b, s]
        assert fused[2] == plain[2] > 0, name
        assert fused[1] == pytest.approx(plain[1], rel=1e-5), (name, fused[1], plain[1])
        for g, want in zip(fused[3], plain[3], strict=True):
            torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-6, msg=name)


def _packed_and_padded_on_gpu(*, rank, world, overrides, run_dir):
    """:func:`_packed_and_padded` watching the packed run's attention: the language model's attention calls (with
    their cu_seqlens and mask), its causal varlen_attn calls and any SDPA call; building a ``[t, t]`` packed mask
    fails the run."""
    import torch.nn.attention.varlen as varlen
    import torch.nn.functional as F
    from loongforge_megatron.engine import step
    from loongforge_megatron.layers.attention import SDPAttention

    calls, lm, sdpa = [], [], []
    real_varlen, real_sdpa, real_forward = varlen.varlen_attn, F.scaled_dot_product_attention, SDPAttention.forward

    def counted(*args, **kwargs):
        calls.append(kwargs.get("window_size"))
        return real_varlen(*args, **kwargs)

    def watched(self, query, key, value, attention_mask, *args, packed_seq_params=None, **kwargs):
        cu = None if packed_seq_params is None else packed_seq_params.cu_seqlens_q
        lm.append((None if cu is None else cu.tolist(), None if attention_mask is None else attention_mask.numel(),
                   query.shape[0]))
        return real_forward(self, query, key, value, attention_mask, *args, packed_seq_params=packed_seq_params,
                            **kwargs)

    def refused(*args, **kwargs):
        raise AssertionError("a [t, t] packed-sequence mask was built")

    varlen.varlen_attn, step.packed_attention_mask, SDPAttention.forward = counted, refused, watched
    F.scaled_dot_product_attention = lambda *a, **k: sdpa.append(k.get("attn_mask") is not None) or real_sdpa(*a, **k)
    packed = _losses(rank=rank, world=world, overrides=[*overrides, "data.pack=true"], run_dir=run_dir / "p")
    causal, attention, dense = sum(1 for w in calls if w == (-1, 0)), list(lm), list(sdpa)
    padded = _losses(rank=rank, world=world, overrides=[*overrides, "data.pack=false"], run_dir=run_dir / "u")
    return packed[1], padded[1], causal, attention, dense


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_packed_rows_run_varlen_attention_and_equal_padded_rows(tmp_path, hf_dir, ranks):
    """CUDA bf16: a packed micro-batch (the records back to back in one row) runs every attention of the language
    model as varlen_attn over the records' cu_seqlens with no mask (no SDPA call at all, so no [t, t] mask
    anywhere; the tower runs varlen_attn per image) and gives the padded rows' loss within bf16 tolerance (1e-2
    relative) over 2 SFT steps."""
    records = make_records(tmp_path / "data")
    over = [o for o in overrides(hf_dir, records) if o != "accelerator=cpu"]
    over += ["accelerator=cuda", "train.precision=bf16", "train.stage=sft", "train.micro_batch_size=2", "train.steps=2"]
    packed, padded, causal, attention, dense = ranks(_packed_and_padded_on_gpu, world=1, out=tmp_path / "ranks",
                                                     run_dir=tmp_path / "run", overrides=over)[0]
    layers = json.loads((hf_dir / "config.json").read_text())["text_config"]["num_hidden_layers"]
    print(f"packed {packed} padded {padded} causal varlen_attn calls {causal} language-model attention calls "
          f"{len(attention)} (cu_seqlens {attention[0][0]}) SDPA calls {len(dense)}")
    assert len(attention) == layers * 2  # every layer, both steps (recompute would add more)
    for cu, mask, tokens in attention:
        assert mask is None and cu is not None and len(cu) == 3 and cu[-1] == tokens, (cu, mask, tokens)
    assert causal == len(attention) and dense == []
    assert packed == pytest.approx(padded, rel=1e-2), (packed, padded)


@pytest.mark.parametrize(("args", "key", "message"), [
    (["train.freeze=[visoin]"], "train.freeze", "'visoin' is not a module group of this model (groups: vision, "
                                                 "projector, language)"),
    (["model.freeze=[vision]"], "model", "freeze is a train key: set train.freeze"),
])
def test_freeze_names_are_checked_at_validate(capsys, args, key, message):
    """``train.freeze`` takes the spec's groups or name globs; a name that is neither is one line naming the groups,
    and the old ``model.freeze`` says where the key lives now."""
    from loongforge.cli import main

    assert main(["validate", str(RECIPE), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"key '{key}" in err and message in err, err
    assert main(["validate", str(RECIPE), "train.freeze=[vision, 'decoder.layers.0.*']"]) == 0


MOE_RECIPE = RECIPE.parent / "qwen3_vl_moe_tiny.yaml"


@pytest.mark.parametrize(("args", "key", "message"), [
    (["parallel.tp=2"], "parallel.sp", "MoE layers under tensor parallelism (tp 2) need sequence parallelism"),
    (["train.stage=lora", "checkpoint.save_format=[peft]"], "train.lora.targets", "no adapter names for "
                                                                                  "Qwen3-VL-MoE's fused experts"),
])
def test_moe_recipe_checks(capsys, args, key, message):
    """Qwen3-VL-MoE validates with expert parallelism; what it cannot train is one line naming the key."""
    from loongforge.cli import main

    assert main(["validate", str(MOE_RECIPE), "parallel.ep=2", "--world-size", "2"]) == 0
    capsys.readouterr()
    assert main(["validate", str(MOE_RECIPE), *args, "--world-size", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"key '{key}" in err and message in err, err


def _layouts_and_encoded_images(*, rank, world, layouts, run_dir, ports, export=False):
    """For each (name, overrides): every step's loss, the image grids this rank's tower encoded (in the first
    step), the last step's metrics (``export``: the HF export of the loaded weights, before the steps) and the
    first step's order of tower ("t") and language decoder ("d") forwards on this rank. Each job rendezvouses on its
    own port (a job's close ends the world)."""
    import os

    out = {}
    for (name, over), port in zip(layouts, ports, strict=True):
        os.environ["MASTER_PORT"] = str(port)
        job, runtime = loongforge.build_job(loongforge.load_recipe(RECIPE, over), output_dir=run_dir / name)
        try:
            if export:
                job.export("hf", run_dir / name / "hf")
            seen, order = [], []
            tower = job.chunks[0].vision  # NOTE: None off the first pipeline stage
            hooks = [job.chunks[0].decoder.register_forward_pre_hook(lambda m, args, order=order: order.append("d"))]
            if tower is not None:
                hooks.append(tower.register_forward_pre_hook(
                    lambda m, args, seen=seen, order=order: seen.append(args[1].cpu().tolist()) or order.append("t")))
            losses, metrics = [], {}
            for i in range(job.recipe.train.steps):
                metrics = job.step()
                losses.append(metrics["loss"])
                if i == 0:
                    for hook in hooks:
                        hook.remove()
            out[name] = (losses, [g for grids in seen for g in grids], metrics, "".join(order))
        finally:
            job.close()
            runtime.logger.close()
    return out


# NOTE: Qwen3-VL's deepstack features under hetero-DP: test_tp2_pp2_cp2_and_ep2_equal_one_process's tp2 layouts
@pytest.mark.parametrize("hf_dir", ["qwen2_5_vl"], indirect=True)
def test_encoder_hetero_dp_and_decoupled_encoder_equal_one_process(tmp_path, hf_dir, ranks, free_port):
    """Vision tp 1 under language tp 2: the two towers encode different images of each micro-batch (each image on
    exactly one rank, split by patch count) and gather the embeddings; 5 steps equal one process's losses, with the
    tower's own full / selective recompute (the language model's off) and with train.freeze [vision]; each rank's
    encoder time is in the metrics. Language pp 2 with the decoupled encoder (parallel.components.vision.decoupled):
    the first stage encodes every
    micro-batch of a step before the pipeline schedule's first forward, each image once (the second stage none);
    5 steps equal one process's, trained and frozen."""
    records = make_records(tmp_path / "data")
    over = overrides(hf_dir, records, "train.stage=sft", "train.micro_batch_size=2", "train.steps=5",
                     "data.pack=false")
    frozen = [*over, "train.freeze=[vision]"]
    one = ranks(_layouts_and_encoded_images, world=1, out=tmp_path / "r1", run_dir=tmp_path / "one",
                layouts=[("whole", over), ("frozen", frozen)], ports=[free_port(), free_port()])[0]
    hetero = ["parallel.tp=2", "parallel.components.vision.tp=1"]
    layouts = [("hetero", [*over, *hetero]),
               ("full", [*over, *hetero, "parallel.components.vision.recompute=full"]),
               ("selective", [*over, *hetero, "parallel.components.vision.recompute=selective"]),
               ("frozen", [*frozen, *hetero])]
    # NOTE: two micro-batches of one record each: the global batch (and the token-weighted loss) is the same
    pp2 = ["parallel.pp=2", "parallel.components.vision.decoupled=true", "train.micro_batch_size=1"]
    decoupled = [("pp2", [*over, *pp2]), ("pp2_frozen", [*frozen, *pp2])]
    two = ranks(_layouts_and_encoded_images, world=2, out=tmp_path / "r2", run_dir=tmp_path / "two",
                layouts=layouts + decoupled, ports=[free_port() for _ in layouts + decoupled], timeout_s=150)
    assert one["whole"][3] == "td"  # NOTE: one process encodes inside the micro-batch's forward
    for name, _ in decoupled:
        want = one["frozen" if name == "pp2_frozen" else "whole"][0]
        for r in range(2):
            assert two[r][name][0] == pytest.approx(want, rel=1e-5), (name, r, two[r][name][0], want)
        assert sorted(two[0][name][1]) == sorted(one["whole"][1]) and two[1][name][1] == [], name
        # NOTE: both micro-batches of the step encoded before the first decoder forward
        assert two[0][name][3] == "ttdd", (name, two[0][name][3])
        assert "encoder_time_r0" in two[0][name][2] and "encoder_time_r1" not in two[0][name][2], name
    assert two[0]["pp2_frozen"][0] != pytest.approx(two[0]["pp2"][0], rel=1e-5)
    for name, _ in layouts:
        want = one["frozen" if name == "frozen" else "whole"][0]
        for r in range(2):
            assert two[r][name][0] == pytest.approx(want, rel=1e-5), (name, r, two[r][name][0], want)
        encoded = [g for r in range(2) for g in two[r][name][1]]
        assert sorted(encoded) == sorted(one["whole"][1]) and all(two[r][name][1] for r in range(2)), name
        assert {"encoder_time_r0", "encoder_time_r1"} <= set(two[0][name][2]), two[0][name][2]
    assert two[0]["frozen"][0] != pytest.approx(two[0]["hetero"][0], rel=1e-5)


def test_vision_tp_2_under_language_tp_4_equals_one_process(tmp_path_factory, tmp_path, ranks, free_port):
    """Language tp 4, vision tp 2 on four gloo ranks: two copies of the tower, each split over two ranks (its own
    groups from the plan's grid), encode different images; 3 steps equal one process's losses, each image is
    encoded by one copy, and the HF weights loaded into that layout export back unchanged."""
    from safetensors.torch import load_file

    hf = tmp_path_factory.mktemp("kv4") / "hf"
    ids, vocab = save_processor(hf, TEXTS)
    save_qwen_vl(hf, vocab=vocab, ids=ids, kv_heads=4)
    records = make_records(tmp_path / "data")
    over = overrides(hf, records, "train.stage=sft", "train.micro_batch_size=2", "train.steps=3", "data.pack=false")
    one = ranks(_layouts_and_encoded_images, world=1, out=tmp_path / "r1", run_dir=tmp_path / "one",
                layouts=[("one", over)], ports=[free_port()])[0]["one"]
    layout = [*over, "parallel.tp=4", "parallel.components.vision.tp=2"]
    four = ranks(_layouts_and_encoded_images, world=4, out=tmp_path / "r4", run_dir=tmp_path / "four",
                 layouts=[("tp4", layout)], ports=[free_port()], export=True, timeout_s=180)
    for r in range(4):
        assert four[r]["tp4"][0] == pytest.approx(one[0], rel=1e-5), (r, four[r]["tp4"][0], one[0])
    # NOTE: ranks 0, 1 are one copy of the tower (its tp group), ranks 2, 3 the other
    assert four[0]["tp4"][1] == four[1]["tp4"][1] and four[2]["tp4"][1] == four[3]["tp4"][1]
    assert sorted(four[0]["tp4"][1] + four[2]["tp4"][1]) == sorted(one[1]) and four[0]["tp4"][1]
    base, exported = load_file(hf / "model.safetensors"), load_file(tmp_path / "four" / "tp4" / "hf" / "model.safetensors")
    assert exported.keys() == base.keys()
    for name, tensor in base.items():
        assert torch.equal(exported[name], tensor), name


ENCODER_RANK = "parallel.components={vision: {num_ranks: 1}, language: {num_ranks: 2}}"


def _runs(*, rank, world, layouts, run_dir, ports):
    """For each (name, overrides[, the run directory's name: the layout's own]): every step's loss, the image grids
    this rank's tower encoded over the steps (None: this rank holds no tower) and the HF export after the steps."""
    import os

    out = {}
    for (name, over, *where), port in zip(layouts, ports, strict=True):
        os.environ["MASTER_PORT"] = str(port)
        job, runtime = loongforge.build_job(loongforge.load_recipe(RECIPE, over),
                                            output_dir=run_dir / (where[0] if where else name))
        try:
            tower = getattr(job.chunks[0], "vision", None)
            seen = None
            if tower is not None:
                seen = []
                tower.register_forward_pre_hook(lambda m, args, seen=seen: seen.append(args[1].cpu().tolist()))
            losses, every = [], job.recipe.checkpoint.save_interval
            while job.step_index < job.recipe.train.steps:  # NOTE: the job's run loop, each step's loss kept
                losses.append(job.step()["loss"])
                if every and job.step_index % every == 0 and job.step_index < job.recipe.train.steps:
                    job.checkpointer.save(job.step_index)
            job.export("hf", run_dir / name / "hf")
            out[name] = (losses, None if seen is None else [g for grids in seen for g in grids])
        finally:
            job.close()
            runtime.logger.close()
    return out


@pytest.mark.parametrize("hf_dir", ["qwen2_5_vl"], indirect=True)
def test_encoder_on_its_own_rank_equals_one_process(tmp_path, hf_dir, ranks, free_port):
    """The tower on a rank of its own (parallel.components.vision.num_ranks 1, the language model on ranks 1-2:
    data parallel 2, engine/encoder_ranks.py): 5 steps equal one process's losses (clipped by the norm of both rank
    sets), trained, with train.freeze [vision] and with the language model at tp 2 (declared first: ranks 0-1);
    every image of the global batches is encoded once, on the encoder rank (the language ranks hold no tower); each
    rank set checkpoints its own parameters and a resumed run continues the losses; the three-rank HF export holds
    both sets' weights, equals the one-process export and loads in transformers."""
    from safetensors.torch import load_file
    from transformers import Qwen2_5_VLForConditionalGeneration

    records = make_records(tmp_path / "data")
    # NOTE: one record per micro-batch: each language dp rank takes one of the two records (images of different
    # sizes) a step
    over = overrides(hf_dir, records, "train.stage=sft", "train.micro_batch_size=1", "train.steps=5",
                     "data.pack=false", "train.grad_clip=0.05")
    frozen = [*over, "train.freeze=[vision]"]
    layouts = [("trained", over), ("frozen", frozen)]
    one = ranks(_runs, world=1, out=tmp_path / "r1", run_dir=tmp_path / "one", layouts=layouts,
                ports=[free_port() for _ in layouts])[0]
    # NOTE: the trained run saves step 3 (each rank set its own parameters), "resumed" continues it in the same
    # run directory: steps 4 and 5
    saving = ["checkpoint.save_interval=3", "checkpoint.save_at_end=false"]
    runs = [("trained", [*over, ENCODER_RANK, *saving]), ("frozen", [*frozen, ENCODER_RANK]),
            ("resumed", [*over, ENCODER_RANK], "trained"),
            # NOTE: declared language first: ranks 0-1 (tp 2) are the language model's, rank 2 the encoder
            ("tp2", [*over, "parallel.components={language: {num_ranks: 2, tp: 2}, vision: {num_ranks: 1}}"])]
    three = ranks(_runs, world=3, out=tmp_path / "r3", run_dir=tmp_path / "three", layouts=runs,
                  ports=[free_port() for _ in runs], timeout_s=240)
    for name, _ in layouts:
        want = one[name][0]
        for r in range(3):
            assert three[r][name][0] == pytest.approx(want, rel=1e-5), (name, r, three[r][name][0], want)
        # NOTE: every image of the 5 global batches once, on the encoder rank; the language ranks hold no tower
        assert sorted(three[0][name][1]) == sorted(one[name][1]) and three[1][name][1] is None \
            and three[2][name][1] is None, name
    assert three[0]["frozen"][0] != pytest.approx(three[0]["trained"][0], rel=1e-5)
    for r in range(3):
        assert three[r]["resumed"][0] == pytest.approx(one["trained"][0][3:], rel=1e-5), (r, three[r]["resumed"][0])
        # NOTE: language tp 2: both TP ranks read each micro-batch's embeddings, TP rank 0 sends their gradients
        assert three[r]["tp2"][0] == pytest.approx(one["trained"][0], rel=1e-5), (r, three[r]["tp2"][0])
    assert sorted(three[2]["tp2"][1]) == sorted(one["trained"][1]) and three[0]["tp2"][1] is None
    # NOTE: written by a language rank; atol 1e-4: tp 2's reduction order, through 5 Adam steps (lr-sized noise
    # where a gradient is tiny), moves weights by up to ~1e-5 (a misplaced tensor would differ by ~0.1)
    tp2 = load_file(tmp_path / "three" / "tp2" / "hf" / "model.safetensors")
    for k, t in load_file(tmp_path / "one" / "trained" / "hf" / "model.safetensors").items():
        torch.testing.assert_close(tp2[k], t, rtol=0, atol=1e-4, msg=k)
    saved = [torch.load(tmp_path / "three" / "trained" / "checkpoints" / "step_00000003" / f"rank_{r:05d}.pt",
                        weights_only=True)["model"][0] for r in range(3)]
    assert saved[0] and all(k.startswith("vision.") for k in saved[0])
    assert all(saved[r] and not any(k.startswith("vision.") for k in saved[r]) for r in (1, 2))
    # the export holds both rank sets' weights, equal to the one-process run's, and loads in transformers
    for name, _ in layouts:
        mine = load_file(tmp_path / "three" / name / "hf" / "model.safetensors")
        ref = load_file(tmp_path / "one" / name / "hf" / "model.safetensors")
        source = load_file(hf_dir / "model.safetensors")
        assert mine.keys() == ref.keys() == source.keys()
        assert any(k.startswith(("visual.", "model.visual.")) for k in mine)
        for k, t in ref.items():
            torch.testing.assert_close(mine[k], t, rtol=1e-5, atol=1e-6, msg=k)
            frozen_tower = name == "frozen" and k.startswith(("visual.", "model.visual."))
            assert torch.equal(mine[k], source[k]) == frozen_tower, (name, k)
    model, info = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / "three" / "trained" / "hf",
                                                                      output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ref = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / "one" / "trained" / "hf").state_dict()
    for k, t in model.state_dict().items():
        torch.testing.assert_close(t, ref[k], rtol=1e-5, atol=1e-6, msg=k)
