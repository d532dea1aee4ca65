"""Vision-language training throughput on one GPU: LoongForge's megatron backend (Qwen-VL on the loongforge spec:
flash attention for the language model, varlen flash attention for the vision tower's windows / images) vs
transformers eager (``attn_implementation="eager"``), same architecture, same batch, bf16.

    python benchmarks/vlm_throughput.py --model qwen2.5-vl-7b --layers 4 --vision-depth 8 --batch 4 --seq 2048

The model is the preset's shape at reduced depth (``--layers`` language layers, ``--vision-depth`` tower blocks;
widths, heads, vocabulary and the tower's full-attention / deepstack layout kept in proportion), randomly
initialised on both sides (throughput does not depend on the values). The batch is ours: ``data.format synthetic``
with one ``--image`` x ``--image`` image per sample (``--seq`` tokens per row), handed to transformers as it is
(input ids, pixel patches, grids, labels). Both train with AdamW; ours keeps fp32 master weights (megatron's mixed
precision), transformers' bf16 weights only. Reports the median step time after warm-up, tokens/s and peak memory;
the ratio prints last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


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


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def reset_peak() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def max_memory() -> int:
    import torch

    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0


def ours(args, hf_dir: Path) -> dict:
    import loongforge
    import torch
    import yaml

    recipe = {
        "backend": "megatron",
        "model": {"hf": str(hf_dir)},
        "data": {"format": "synthetic", "seq_length": args.seq, "image_size": args.image},
        "train": {"stage": "pretrain", "steps": args.steps, "global_batch_size": args.batch,
                  "micro_batch_size": args.batch, "lr": 1e-5, "lr_schedule": "constant", "weight_decay": 0.0,
                  "precision": "bf16" if args.device == "cuda" else "fp32", "seed": 1},
        "checkpoint": {"save_at_end": False},
        "accelerator": args.device,
        "logging": {"tensorboard": False, "console": False},
    }
    tmp = Path(tempfile.mkdtemp())
    (tmp / "r.yaml").write_text(yaml.safe_dump(recipe))
    job, runtime = loongforge.build_job(loongforge.load_recipe(tmp / "r.yaml"), output_dir=tmp / "run")
    batch = job.schedule.microbatches(0, device=torch.device("cpu"))[0]
    reset_peak()
    times, losses = [], []
    for _ in range(args.warmup + args.steps):
        sync()
        t0 = time.perf_counter()
        losses.append(job.step()["loss"])
        sync()
        times.append(time.perf_counter() - t0)
    peak = max_memory()
    job.close()
    runtime.logger.close()
    return {"batch": batch, "step_s": statistics.median(times[args.warmup:]), "peak_gib": peak / 2**30,
            "loss": losses[0]}


def transformers_eager(args, hf_dir: Path, batch: dict) -> dict:
    import torch
    import transformers as tf

    config = tf.AutoConfig.from_pretrained(hf_dir)
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    with dev:
        model = tf.AutoModelForImageTextToText.from_config(config, dtype=dtype,
                                                           attn_implementation="eager")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0, foreach=True)
    inputs = {"input_ids": batch["tokens"].to(dev), "pixel_values": batch["pixel_values"].to(dev, dtype),
              "image_grid_thw": batch["image_grid_thw"].to(dev), "labels": batch["tokens"].to(dev)}
    # NOTE: transformers >= 5.2x computes M-RoPE from the processor's mm_token_type_ids (1: image token); older ones
    # find the image tokens themselves and may not take the key
    inputs["mm_token_type_ids"] = (inputs["input_ids"] == config.image_token_id).long()
    try:
        model(**inputs)
    except (TypeError, ValueError):
        inputs.pop("mm_token_type_ids")
    reset_peak()
    times, losses = [], []
    for _ in range(args.warmup + args.steps):
        sync()
        t0 = time.perf_counter()
        loss = model(**inputs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    peak = max_memory()
    del model, opt
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"step_s": statistics.median(times[args.warmup:]), "peak_gib": peak / 2**30, "loss": losses[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-vl-7b", help="a Qwen-VL preset (qwen2.5-vl-7b, qwen3-vl-8b, ...)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vision-depth", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--image", type=int, default=448, help="image side in pixels (a multiple of patch x merge)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda", help="cuda; cpu only to check the script on a small preset")
    args = ap.parse_args()

    import torch

    hf_dir = Path(tempfile.mkdtemp()) / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps(reduced_config(args.model, layers=args.layers,
                                                                  vision_depth=args.vision_depth)))
    print(f"{args.model} at {args.layers} language layers / {args.vision_depth} vision blocks, batch {args.batch} x "
          f"{args.seq} tokens, one {args.image} px image per sample, "
          f"{torch.cuda.get_device_name() + ', bf16' if args.device == 'cuda' else 'cpu, fp32'}", flush=True)
    mine = ours(args, hf_dir)
    batch = mine.pop("batch")
    images = int(batch["image_grid_thw"].shape[0])
    patches = int(batch["pixel_values"].shape[0])
    print(f"batch: tokens {tuple(batch['tokens'].shape)}, {images} images, {patches} patches", flush=True)
    theirs = transformers_eager(args, hf_dir, batch)
    tokens = args.batch * args.seq
    rows = [("loongforge (megatron, loongforge spec)", mine), ("transformers eager", theirs)]
    print("| variant | step (s) | tokens/s | peak GiB | first loss |")
    print("| --- | --- | --- | --- | --- |")
    for name, r in rows:
        print(f"| {name} | {r['step_s']:.3f} | {tokens / r['step_s']:,.0f} | {r['peak_gib']:.1f} | {r['loss']:.3f} |")
    print(f"ratio (ours / transformers eager, tokens/s): {theirs['step_s'] / mine['step_s']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
