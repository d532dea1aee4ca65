"""Delta-FP8 vs bf16 FSDP2 parameter all-gather (named peer: FSDP2's own bf16 all-gather), on 2+ GPUs.

Trains the same policy (``pi05`` preset cut to a few hundred M parameters, synthetic frames, bf16, AdamW) with
``parallel.strategy: fsdp2`` twice, same seed and data: once with FSDP2's all-gather, once with
``model.fp8_allgather.enabled``. Both all-gathers are counted and timed by the same wrapper
(``loongforge_embodied.fp8_allgather``): bytes each rank receives per step, milliseconds inside the all-gather
per step (CUDA events on the stream FSDP runs it on; for FP8 that includes encode + decode; the first step, which
primes, is left out of the times but not of the bytes), loss at the end and its relative delta; the byte ratio
is printed last. Writes a markdown table to ``--out``.

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node 2 benchmarks/fp8_allgather.py --steps 200 \\
        --out benchmarks/results/fp8_allgather_pi05_h200x2_$(date +%F).md

``--codec-only`` (one GPU, no torchrun) times the encode / decode alone, the torch code against the fused
Triton kernels (``loongforge_kernels.fp8_delta``), and checks that both give the same bytes; the full run adds
the same section to its table.

    python benchmarks/fp8_allgather.py --codec-only [--codec-numel 67108864 --codec-world 2]
    python benchmarks/fp8_allgather.py --smoke     # CPU: the codec at a tiny size, torch code vs the kernels' reference

The codec's rows are appended to ``benchmarks/results/fp8_allgather.md`` with the date and hardware (``harness.py``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from pathlib import Path

import harness
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "embodied" / "tiny_vla_synthetic.yaml"
# ~0.45B parameters: SigLIP-So400m-shaped blocks x8, Gemma-2B-shaped blocks x2, 300M-expert-shaped blocks x6.
ARCH = "{vision_layers: 8, lm_layers: 2, expert_layers: 6, extra_vocab: 0}"


def run(variant: str, args: argparse.Namespace) -> dict:
    from loongforge.api import build_job, load_recipe
    from loongforge_embodied.fp8_allgather import meter_allgather

    world = dist.get_world_size()
    over = [f"train.steps={args.steps}", f"train.global_batch_size={args.batch}",
            f"train.micro_batch_size={args.batch // world}", "train.precision=bf16", f"train.lr={args.lr}",
            f"train.warmup_steps={min(20, args.steps // 10)}", "train.lr_schedule=cosine", f"train.seed={args.seed}",
            f"model.preset={args.preset}", f"model.arch={args.arch}", "parallel.strategy=fsdp2",
            f"data.num_workers={args.workers}", f"data.synthetic_samples={args.batch * 64}",
            "checkpoint.resume=never", "checkpoint.save_at_end=false", "logging.console=false",
            "logging.tensorboard=false", "logging.jsonl=false"]
    if variant == "fp8":
        over += ["model.fp8_allgather.enabled=true", f"model.fp8_allgather.reprime_every={args.reprime_every}"]
    recipe = load_recipe(RECIPE, over)
    with tempfile.TemporaryDirectory() as tmp:
        job, _ = build_job(recipe, output_dir=tmp)
        try:
            if variant == "fp8":
                hook = job.model.allgather
            else:
                hook = job.model.allgather = meter_allgather(job.model.module)
            hook.timing = True
            losses = [job.step()["loss"]]
            hook.take_time_ms()  # step 1 primes (and warms up NCCL / kernels): out of the times
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            losses += [job.step()["loss"] for _ in range(args.steps - 1)]
            torch.cuda.synchronize()
            step_s = (time.perf_counter() - t0) / (args.steps - 1)
            ag = torch.tensor([hook.take_time_ms() / (args.steps - 1), step_s], device=job.device)
            dist.all_reduce(ag)  # mean over ranks
            ag /= world
            s = hook.stats
            return {"params_m": sum(p.numel() for p in job.model.raw.parameters()) / 1e6,
                    "bytes_per_step": s.bytes_sent / args.steps, "bytes_baseline_per_step": s.bytes_baseline / args.steps,
                    "steady_ratio": s.steady_ratio, "primes": s.primes, "gathers": s.calls,
                    "allgather_ms_per_step": ag[0].item(), "step_ms": ag[1].item() * 1e3,
                    "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
                    "loss_end": losses[-1], "loss_last10": sum(losses[-10:]) / len(losses[-10:]), "losses": losses}
        finally:
            job.close()
            del job
            gc.collect()
            torch.cuda.empty_cache()


def codec(args: argparse.Namespace) -> dict:
    """Encode (one rank's slab) and decode (all ``world`` slabs, writing the gathered output) on this GPU, no
    collective: the hook's torch code vs the fused kernels, ms by ``triton.testing.do_bench`` (median)."""
    from loongforge_embodied.fp8_allgather import _apply_deltas, _encode_delta
    from loongforge_kernels import fp8_delta

    device = "cuda" if torch.cuda.is_available() else "cpu"
    # NOTE: on CPU (the smoke run) the kernels' side is their torch reference: Triton needs its interpreter there
    impl = "triton" if device == "cuda" else "torch"
    if device == "cuda":
        from triton.testing import do_bench
    else:
        def do_bench(fn, *, warmup: int, rep: int, return_mode: str) -> float:
            fn()
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3

    world, slab = args.codec_world, args.codec_numel // args.codec_world
    gen = torch.Generator(device).manual_seed(0)
    recon0 = (torch.randn(world, slab, device=device, generator=gen) * 0.02).bfloat16()
    x = (recon0[0].float() + 1e-3 * torch.randn(slab, device=device, generator=gen)).bfloat16()
    out = torch.empty_like(recon0)

    def torch_decode(recon, gathered):
        _apply_deltas(recon, gathered)
        out.copy_(recon)

    paths = {
        "torch": (lambda: _encode_delta(x, recon0[0]), torch_decode),
        "triton": (
            lambda: fp8_delta.encode_fp8_delta(x, recon0[0], impl=impl),
            lambda recon, gathered: fp8_delta.apply_fp8_deltas(recon, gathered, out=out, impl=impl),
        ),
    }
    res: dict = {"numel": world * slab, "world": world}
    got = {}
    for name, (enc, dec) in paths.items():
        payload = enc()
        gathered = payload.expand(world, -1).contiguous()  # every rank's payload, here all the same bytes
        recon = recon0.clone()
        dec(recon, gathered)
        got[name] = (payload, recon.view(torch.int16).clone())
        res[f"{name}_encode_ms"] = do_bench(enc, warmup=10, rep=100, return_mode="median")
        res[f"{name}_decode_ms"] = do_bench(lambda dec=dec, r=recon, g=gathered: dec(r, g), warmup=10,
                                            rep=100, return_mode="median")
    res["bit_identical"] = all(torch.equal(a, b) for a, b in zip(got["torch"], got["triton"], strict=True))
    return res


def codec_lines(c: dict) -> list[str]:
    return [f"## Encode / decode alone (one GPU, {c['numel'] / 2**20:.0f}M bf16 elements over {c['world']} "
            "slabs, no collective)", "",
            "| | torch (eager) | fused Triton | torch / triton |", "|---|---:|---:|---:|",
            *(f"| {k} ms | {c[f'torch_{k}_ms']:.3f} | {c[f'triton_{k}_ms']:.3f} | "
              f"{c[f'torch_{k}_ms'] / c[f'triton_{k}_ms']:.2f}x |" for k in ("encode", "decode")),
            "", f"Payload and reconstruction bit-identical: {c['bit_identical']}.", ""]


def table(res: dict, args: argparse.Namespace) -> str:
    b, f = res["bf16"], res["fp8"]
    rows = [("bytes all-gathered / step / rank (MB)", "bytes_per_step", "{:.1f}", 1e-6),
            ("all-gather ms / step (encode+comm+decode)", "allgather_ms_per_step", "{:.2f}", 1),
            ("step ms", "step_ms", "{:.1f}", 1), ("peak memory (GiB)", "peak_mem_gib", "{:.2f}", 1),
            ("loss at the end", "loss_end", "{:.5f}", 1), ("loss, mean of last 10 steps", "loss_last10", "{:.5f}", 1)]
    lines = [f"# Delta-FP8 vs bf16 FSDP2 all-gather — {res['gpu']} x{res['world']}, {time.strftime('%Y-%m-%d')}", "",
             f"Policy: {args.preset} preset with `model.arch={args.arch}` ({b['params_m']:.1f}M params), fsdp2, bf16, "
             f"global batch {args.batch}, {args.steps} steps, lr {args.lr}, seed {args.seed}, synthetic data; "
             f"FP8 re-prime: {f'every {args.reprime_every} steps' if args.reprime_every else 'first gather only'}. "
             "Peer: FSDP2's own bf16 all-gather.", "",
             "| metric | bf16 all-gather | delta-FP8 all-gather | fp8 / bf16 |", "|---|---:|---:|---:|"]
    for name, key, fmt, k in rows:
        ratio = f"{f[key] / b[key]:.3f}" if b[key] else "-"
        lines.append(f"| {name} | {fmt.format(b[key] * k)} | {fmt.format(f[key] * k)} | {ratio} |")
    lines += ["", f"Relative loss delta at the end: {res['rel_loss_end']:+.2e}; over the last 10 steps: "
              f"{res['rel_loss_last10']:+.2e}; max over all steps: {res['rel_loss_max']:.2e}.",
              f"FP8 gathers: {f['gathers']} ({f['primes']} bf16 primes); steady-state byte ratio "
              f"{f['steady_ratio']:.4f}.", ""]
    if "codec" in res:
        lines += codec_lines(res["codec"])
    lines += [f"**Bytes ratio fp8/bf16: {res['bytes_ratio']:.4f}x**", ""]
    return "\n".join(lines)


def record(c: dict, args: argparse.Namespace) -> None:
    """The codec's rows in ``results/fp8_allgather.md`` (the full run's table goes to ``--out``)."""
    results = Path(args.results) if args.results else (None if args.smoke else harness.RESULTS)
    if results is None:
        return
    setup = f"codec, {c['numel'] / 2**20:.2f}M bf16 elements over {c['world']} slabs"
    harness.append_rows(results / "fp8_allgather.md", script=__file__, hardware=harness.hardware(
        "cuda" if torch.cuda.is_available() else "cpu"), head=["setup", "pass", "torch ms", "fused ms", "torch / fused",
                                                               "bit-identical"],
        rows=[[setup, k, f"{c[f'torch_{k}_ms']:.3f}", f"{c[f'triton_{k}_ms']:.3f}",
               f"{c[f'torch_{k}_ms'] / c[f'triton_{k}_ms']:.2f}x", c["bit_identical"]] for k in ("encode", "decode")])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=16, help="global batch (split evenly over ranks)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--preset", default="pi05")
    ap.add_argument("--arch", default=ARCH, help="overrides of the preset's sizes")
    ap.add_argument("--reprime-every", type=int, default=0)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--out", help="markdown file to write the table to (required unless --codec-only)")
    ap.add_argument("--codec-only", action="store_true", help="time encode / decode alone on one GPU")
    ap.add_argument("--codec-numel", type=int, default=64 * 2**20, help="elements over all slabs")
    ap.add_argument("--codec-world", type=int, default=2, help="slabs (ranks) the decode adds up")
    ap.add_argument("--results", default=None, help=f"folder of the results tables (default {harness.RESULTS})")
    ap.add_argument("--smoke", action="store_true", help="CPU: --codec-only at 64K elements")
    args = ap.parse_args(argv)
    if args.smoke:
        args.codec_only, args.codec_numel = True, 64 * 1024
    elif not torch.cuda.is_available():
        raise SystemExit("fp8_allgather benchmark needs CUDA GPUs (launch with torchrun --nproc_per_node 2)")
    if args.codec_only:
        c = codec(args)
        print("\n".join(codec_lines(c)))
        record(c, args)
        print(f"decode torch / triton: {c['torch_decode_ms'] / c['triton_decode_ms']:.2f}x; "
              f"encode torch / triton: {c['torch_encode_ms'] / c['triton_encode_ms']:.2f}x")
        return c
    if not args.out:
        ap.error("--out is required")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank0 = dist.get_rank() == 0
    res: dict = {"gpu": torch.cuda.get_device_name(), "world": dist.get_world_size()}
    if rank0:
        res["codec"] = codec(args)
        record(res["codec"], args)
        torch.cuda.empty_cache()
        print("codec:", json.dumps(res["codec"]), flush=True)
    for variant in ("bf16", "fp8"):
        res[variant] = run(variant, args)
        if rank0:
            print(f"{variant}:", json.dumps({k: v for k, v in res[variant].items() if k != "losses"}), flush=True)
    b, f = res["bf16"], res["fp8"]
    res["rel_loss_end"] = (f["loss_end"] - b["loss_end"]) / b["loss_end"]
    res["rel_loss_last10"] = (f["loss_last10"] - b["loss_last10"]) / b["loss_last10"]
    res["rel_loss_max"] = max(abs(x - y) / abs(y) for x, y in zip(f["losses"], b["losses"], strict=True))
    res["bytes_ratio"] = f["bytes_per_step"] / b["bytes_per_step"]
    if rank0:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(table(res, args))
        print(f"loss end bf16 {b['loss_end']:.5f} fp8 {f['loss_end']:.5f} (rel {res['rel_loss_end']:+.2e}, "
              f"last-10 mean rel {res['rel_loss_last10']:+.2e}); all-gather ms/step bf16 "
              f"{b['allgather_ms_per_step']:.2f} fp8 {f['allgather_ms_per_step']:.2f}; wrote {out}")
        print(f"bytes ratio fp8/bf16: {res['bytes_ratio']:.4f}x")
    dist.barrier()
    dist.destroy_process_group()
    return res


if __name__ == "__main__":
    main()
