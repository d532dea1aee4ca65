"""DiT training throughput: LoongForge's megatron backend (our SDPA spec) vs diffusers' ``DiTTransformer2DModel``
eager and + ``torch.compile`` (ours also with ``train.compile``, and with ``kernels.grad_accum_fusion``), same model, weights, data, objective and optimizer, on one device.

    python benchmarks/dit_throughput.py --preset dit-xl-2-256 --batch 64 --steps 20          # one GPU
    python benchmarks/dit_throughput.py --preset dit-tiny --batch 8 --steps 4 --device cpu    # smoke test

Every variant runs in its own process and starts from the same random-init diffusers checkpoint (weights
perturbed so no adaLN gate is zero). Data: our synthetic latents (labels with 10% classifier-free-guidance
dropout, timesteps and noise drawn per sample). Objective for both: DiT's hybrid loss — MSE on the noise plus
L_vlb for the learned variance (``models.dit.model.variational_bound``, the same function on both sides). AdamW
(lr 1e-4, no weight decay, betas 0.9 / 0.999), grad clip 1.0, bf16 autocast on the peer and bf16 params with fp32
master weights on ours (GPU; fp32 on CPU). Median images/s after warm-up, MFU (6·N + 12·L·H·T FLOPs per patch
token, against 989 TFLOP/s dense bf16), peak memory and the losses; ratios last.
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

PEAK_BF16 = 989e12  # H100 / H200 SXM dense bf16


def make_diffusers(preset: str, out: Path) -> None:
    import torch
    from diffusers import DiTTransformer2DModel
    from loongforge_megatron.models.dit.arch import DiTArch
    from loongforge_megatron.models.registry import presets

    arch = DiTArch(**presets()[preset][1])
    torch.manual_seed(0)
    model = DiTTransformer2DModel(num_attention_heads=arch.num_attention_heads,
                                  attention_head_dim=arch.hidden_size // arch.num_attention_heads,
                                  in_channels=arch.in_channels, out_channels=arch.out_channels,
                                  num_layers=arch.num_layers, sample_size=arch.sample_size, patch_size=arch.patch_size,
                                  num_embeds_ada_norm=arch.num_classes)
    with torch.no_grad():  # NOTE: DiT zero-initialises its gates; a zero gate would make every block the identity
        for block in model.transformer_blocks:
            for p in block.norm1.linear.parameters():
                p.normal_(0.0, 0.02)
            # NOTE: one timestep / class embedder for all blocks, as DiT has (diffusers draws a copy per block;
            # the facebook/DiT-* conversions copy one, and our import requires equal copies)
            block.norm1.emb.load_state_dict(model.transformer_blocks[0].norm1.emb.state_dict())
    model.save_pretrained(out)


def run_ours(args, compiled: bool = False, grad_accum_fusion: bool = False) -> dict:
    import loongforge
    import torch
    import yaml

    recipe = {
        "backend": "megatron",
        "model": {"hf": args.hf_dir},
        "data": {"format": "latents", "class_dropout": 0.1},
        "train": {"stage": "cpt", "steps": args.steps, "global_batch_size": args.batch, "micro_batch_size": args.batch,
                  "lr": 1e-4, "lr_schedule": "constant", "warmup_steps": 0, "weight_decay": 0.0, "adam_beta2": 0.999,
                  "grad_clip": 1.0, "precision": "bf16" if args.device == "cuda" else "fp32", "seed": 1,
                  "compile": compiled},
        "checkpoint": {"load": args.hf_dir, "save_at_end": False},
        "accelerator": args.device,
        "kernels": {"layers": "loongforge", "grad_accum_fusion": grad_accum_fusion},
        "logging": {"tensorboard": False, "interval": 5, "console": False},
    }
    tmp = Path(tempfile.mkdtemp())
    (tmp / "r.yaml").write_text(yaml.safe_dump(recipe))
    job, _ = loongforge.build_job(loongforge.load_recipe(tmp / "r.yaml"), output_dir=tmp / "run")
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    for _ in range(args.steps):
        m = job.step()
        losses.append(m["loss"])
        times.append(m["step_time"])
    peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None
    profile = _profile(job.step, args) if args.profile else None
    job.close()
    return {"losses": losses, "times": times, "peak_gib": peak, "profile": profile}


def _profile(step, args) -> str:
    """Host and kernel time of three more steps (torch.profiler), top entries of each, and the GPU busy share."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(3):
            step()
        if args.device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    avg = prof.key_averages()
    kernel_us = sum(e.self_device_time_total for e in avg if e.device_type.name == "CUDA")
    out = [f"3 steps: wall {wall * 1e3:.1f} ms, kernel time {kernel_us / 1e3:.1f} ms "
           f"(GPU busy <= {100 * kernel_us / 1e6 / wall:.1f}%)", "",
           avg.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70)]
    if args.device == "cuda":
        out.append(avg.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70))
    return "\n".join(out)


def run_diffusers(args, compiled: bool) -> dict:
    import torch
    from diffusers import DDPMScheduler, DiTTransformer2DModel
    from loongforge_megatron.models.dit.arch import arch_from_diffusers
    from loongforge_megatron.models.dit.data import SyntheticLatents
    from loongforge_megatron.models.dit.model import variational_bound

    device = torch.device(args.device)
    model = DiTTransformer2DModel.from_pretrained(args.hf_dir, torch_dtype=torch.float32).to(device).train()
    arch = arch_from_diffusers(json.loads((Path(args.hf_dir) / "config.json").read_text()))
    for block in model.transformer_blocks:  # NOTE: labels come dropped by the data (as ours); no second dropout
        block.norm1.emb.class_embedder.dropout_prob = 0.0
    fwd = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                            fused=device.type == "cuda")
    scheduler = DDPMScheduler(num_train_timesteps=1000, beta_schedule="linear")
    data = SyntheticLatents(arch=arch, seed=1, class_dropout=0.1)
    c = arch.in_channels
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    for step in range(args.steps):
        samples = [data[step * args.batch + i] for i in range(args.batch)]
        batch = {k: torch.stack([s[k] for s in samples]).to(device) for k in samples[0]}
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        noisy = scheduler.add_noise(batch["latents"], batch["noise"], batch["timesteps"])
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            pred = fwd(noisy, batch["timesteps"], batch["labels"]).sample.float()
        loss = (pred[:, :c] - batch["noise"]).pow(2).mean()
        if pred.shape[1] == 2 * c:
            loss = loss + variational_bound(batch["latents"], noisy, batch["timesteps"], pred[:, :c], pred[:, c:],
                                            scheduler).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return {"losses": losses, "times": times, "peak_gib": peak}


VARIANTS = {
    "loongforge": run_ours,
    "loongforge_compile": lambda a: run_ours(a, True),
    # NOTE: weight gradients accumulated straight into megatron's fp32 main_grad (no bf16 grad + add_ per weight)
    "loongforge_compile_gaf": lambda a: run_ours(a, True, grad_accum_fusion=True),
    "diffusers_eager": lambda a: run_diffusers(a, False),
    "diffusers_compile": lambda a: run_diffusers(a, True),
}


def child(args) -> None:
    try:
        out = VARIANTS[args.variant](args)
    except Exception as exc:  # OOM or a failure: report it as a row, keep the other variants
        out = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}
    Path(args.json).write_text(json.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="dit-xl-2-256")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--variants", default="loongforge,loongforge_compile,diffusers_eager,diffusers_compile")
    p.add_argument("--out", default=None, help="write the table (markdown) here too")
    p.add_argument("--profile", action="store_true", help="ours: profile three more steps (printed, and in --out)")
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--hf-dir", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:
        return child(args)
    from loongforge_megatron.models.dit.arch import arch_from_diffusers

    work = Path(tempfile.mkdtemp())
    hf_dir = work / "dit"
    make_diffusers(args.preset, hf_dir)
    arch = arch_from_diffusers(json.loads((hf_dir / "config.json").read_text()))
    tokens = (arch.sample_size // arch.patch_size) ** 2
    fpt = arch.flops_per_token(tokens)
    if args.device == "cuda":
        import torch

        device = torch.cuda.get_device_name()
    else:
        device = "CPU"
    rows = {}
    for name in args.variants.split(","):
        js = work / f"{name}.json"
        cmd = [sys.executable, __file__, "--variant", name, "--hf-dir", str(hf_dir), "--json", str(js),
               "--batch", str(args.batch), "--steps", str(args.steps), "--device", args.device] + \
              (["--profile"] if args.profile else [])
        t0 = time.time()
        subprocess.run(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=900)
        res = json.loads(js.read_text()) if js.is_file() else {"error": "no result (crashed)"}
        res["wall_s"] = time.time() - t0
        if "times" in res:
            t = statistics.median(res["times"][min(args.warmup, len(res["times"]) - 1):])
            res["images_per_s"] = args.batch / t
            res["mfu"] = res["images_per_s"] * tokens * fpt / PEAK_BF16
        rows[name] = res
        print(name, {k: v for k, v in res.items() if k not in ("losses", "times", "profile")}, flush=True)

    lines = [f"# DiT training throughput — {args.preset}, batch {args.batch}, one {device}, {time.strftime('%Y-%m-%d')}",
             "", f"{tokens} patch tokens per image; FLOPs/token = {fpt / 1e9:.2f} GFLOP (6·N + 12·L·H·T); MFU against "
             f"{PEAK_BF16 / 1e12:.0f} TFLOP/s dense bf16. {args.steps} steps, median step time after {args.warmup} "
             "warm-up steps. Same diffusers random-init weights, synthetic latents and objective (MSE + L_vlb) for all.",
             "", "| variant | images/s | MFU | peak GiB | loss step 1 → last |", "|---|---|---|---|---|"]
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"| {name} | {r['error']} | | | |")
            continue
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "n/a"
        lines.append(f"| {name} | {r['images_per_s']:,.1f} | {100 * r['mfu']:.1f}% | {peak} | "
                     f"{r['losses'][0]:.4f} → {r['losses'][-1]:.4f} |")
    lines.append("")
    for mine, peer in (("loongforge", "diffusers_eager"), ("loongforge_compile", "loongforge"),
                       ("loongforge_compile", "diffusers_compile"), ("loongforge_compile_gaf", "loongforge_compile"),
                       ("loongforge_compile_gaf", "diffusers_compile")):
        ours, r = rows.get(mine, {}), rows.get(peer, {})
        if "losses" in ours and "losses" in r:
            n = min(len(r["losses"]), len(ours["losses"]))
            diffs = [abs(a - b) / abs(b) for a, b in zip(ours["losses"][:n], r["losses"][:n], strict=True)]
            lines.append(f"Loss of {mine} vs {peer} over {n} steps: max relative difference {max(diffs):.2e}.")
        if "images_per_s" in ours and "images_per_s" in r:
            lines.append(f"{mine} / {peer}: {ours['images_per_s'] / r['images_per_s']:.2f}x")
    for name, r in rows.items():
        if r.get("profile"):
            lines += ["", f"## Profile of {name}", "", "```", r["profile"], "```"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
