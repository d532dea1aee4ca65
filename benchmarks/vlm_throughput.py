"""Vision-language training throughput on one GPU: LoongForge's megatron backend (Qwen-VL on the loongforge spec:
flash attention for the language model, varlen flash attention for the vision tower's windows / images, the fused
linear cross-entropy for the output layer) vs transformers eager (``attn_implementation="eager"``) and transformers
compiled (its default sdpa attention, the decoder layers and the loss under torch.compile), same architecture,
same weights, same batches, bf16.

    python benchmarks/vlm_throughput.py --model qwen3-vl-8b --layers 4 --vision-depth 8 --batch 4 --seq 2048
    python benchmarks/vlm_throughput.py --model qwen3-vl-8b --sft 64 --variants loongforge_packed,loongforge_padded,hf_eager

The model is the preset's shape at reduced depth (``--layers`` language layers, ``--vision-depth`` tower blocks;
widths, heads, vocabulary and the tower's full-attention / deepstack layout kept in proportion), randomly
initialised once by transformers and saved; every variant starts from that checkpoint (ours loads it with
``checkpoint.load``), so the losses can be compared. Batches are ours: ``data.format synthetic`` (one ``--image`` x
``--image`` image per sample, ``--seq`` tokens per row), or with ``--sft N`` ``data.format conversations`` over N
generated records (one image each, of a random size up to ``--image``, and a random number of words), packed into
one row per micro-batch (``loongforge_packed``) or padded to ``--seq`` (``loongforge_padded``, and transformers on
those rows). transformers gets each step's micro-batch as it is (input ids, pixel patches, grids; labels where our
loss mask is, so both average the same tokens but our row's last one, whose label lies past the row).

Every variant runs in its own process (clean memory, its own ``--timeout NAME=N`` entry; see ``harness.py``). Both train with AdamW and clip
the gradient norm at 1; ours keeps fp32 master weights (megatron's mixed precision), transformers bf16 weights only.
``hf_compile`` compiles each decoder layer (``Module.compile``, torch's regional compilation) and the loss over
the logits; the vision blocks stay eager (they graph-break on per-image lengths). Batches are made before the timed steps on both sides (the step time holds the host to
device copy, not the data preparation, which ours reports apart). Reports the median step time after warm-up,
tokens/s (real tokens: padding not counted), peak memory and the losses; the ratios print last. Rows go to
``benchmarks/results/vlm_throughput.md``.

    python benchmarks/vlm_throughput.py --smoke       # CPU, qwen2.5-vl-tiny, 2 steps: checks the script itself
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import harness

SPECIAL = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def reduced_config(model: str, *, layers: int, vision_depth: int) -> dict:
    """The HF config of ``model``'s preset with ``layers`` language layers and ``vision_depth`` tower blocks."""
    from loongforge_megatron.models.registry import presets

    spec, fields = presets()[model]
    fields = json.loads(json.dumps(fields))
    full_depth = fields["vision"]["vision_config"]["depth"]
    v = fields["vision"]["vision_config"]
    v["depth"] = vision_depth

    if "fullatt_block_indexes" in v:  # NOTE: the same period (Qwen2.5-VL: every 8th block attends the whole image)
        period = full_depth // len(v["fullatt_block_indexes"])
        v["fullatt_block_indexes"] = [i for i in range(vision_depth) if (i + 1) % period == 0] or [vision_depth - 1]
    if "deepstack_visual_indexes" in v:  # the same number of deepstack features, at proportional depths
        v["deepstack_visual_indexes"] = sorted({i * vision_depth // full_depth for i in v["deepstack_visual_indexes"]})
    fields["num_layers"] = layers
    return spec.hf_config(spec.arch(fields), torch_dtype="bfloat16")


def save_checkpoint(config: dict, out: Path, *, device: str) -> None:
    """transformers' random initialisation of ``config``, saved (bf16 on CUDA) for every variant to load."""
    import torch
    import transformers as tf

    (out / "config.json").write_text(json.dumps(config))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = tf.AutoModelForImageTextToText.from_config(tf.AutoConfig.from_pretrained(out), dtype=dtype)
    model.save_pretrained(out)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def save_sft_data(out: Path, config: dict, *, records: int, side: int, seq: int, seed: int = 0) -> Path:
    """``records`` image-text conversations (one image of a random size up to ``side`` px, a question and an answer
    of random lengths) under ``out / "data"``, and a processor for them in ``out`` (a byte-level BPE tokenizer with
    Qwen-VL's special tokens, Qwen2-VL's image processor at the model's patch size, the chat template); ``config``'s
    special token ids become the tokenizer's. Returns the records file."""
    from loongforge_megatron.data.tokenizer import train_bpe
    from loongforge_megatron.models.qwen_vl.data import QWEN_VL_CHAT_TEMPLATE
    from PIL import Image
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen3VLProcessor

    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7))) for _ in range(400)]
    v = config["vision_config"]
    unit = v["patch_size"] * v["spatial_merge_size"]
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    lines, texts = [], []
    for n in range(records):
        w, h = (rng.randint(4, side // unit) * unit for _ in range(2))
        Image.effect_noise((w, h), 64).convert("RGB").save(data / f"{n}.png")
        question = " ".join(rng.choices(words, k=rng.randint(2, max(2, seq // 50))))
        answer = " ".join(rng.choices(words, k=rng.randint(4, max(4, seq // 4))))
        texts += [question, answer]
        lines.append(json.dumps({"conversations": [{"from": "human", "value": f"<image>\n{question}"},
                                                   {"from": "gpt", "value": answer}], "images": [f"{n}.png"]}))
    (data / "records.jsonl").write_text("\n".join(lines) + "\n")
    tok = train_bpe(texts, vocab_size=min(1024, config["text_config"]["vocab_size"] - 2 * len(SPECIAL)), out_dir=out)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    tok.eos_token, tok.pad_token = "<|im_end|>", "<|im_end|>"
    images = Qwen2VLImageProcessor(patch_size=v["patch_size"], merge_size=v["spatial_merge_size"],
                                   temporal_patch_size=v["temporal_patch_size"], min_pixels=unit * unit * 16,
                                   max_pixels=side * side)
    qwen3 = config["model_type"] == "qwen3_vl"
    if qwen3:
        from transformers import Qwen3VLVideoProcessor as Video
    else:
        from transformers import Qwen2VLVideoProcessor as Video
    video = Video(patch_size=v["patch_size"], merge_size=v["spatial_merge_size"],
                  temporal_patch_size=v["temporal_patch_size"])
    processor = (Qwen3VLProcessor if qwen3 else Qwen2_5_VLProcessor)(
        image_processor=images, tokenizer=tok, video_processor=video, chat_template=QWEN_VL_CHAT_TEMPLATE)
    processor.save_pretrained(out)
    t = tok.convert_tokens_to_ids
    config.update(image_token_id=t("<|image_pad|>"), video_token_id=t("<|video_pad|>"),
                  vision_start_token_id=t("<|vision_start|>"), vision_end_token_id=t("<|vision_end|>"))
    return data / "records.jsonl"


def _hf(args) -> Path:
    return Path(args.work) / "hf"


def _real_tokens(args, res: dict) -> dict:
    """Real tokens a step (padding not counted): the micro-batch's slots for synthetic and packed rows; for padded
    rows (ours and transformers' on them) the packed run's count, which an SFT run makes first."""
    real = Path(args.work) / "real_tokens.json"
    if "slots" in res and (not args.sft or args.variant_name == "loongforge_packed"):
        res["items"] = statistics.mean(res["slots"][min(args.warmup, len(res["slots"]) - 1):])
        if args.sft:
            real.write_text(json.dumps(res["items"]))
    elif not args.sft:
        res["items"] = args.batch * args.seq
    else:
        res["items"] = json.loads(real.read_text()) if real.is_file() else statistics.mean(res.get("slots") or [0])
    return res


def run_ours(args, *, pack: bool | None, plain_ce: bool = False, gaf: bool = False) -> dict:
    """Our job on the checkpoint; ``pack`` None: synthetic rows, else the SFT records packed or padded; ``gaf``:
    with ``kernels.grad_accum_fusion``. ``loongforge`` and ``loongforge_padded`` write the steps' micro-batches for
    the transformers variants."""
    import tempfile

    import loongforge
    import torch
    import yaml

    if plain_ce:  # A/B row: the output layer's logits + megatron's cross-entropy instead of the fused linear CE
        from loongforge_megatron.layers import output

        def plain(*, hidden_states, output_layer, output_weight, labels, compute_language_model_loss, **_):
            logits, _ = output_layer(hidden_states, weight=output_weight)
            return compute_language_model_loss(labels, logits)

        output.fused_output_processor = plain

    data = {"format": "synthetic", "seq_length": args.seq, "image_size": args.image}
    if pack is not None:
        data = {"format": "conversations", "path": str(_hf(args) / "data" / "records.jsonl"),
                "seq_length": args.seq, "pack": pack}
    recipe = {
        "backend": "megatron",
        "model": {"hf": str(_hf(args))},
        "data": data,
        "train": {"stage": "cpt" if pack is None else "sft", "steps": args.steps,
                  "global_batch_size": args.batch, "micro_batch_size": args.batch, "lr": 1e-5,
                  "lr_schedule": "constant", "warmup_steps": 0, "weight_decay": 0.0, "grad_clip": 1.0,
                  "precision": "bf16" if args.device == "cuda" else "fp32", "seed": 1},
        "checkpoint": {"load": str(_hf(args)), "save_at_end": False},
        "accelerator": args.device,
        "logging": {"tensorboard": False, "console": False},
    }
    if gaf:
        recipe["kernels"] = {"grad_accum_fusion": True}
    tmp = Path(tempfile.mkdtemp())
    (tmp / "r.yaml").write_text(yaml.safe_dump(recipe))
    job, runtime = loongforge.build_job(loongforge.load_recipe(tmp / "r.yaml"), output_dir=tmp / "run")
    n = args.steps
    t0 = time.perf_counter()
    extra = 2 * args.profile + 2 * bool(args.trace)
    batches = [job.schedule.microbatches(i, device=torch.device("cpu")) for i in range(n + extra)]
    data_s = (time.perf_counter() - t0) / len(batches)
    if args.variant_name in ("loongforge", "loongforge_padded"):
        torch.save(batches[:n], Path(args.work) / "batches.pt")
    # NOTE: the steps take these batches (host to device copy timed, data preparation not: as transformers' steps)
    job.schedule.microbatches = lambda step, *, device: batches[step]
    res = harness.time_steps(lambda: job.step()["loss"], steps=n, device=args.device)
    if args.profile and torch.cuda.is_available():
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                job.step()
            harness.sync(args.device)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=80), flush=True)
    if args.trace and torch.cuda.is_available():
        trace(job, Path(args.trace))
    job.close()
    runtime.logger.close()
    slots = [sum(int(m["tokens"].numel()) for m in step) for step in batches[:n]]
    labels = [sum(int(m["loss_mask"].sum()) for m in step) for step in batches[:n]]
    return _real_tokens(args, {**res, "slots": slots, "labels": labels, "data_s": data_s})


def trace(job, out: Path) -> None:
    """Where the host holds the GPU up: one step's CPU + CUDA timeline with Python stacks (a chrome trace,
    ``out / "step_trace.json.gz"``), then the Python stack of every call that synchronises the host with the GPU in
    another step (CUDA's sync debug mode), each place once with its count."""
    import gzip
    import traceback
    import warnings

    import torch
    from torch.profiler import ProfilerActivity, profile

    out.mkdir(parents=True, exist_ok=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        job.step()
        harness.sync("cuda")
    raw = out / "step_trace.json"
    prof.export_chrome_trace(str(raw))
    with raw.open("rb") as f, gzip.open(out / "step_trace.json.gz", "wb") as g:
        g.write(f.read())
    raw.unlink()
    seen: dict[str, int] = {}

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message) or "prototype" in str(message):
            return
        stack = "".join(traceback.format_stack()[:-2][-12:])
        seen[stack] = seen.get(stack, 0) + 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            job.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    text = "\n".join(f"--- {n} x\n{stack}" for stack, n in sorted(seen.items(), key=lambda kv: -kv[1]))
    (out / "syncs.txt").write_text(f"{sum(seen.values())} synchronising calls in one step ({len(seen)} places)\n"
                                   + text)
    print(f"trace: {sum(seen.values())} synchronising calls in one step ({len(seen)} places); "
          f"{out}/syncs.txt, {out}/step_trace.json.gz", flush=True)


def hf_inputs(micro: dict, *, image_token: int, device, dtype) -> dict:
    """A micro-batch of ours as transformers' model takes it; labels: the tokens our loss mask trains on."""
    import torch

    tokens = micro["tokens"].to(device)
    mask = micro["loss_mask"].to(device) > 0
    labels = torch.full_like(tokens, -100)
    # NOTE: our labels are shifted (position i predicts token i + 1 where loss_mask[i]); transformers shifts itself
    labels[:, 1:] = torch.where(mask[:, :-1], tokens[:, 1:], -100)
    return {"input_ids": tokens, "pixel_values": micro["pixel_values"].to(device, dtype),
            "image_grid_thw": micro["image_grid_thw"].to(device), "labels": labels,
            "mm_token_type_ids": (tokens == image_token).long()}


def run_hf(args, *, compiled: bool) -> dict:
    import torch
    import torch.nn.functional as F
    import transformers as tf

    dev = torch.device(args.device)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    # NOTE: eager: transformers' eager attention; compiled: its default (sdpa), the repeated blocks compiled
    model = tf.AutoModelForImageTextToText.from_pretrained(_hf(args), dtype=dtype,
                                                           attn_implementation="sdpa" if compiled else "eager").to(dev)
    model.train()
    image_token = model.config.image_token_id
    steps = torch.load(Path(args.work) / "batches.pt")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0, foreach=True)
    # NOTE: transformers >= 5.2x computes M-RoPE from the processor's mm_token_type_ids (1: image token); older ones
    # find the image tokens themselves and may not take the key
    probe = hf_inputs(steps[0][0], image_token=image_token, device=dev, dtype=dtype)
    with torch.no_grad():
        try:
            model(**probe)
            drop = ()
        except (TypeError, ValueError):
            drop = ("mm_token_type_ids",)
    loss_fn = None
    if compiled:  # NOTE: regional compilation: the decoder layer once, then reused (torch's recommended form); the
        # vision blocks stay eager: their attention splits q / k / v by per-image lengths read to the host (a graph
        # break whose pieces would recompile per image layout)
        for m in model.modules():
            if type(m).__name__.endswith("DecoderLayer"):
                m.compile()

        @torch.compile
        def loss_fn(logits, labels):
            return F.cross_entropy(logits.float()[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)

    batches = iter(steps)

    def step() -> float:
        micro = [hf_inputs(m, image_token=image_token, device=dev, dtype=dtype) for m in next(batches)]
        total = 0.0
        count = max(1, sum(int((m["labels"] != -100).sum()) for m in micro))
        for inputs in micro:
            inputs = {k: v for k, v in inputs.items() if k not in drop}
            n = int((inputs["labels"] != -100).sum())
            if loss_fn is None:
                loss = model(**inputs).loss
            else:
                labels = inputs.pop("labels")
                loss = loss_fn(model(**inputs).logits, labels)
            (loss * n / count).backward()
            total += float(loss.detach()) * n / count
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    return _real_tokens(args, harness.time_steps(step, steps=len(steps), device=args.device))


VARIANTS = {
    "loongforge": lambda a: run_ours(a, pack=None),
    "loongforge_plain_ce": lambda a: run_ours(a, pack=None, plain_ce=True),
    "loongforge_gaf": lambda a: run_ours(a, pack=None, gaf=True),
    "loongforge_packed": lambda a: run_ours(a, pack=True),
    "loongforge_padded": lambda a: run_ours(a, pack=False),
    "hf_eager": lambda a: run_hf(a, compiled=False),
    "hf_compile": lambda a: run_hf(a, compiled=True),
}
PEERS = ("hf_eager", "hf_compile", "loongforge_padded", "loongforge_plain_ce", "loongforge_gaf")


def notes(rows: dict[str, dict]) -> list[str]:
    """Host time to make a step's micro-batches (not in the step time), and the padding packing saved."""
    lines = [f"{name}: making a step's micro-batches took {r['data_s']:.3f} s (not in the step time)."
             for name, r in rows.items() if "data_s" in r]
    packed, padded = rows.get("loongforge_packed", {}), rows.get("loongforge_padded", {})
    if "slots" in packed and "slots" in padded:
        same = padded["labels"] == packed["labels"]
        a, b = sum(packed["slots"]), sum(padded["slots"])
        lines.append(f"Packing: {a / len(packed['slots']):,.0f} token slots a step instead of "
                     f"{b / len(padded['slots']):,.0f} ({1 - a / b:.1%} padding saved); the same records every step: "
                     f"{'yes' if same else 'NO'} (labelled tokens {packed['labels'][0]} vs {padded['labels'][0]} at "
                     "step 1).")
    return lines


BENCH = harness.Bench(
    name="vlm_throughput", script=__file__, variants=VARIANTS, unit="real tokens/s", notes=notes,
    pairs=[*(("loongforge", p) for p in PEERS), ("loongforge_packed", "loongforge_padded"),
           *(("loongforge_packed", p) for p in ("hf_eager", "hf_compile")),
           *(("loongforge_padded", p) for p in ("hf_eager", "hf_compile"))])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-vl-7b", help="a Qwen-VL preset (qwen2.5-vl-7b, qwen3-vl-8b, ...)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vision-depth", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--image", type=int, default=448, help="image side in pixels (a multiple of patch x merge); "
                    "with --sft the largest side")
    ap.add_argument("--sft", type=int, default=0, help="SFT on this many generated image-text records (0: synthetic; "
                    "then give --variants loongforge_packed,loongforge_padded,hf_eager)")
    ap.add_argument("--profile", action="store_true", help="print a CUDA kernel profile of two of our steps")
    ap.add_argument("--trace", default=None, help="a folder: write a CPU + CUDA trace of one of our steps and the "
                    "stacks of its host-GPU synchronisations there")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    harness.add_args(ap, variants=VARIANTS, default="loongforge,hf_eager,hf_compile")
    args = harness.parse(ap, argv, steps=6, warmup=2, smoke={
        "model": "qwen2.5-vl-tiny", "layers": 2, "vision_depth": 2, "batch": 1, "seq": 128, "image": 56,
        "device": "cpu", "variants": "loongforge,hf_eager"})
    if args.trace and args.variant:
        args.trace = str(Path(args.trace) / args.variant)

    def prepare(a, work: Path) -> None:
        hf = work / "hf"
        hf.mkdir()
        config = reduced_config(a.model, layers=a.layers, vision_depth=a.vision_depth)
        if a.sft:
            save_sft_data(hf, config, records=a.sft, side=a.image, seq=a.seq)
        save_checkpoint(config, hf, device=a.device)

    what = f"{args.sft} SFT records (<= {args.image} px images)" if args.sft else f"synthetic rows ({args.image} px)"
    setup = (f"{args.model} at {args.layers} language layers / {args.vision_depth} vision blocks, micro-batch "
             f"{args.batch} x {args.seq}, {what}, {'bf16' if args.device == 'cuda' else 'fp32'}")
    return BENCH.main(args, setup=setup, device=args.device, prepare=prepare)


if __name__ == "__main__":
    main()
