"""Qwen-Image training throughput: LoongForge's megatron backend vs diffusers' ``QwenImageTransformer2DModel``
eager and + ``torch.compile`` (ours also with ``train.compile``), same model, weights, data, objective and optimizer,
on one device.

    python benchmarks/qwen_image_throughput.py --layers 8 --batch 2 --steps 12   # Qwen-Image-20B's width, 1 GPU
    python benchmarks/qwen_image_throughput.py --smoke       # CPU, qwen-image-tiny, 2 steps: checks the script itself

The whole 20B model does not train on one 80 GB GPU (weights, gradients and Adam states alone are 320 GB in
mixed precision), so the default is its first 8 blocks (Qwen-Image-20B's width, 2.9B parameters) at 1024 x 1024
pixels (latent 128 x 128: 4,096 image tokens) with 256 text tokens. Every variant runs in its own process and starts
from the same random-init diffusers checkpoint (weights perturbed so no gate or projection starts at zero). Data: our
synthetic latent images with text-encoder hidden states and their mask (``data.format: synthetic``: what a latent
cache holds; each prompt its own length, 10% text dropout). Objective for both: flow matching as Qwen-Image trains
(x_t = (1 - s) x_0 + s noise, the model's timestep input s, logit-normal s shifted by 3, MSE against the velocity
noise - x_0). AdamW (lr 1e-4, no weight decay, betas 0.9 / 0.999), grad clip 1.0, bf16 autocast on the peer and bf16
params with fp32 master weights on ours (GPU; fp32 on CPU). Median samples/s after warm-up, MFU (6·N + 12·L·H·T
FLOPs per token, text and image, against 989 TFLOP/s dense bf16), peak memory and the losses; ratios last. Rows go
to ``benchmarks/results/qwen_image_throughput.md`` (see ``harness.py``).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import harness

OBJECTIVE = {"timestep_sampling": "logit_normal", "timestep_shift": 3.0, "text_dropout": 0.1}


def make_diffusers(args, out: Path) -> None:
    from diffusers import QwenImageTransformer2DModel
    from loongforge_megatron.models.qwen_image.arch import diffusers_config
    from loongforge_megatron.models.registry import presets

    spec, fields = presets()[args.preset]
    arch = spec.arch(fields)
    if args.layers:
        arch = arch.model_copy(update={"num_layers": args.layers})
    harness.save_perturbed_diffusers(QwenImageTransformer2DModel, diffusers_config(arch), device=args.device, out=out)


def _hf(args) -> str:
    return str(Path(args.work) / "qwen_image")


def _arch(args):
    from loongforge_megatron.models.qwen_image.arch import arch_from_diffusers

    return arch_from_diffusers(json.loads((Path(_hf(args)) / "config.json").read_text()))


def _size(args) -> tuple[int, int]:
    h, w = (int(x) for x in args.latent.split(","))
    return h, w


def _items(args, res: dict) -> dict:
    arch = _arch(args)
    tokens = arch.tokens(*_size(args)) + args.text_length
    res.update(items=args.batch, flops_per_item=tokens * arch.flops_per_token(tokens), tokens_per_sample=tokens)
    return res


def _data(args) -> dict:
    h, w = _size(args)
    return {"format": "synthetic", "height": h, "width": w, "text_length": args.text_length, **OBJECTIVE}


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
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "r.yaml").write_text(yaml.safe_dump(recipe))
        job, _ = loongforge.build_job(loongforge.load_recipe(Path(tmp) / "r.yaml"), output_dir=Path(tmp) / "run")
        try:
            res = harness.job_steps(job, steps=args.steps, device=args.device)
        finally:
            job.close()
    return _items(args, res)


def run_diffusers(args, compiled: bool) -> dict:
    import torch
    from diffusers import QwenImageTransformer2DModel
    from loongforge_megatron.models.flow_matching import FlowMatching
    from loongforge_megatron.models.qwen_image.data import SyntheticImages
    from loongforge_megatron.models.qwen_image.model import pack

    device = torch.device(args.device)
    model = QwenImageTransformer2DModel.from_pretrained(_hf(args), torch_dtype=torch.float32).to(device).train()
    if args.recompute == "full":
        model.enable_gradient_checkpointing()
    arch = _arch(args)
    data_cfg = argparse.Namespace(**{**_data(args), "logit_mean": 0.0, "logit_std": 1.0, "packed_sizes": [],
                                    "reference_images": 0})
    objective = FlowMatching(sampling=OBJECTIVE["timestep_sampling"], shift=OBJECTIVE["timestep_shift"])
    data = SyntheticImages(arch=arch, data=data_cfg, objective=objective, seed=1)
    fwd = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                            fused=device.type == "cuda")
    h, w = _size(args)
    shapes = [[(1, h // arch.patch_size, w // arch.patch_size)]] * args.batch
    steps = iter(range(10**9))

    def step():
        i = next(steps)
        samples = [data[i * args.batch + j] for j in range(args.batch)]
        b = {k: torch.stack([s[k] for s in samples]).to(device) for k in samples[0]}
        s = b["sigmas"].view(-1, 1, 1, 1)
        xt = pack((1 - s) * b["x0"] + s * b["noise"], arch.patch_size)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            pred = fwd(xt, b["text"], b["text_mask"], b["sigmas"], img_shapes=shapes).sample.float()
        loss = (pred - pack(b["noise"] - b["x0"], arch.patch_size)).pow(2).mean()
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
    name="qwen_image_throughput", script=__file__, variants=VARIANTS, unit="samples/s",
    pairs=[("loongforge", "diffusers_eager"), ("loongforge_compile", "loongforge"),
           ("loongforge", "diffusers_compile"), ("loongforge_compile", "diffusers_compile")],
    columns={"tokens / sample": lambda r: f"{r.get('tokens_per_sample', '')}"})


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen-image-20b")
    p.add_argument("--layers", type=int, default=8, help="fewer transformer blocks than the preset's (0: all)")
    p.add_argument("--latent", default="128,128", help="latent height,width (pixels / 8: 1024 x 1024)")
    p.add_argument("--text-length", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--recompute", default="off", choices=["off", "full"], help="both sides (diffusers: gradient "
                   "checkpointing of every block)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    harness.add_args(p, variants=VARIANTS, default="loongforge,loongforge_compile,diffusers_eager,diffusers_compile")
    args = harness.parse(p, argv, steps=12, warmup=4, smoke={
        "preset": "qwen-image-tiny", "layers": 0, "latent": "8,8", "text_length": 8, "batch": 2, "device": "cpu",
        "variants": "loongforge,diffusers_eager"})
    h, w = _size(args)
    setup = (f"{args.preset}{f' ({args.layers} layers)' if args.layers else ''}, latent {h}x{w}, "
             f"{args.text_length} text tokens, batch {args.batch}, {'bf16' if args.device == 'cuda' else 'fp32'}, "
             f"flow matching{', full recompute' if args.recompute == 'full' else ''}")
    return BENCH.main(args, setup=setup, device=args.device,
                      prepare=lambda a, work: make_diffusers(a, work / "qwen_image"))


if __name__ == "__main__":
    main()
