"""DiT training throughput: LoongForge's megatron backend (our SDPA spec) vs diffusers' ``DiTTransformer2DModel``
eager and + ``torch.compile`` (ours also with ``train.compile``, and with ``kernels.grad_accum_fusion``), same model, weights, data, objective and optimizer, on one device.

    python benchmarks/dit_throughput.py --preset dit-xl-2-256 --batch 64 --steps 20          # one GPU
    python benchmarks/dit_throughput.py --smoke       # CPU, dit-tiny, 2 steps: checks the script itself

Every variant runs in its own process and starts from the same random-init diffusers checkpoint (weights
perturbed so no adaLN gate is zero). Data: our synthetic latents (labels with 10% classifier-free-guidance
dropout, timesteps and noise drawn per sample). Objective for both: DiT's hybrid loss — MSE on the noise plus
L_vlb for the learned variance (``models.dit.model.variational_bound``, the same function on both sides). AdamW
(lr 1e-4, no weight decay, betas 0.9 / 0.999), grad clip 1.0, bf16 autocast on the peer and bf16 params with fp32
master weights on ours (GPU; fp32 on CPU). Median images/s after warm-up, MFU (6·N + 12·L·H·T FLOPs per patch
token, against 989 TFLOP/s dense bf16), peak memory and the losses; ratios last. Rows go to
``benchmarks/results/dit_throughput.md`` (see ``harness.py``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import harness


def make_diffusers(args, out: Path) -> None:
    import torch
    from diffusers import DiTTransformer2DModel
    from loongforge_megatron.models.dit.arch import DiTArch
    from loongforge_megatron.models.registry import presets

    arch = DiTArch(**presets()[args.preset][1])
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


def _hf(args) -> str:
    return str(Path(args.work) / "dit")


def _items(args, res: dict) -> dict:
    """Images per step, and FLOPs per image: 6·N + 12·L·H·T per patch token, times the tokens."""
    from loongforge_megatron.models.dit.arch import arch_from_diffusers

    arch = arch_from_diffusers(json.loads((Path(_hf(args)) / "config.json").read_text()))
    tokens = (arch.sample_size // arch.patch_size) ** 2
    res.update(items=args.batch, flops_per_item=tokens * arch.flops_per_token(tokens))
    return res


def run_ours(args, compiled: bool = False, grad_accum_fusion: bool = False) -> dict:
    import tempfile

    import loongforge
    import yaml

    recipe = {
        "backend": "megatron",
        "model": {"hf": _hf(args)},
        "data": {"format": "latents", "class_dropout": 0.1},
        "train": {"stage": "cpt", "steps": args.steps, "global_batch_size": args.batch, "micro_batch_size": args.batch,
                  "lr": 1e-4, "lr_schedule": "constant", "warmup_steps": 0, "weight_decay": 0.0, "adam_beta2": 0.999,
                  "grad_clip": 1.0, "precision": "bf16" if args.device == "cuda" else "fp32", "seed": 1,
                  "compile": compiled},
        "checkpoint": {"load": _hf(args), "save_at_end": False},
        "accelerator": args.device,
        "kernels": {"layers": "loongforge", "grad_accum_fusion": grad_accum_fusion},
        "logging": {"tensorboard": False, "interval": 5, "console": False},
    }
    tmp = Path(tempfile.mkdtemp())
    (tmp / "r.yaml").write_text(yaml.safe_dump(recipe))
    job, _ = loongforge.build_job(loongforge.load_recipe(tmp / "r.yaml"), output_dir=tmp / "run")
    res = harness.job_steps(job, steps=args.steps, device=args.device)
    res["profile"] = _profile(job.step, args) if args.profile else None
    job.close()
    return _items(args, res)


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
    model = DiTTransformer2DModel.from_pretrained(_hf(args), torch_dtype=torch.float32).to(device).train()
    arch = arch_from_diffusers(json.loads((Path(_hf(args)) / "config.json").read_text()))
    for block in model.transformer_blocks:  # NOTE: labels come dropped by the data (as ours); no second dropout
        block.norm1.emb.class_embedder.dropout_prob = 0.0
    fwd = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                            fused=device.type == "cuda")
    scheduler = DDPMScheduler(num_train_timesteps=1000, beta_schedule="linear")
    data = SyntheticLatents(arch=arch, seed=1, class_dropout=0.1)
    c = arch.in_channels
    steps = iter(range(10**9))

    def step():
        i = next(steps)
        samples = [data[i * args.batch + j] for j in range(args.batch)]
        batch = {k: torch.stack([s[k] for s in samples]).to(device) for k in samples[0]}
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
        return loss.detach()

    return _items(args, harness.time_steps(step, steps=args.steps, device=args.device))


VARIANTS = {
    "loongforge": run_ours,
    "loongforge_compile": lambda a: run_ours(a, True),
    # NOTE: weight gradients accumulated straight into megatron's fp32 main_grad (no bf16 grad + add_ per weight)
    "loongforge_compile_gaf": lambda a: run_ours(a, True, grad_accum_fusion=True),
    "diffusers_eager": lambda a: run_diffusers(a, False),
    "diffusers_compile": lambda a: run_diffusers(a, True),
}


BENCH = harness.Bench(
    name="dit_throughput", script=__file__, variants=VARIANTS, unit="images/s",
    pairs=[("loongforge", "diffusers_eager"), ("loongforge_compile", "loongforge"),
           ("loongforge_compile", "diffusers_compile"), ("loongforge_compile_gaf", "loongforge_compile"),
           ("loongforge_compile_gaf", "diffusers_compile")])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="dit-xl-2-256")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--profile", action="store_true", help="ours: profile three more steps (printed, and in --out)")
    harness.add_args(p, variants=VARIANTS, default="loongforge,loongforge_compile,diffusers_eager,diffusers_compile")
    args = harness.parse(p, argv, steps=20, warmup=5, smoke={
        "preset": "dit-tiny", "batch": 2, "device": "cpu", "variants": "loongforge,diffusers_eager"})
    setup = f"{args.preset}, batch {args.batch}, {'bf16' if args.device == 'cuda' else 'fp32'}, MSE + L_vlb"
    return BENCH.main(args, setup=setup, device=args.device, prepare=lambda a, work: make_diffusers(a, work / "dit"))


if __name__ == "__main__":
    main()
