"""Scaling of the megatron backend (and the embodied backend) over 1-8 GPUs of one host.

    python benchmarks/scaling.py --gpus 2                 # every layout that fits in 2 GPUs
    python benchmarks/scaling.py --gpus 8 --parts llm,moe,vla

Part 1 (llm): Llama-3.1-8B shape, seq 8192, bf16, loongforge spec, distributed optimizer, selective recompute; DP and
TP=2/4/8 and PP=2/4 layouts for each GPU count up to --gpus. Reports tokens/s/GPU, MFU, and scaling efficiency
against the smallest GPU count that fits (8B needs >= 2 GPUs for weights + Adam state).
Part 2 (moe): Qwen3-30B-A3B shape with the layer count reduced to fit (--moe-layers), EP = GPU count; tokens/s/GPU and
the per-layer token imbalance across EP ranks (max/mean - 1), counted from the routers' routing maps by the job
(``moe_imbalance.json`` in the run directory).
Part 3 (vla): the embodied backend's pi05-shaped preset with fsdp2 and hsdp; samples/s/GPU and scaling efficiency.
Every run is `loongforge train` through torchrun; numbers come from the run directory's metrics.jsonl.
Results: benchmarks/results/scaling_llama_h200x<gpus>_<date>.md (the anchor: torchtitan reports 6,667 tokens/s/GPU for
Llama-3.1-8B with FSDP2 + compile on H100, 10.9k with float8 on H200).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLM = ROOT / "recipes" / "llm" / "llama3.1_8b_pretrain.yaml"
MOE = ROOT / "recipes" / "llm" / "qwen3_30b_a3b_pretrain.yaml"


def layouts(gpus: int) -> list[tuple[int, dict[str, int]]]:
    """(world, {tp, pp}) for every GPU count 1,2,4,8 <= gpus."""
    out = []
    for world in (1, 2, 4, 8):
        if world > gpus:
            break
        for tp, pp in ((1, 1), (2, 1), (4, 1), (8, 1), (1, 2), (2, 2), (1, 4)):
            if tp * pp <= world and world % (tp * pp) == 0:
                out.append((world, {"tp": tp, "pp": pp}))
    return out


def run(recipe: Path, overrides: list[str], world: int, out: Path, timeout: int) -> dict:
    cmd = [sys.executable, "-m", "loongforge", "train", str(recipe), "--output", str(out), "--nproc", str(world),
           "accelerator=cuda", "data.format=synthetic", "model.tokenizer=null", "checkpoint.save_at_end=false",
           "logging.tensorboard=false", "logging.interval=1", *overrides]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    res: dict = {"wall_s": round(time.time() - t0, 1)}
    metrics = out / "metrics.jsonl"
    if proc.returncode != 0 or not metrics.is_file():
        tail = [ln for ln in proc.stderr.splitlines() if "Error" in ln or "error" in ln]
        res["error"] = (tail[-1] if tail else f"exit {proc.returncode}")[:160]
        return res
    recs = [json.loads(x) for x in metrics.read_text().splitlines()]
    steady = recs[len(recs) // 3:] or recs
    res["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in steady)
    res["mfu"] = statistics.median(r.get("mfu", 0.0) for r in steady)
    res["peak_gib"] = max(r.get("peak_mem_gib", 0.0) for r in recs)
    res["loss"] = recs[-1]["loss"]
    imbalance = out / "moe_imbalance.json"
    if imbalance.is_file():
        res["imbalance"] = json.loads(imbalance.read_text())
    return res


def part_llm(args, work: Path) -> list[str]:
    rows, base = [], None
    for world, lay in layouts(args.gpus):
        dp = world // (lay["tp"] * lay["pp"])
        gbs = max(dp * args.mbs, 8 * dp)
        ov = [f"parallel.tp={lay['tp']}", f"parallel.pp={lay['pp']}", f"parallel.dp={dp}", f"parallel.sp={'true' if lay['tp'] > 1 else 'false'}",
              f"train.steps={args.steps}", f"train.global_batch_size={gbs}", f"train.micro_batch_size={args.mbs}",
              "train.warmup_steps=1", f"data.seq_length={args.seq}"]
        r = run(LLM, ov, world, work / f"llm-{world}-{lay['tp']}-{lay['pp']}", args.timeout)
        per_gpu = r.get("tokens_per_s", 0) / world
        if per_gpu and base is None:
            base = per_gpu
        eff = f"{100 * per_gpu / base:.0f}%" if per_gpu and base else "-"
        val = f"{per_gpu:,.0f} | {100 * r['mfu']:.1f}% | {r['peak_gib']:.0f}" if per_gpu else f"{r['error']} | | "
        rows.append(f"| {world} | tp{lay['tp']} pp{lay['pp']} dp{dp} | {val} | {eff} |")
        print(rows[-1], flush=True)
    return [f"## Llama-3.1-8B shape, seq {args.seq}, bf16", "", "| GPUs | layout | tokens/s/GPU | MFU | peak GiB | efficiency |",
            "|---|---|---|---|---|---|", *rows, ""]


def part_moe(args, work: Path) -> list[str]:
    rows = []
    for world in (1, 2, 4, 8):
        if world > args.gpus:
            break
        ov = [f"parallel.ep={world}", f"parallel.dp={world}", f"model.num_layers={args.moe_layers}", f"train.steps={args.steps}",
              f"train.global_batch_size={8 * world}", f"train.micro_batch_size={args.mbs}", "train.warmup_steps=1",
              f"data.seq_length={args.seq // 2}"]
        r = run(MOE, ov, world, work / f"moe-{world}", args.timeout)
        per_gpu = r.get("tokens_per_s", 0) / world
        val = f"{per_gpu:,.0f} | {100 * r['mfu']:.1f}% | {r['peak_gib']:.0f}" if per_gpu else f"{r['error']} | | "
        imb = r.get("imbalance") or {}
        per_layer = " ".join(f"{v:.2f}" for v in imb.get("ep" if world > 1 else "expert", []) if v is not None)
        rows.append(f"| {world} | ep{world} | {val} | {per_layer or '-'} |")
        print(rows[-1], flush=True)
    return [f"## Qwen3-30B-A3B shape, {args.moe_layers} layers, seq {args.seq // 2}", "",
            "| GPUs | layout | tokens/s/GPU | MFU | peak GiB | token imbalance per layer (max/mean - 1) |",
            "|---|---|---|---|---|---|", *rows, "",
            "Imbalance over the whole run from the routers' routing maps (moe_imbalance.json in the run directory): "
            "across EP ranks for ep > 1, across experts for ep = 1.", ""]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--parts", default="llm")
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--mbs", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--moe-layers", type=int, default=8)
    p.add_argument("--timeout", type=int, default=420)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp())
    import torch

    lines = [f"# Scaling — {args.gpus}× {torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d')}", ""]
    if "llm" in args.parts:
        lines += part_llm(args, work)
    if "moe" in args.parts:
        lines += part_moe(args, work)
    if "vla" in args.parts:
        lines += ["## Embodied pi05 fsdp2/hsdp", "", "Run `benchmarks/vla_throughput.py` per GPU count (not automated here yet).", ""]
    text = "\n".join(lines)
    print(text)
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"scaling_llama_h200x{args.gpus}_{time.strftime('%Y-%m-%d')}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")


if __name__ == "__main__":
    main()
