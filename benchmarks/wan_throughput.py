"""Wan video-diffusion training throughput: LoongForge's megatron backend vs diffusers' ``WanTransformer3DModel``
eager and + ``torch.compile`` (ours also with ``train.compile``), same model, weights, data, objective and optimizer,
on one device.

    python benchmarks/wan_throughput.py --preset wan2.1-t2v-1.3b --batch 1 --steps 12     # 480p x 81 frames, 1 GPU
    python benchmarks/wan_throughput.py --preset wan2.2-ti2v-5b --latent 21,44,80 --batch 1
    python benchmarks/wan_throughput.py --smoke       # CPU, wan-tiny, 2 steps: checks the script itself

Every variant runs in its own process and starts from the same random-init diffusers checkpoint (weights perturbed
so no gate or projection starts at zero). Data: our synthetic latent videos with text embeddings (``data.format:
synthetic``: what a latent cache holds — the default latent 21 x 60 x 104 is 81 frames at 480 x 832, 32,760 patch
tokens with Wan2.1's 1 x 2 x 2 patches — 512 text tokens, 10% text dropout). Objective for both: flow matching as
Wan trains (x_t = (1 - s) x_0 + s noise, timestep 1000 s, logit-normal s shifted by 3, MSE against the velocity
noise - x_0). AdamW (lr 1e-4, no weight decay, betas 0.9 / 0.999), grad clip 1.0, bf16 autocast on the peer and bf16
params with fp32 master weights on ours (GPU; fp32 on CPU). Median samples/s after warm-up, MFU (6·N + 12·L·H·T
FLOPs per video token, against 989 TFLOP/s dense bf16), peak memory and the losses; ratios last. Rows go to
``benchmarks/results/wan_throughput.md`` (see ``harness.py``).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import harness

OBJECTIVE = {"timestep_sampling": "logit_normal", "timestep_shift": 3.0, "text_dropout": 0.1}


def _latent(args) -> tuple[int, int, int]:
    f, h, w = (int(x) for x in args.latent.split(","))
    return f, h, w


def make_diffusers(args, out: Path) -> None:
    from diffusers import WanTransformer3DModel
    from loongforge_megatron.models.registry import presets
    from loongforge_megatron.models.wan.arch import diffusers_config

    spec, fields = presets()[args.preset]
    arch = spec.arch(fields)
    if args.layers:
        arch = arch.model_copy(update={"num_layers": args.layers})
    harness.save_perturbed_diffusers(WanTransformer3DModel, diffusers_config(arch), device=args.device, out=out)


def _hf(args) -> str:
    return str(Path(args.work) / "wan")


def _arch(args):
    from loongforge_megatron.models.wan.arch import arch_from_diffusers

    return arch_from_diffusers(json.loads((Path(_hf(args)) / "config.json").read_text()))


def _items(args, res: dict) -> dict:
    arch = _arch(args)
    tokens = arch.tokens(*_latent(args))
    res.update(items=args.batch, flops_per_item=tokens * arch.flops_per_token(tokens), tokens_per_sample=tokens)
    return res


def _data(args) -> dict:
    f, h, w = _latent(args)
    return {"format": "synthetic", "latent_frames": f, "latent_height": h, "latent_width": w,
            "text_length": args.text_length, **OBJECTIVE}


def run_ours(args, compiled: bool = False) -> dict:
    import loongforge
    import yaml

    recipe = {
        "backend": "megatron",
        "model": {"hf": _hf(args)},
        "data": _data(args),
        "train": {"stage": "cpt", "steps": args.steps, "global_batch_size": args.batch, "micro_batch_size": args.batch,
                  "lr": 1e-4, "lr_schedule": "constant", "warmup_steps": 0, "weight_decay": 0.0, "adam_beta2": 0.999,
                  "grad_clip": 1.0, "precision": "bf16" if args.device == "cuda" else "fp32", "seed": 1,
                  "compile": compiled},
        "parallel": {"recompute": "full" if args.recompute == "full" else "none"},
        "checkpoint": {"load": _hf(args), "save_at_end": False},
        "accelerator": args.device,
        "logging": {"tensorboard": False, "interval": 5, "console": False},
    }
    tmp = Path(tempfile.mkdtemp())
    (tmp / "r.yaml").write_text(yaml.safe_dump(recipe))
    job, _ = loongforge.build_job(loongforge.load_recipe(tmp / "r.yaml"), output_dir=tmp / "run")
    res = harness.job_steps(job, steps=args.steps, device=args.device)
    job.close()
    return _items(args, res)


def run_diffusers(args, compiled: bool) -> dict:
    import torch
    from diffusers import WanTransformer3DModel
    from loongforge_megatron.models.flow_matching import FlowMatching
    from loongforge_megatron.models.wan.data import SyntheticVideo

    device = torch.device(args.device)
    model = WanTransformer3DModel.from_pretrained(_hf(args), torch_dtype=torch.float32).to(device).train()
    if args.recompute == "full":
        model.enable_gradient_checkpointing()
    arch = _arch(args)
    data_cfg = argparse.Namespace(**{**_data(args), "image_tokens": 257, "logit_mean": 0.0, "logit_std": 1.0,
                                    "packed_frames": [], "first_frame_clean": 0.0})
    objective = FlowMatching(sampling=OBJECTIVE["timestep_sampling"], shift=OBJECTIVE["timestep_shift"])
    data = SyntheticVideo(arch=arch, data=data_cfg, objective=objective, seed=1)
    fwd = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                            fused=device.type == "cuda")
    steps = iter(range(10**9))

    def step():
        i = next(steps)
        samples = [data[i * args.batch + j] for j in range(args.batch)]
        b = {k: torch.stack([s[k] for s in samples]).to(device) for k in samples[0]}
        s = b["sigmas"].view(-1, 1, 1, 1, 1)
        xt = (1 - s) * b["x0"] + s * b["noise"]
        if "condition" in b:
            xt = torch.cat([xt, b["condition"]], dim=1)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            pred = fwd(xt, b["sigmas"] * 1000, b["text"], encoder_hidden_states_image=b.get("image")).sample.float()
        loss = (pred - (b["noise"] - b["x0"])).pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return _items(args, harness.time_steps(step, steps=args.steps, device=args.device))


VARIANTS = {
    "loongforge": run_ours,
    "loongforge_compile": lambda a: run_ours(a, True),
    "diffusers_eager": lambda a: run_diffusers(a, False),
    "diffusers_compile": lambda a: run_diffusers(a, True),
}


BENCH = harness.Bench(
    name="wan_throughput", script=__file__, variants=VARIANTS, unit="samples/s",
    pairs=[("loongforge", "diffusers_eager"), ("loongforge_compile", "loongforge"),
           ("loongforge", "diffusers_compile"), ("loongforge_compile", "diffusers_compile")],
    columns={"tokens / sample": lambda r: f"{r.get('tokens_per_sample', '')}"})


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="wan2.1-t2v-1.3b")
    p.add_argument("--layers", type=int, default=None, help="fewer transformer blocks than the preset's")
    p.add_argument("--latent", default="21,60,104", help="latent frames,height,width (81 frames at 480x832)")
    p.add_argument("--text-length", type=int, default=512)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--recompute", default="off", choices=["off", "full"], help="both sides (diffusers: gradient "
                   "checkpointing of every block)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    harness.add_args(p, variants=VARIANTS, default="loongforge,loongforge_compile,diffusers_eager,diffusers_compile")
    args = harness.parse(p, argv, steps=12, warmup=4, smoke={
        "preset": "wan-tiny", "latent": "2,8,8", "text_length": 16, "batch": 2, "device": "cpu",
        "variants": "loongforge,diffusers_eager"})
    f, h, w = _latent(args)
    setup = (f"{args.preset}{f' ({args.layers} layers)' if args.layers else ''}, latent {f}x{h}x{w}, "
             f"batch {args.batch}, {'bf16' if args.device == 'cuda' else 'fp32'}, flow matching"
             f"{', full recompute' if args.recompute == 'full' else ''}")
    return BENCH.main(args, setup=setup, device=args.device, prepare=lambda a, work: make_diffusers(a, work / "wan"))


if __name__ == "__main__":
    main()
