"""End-to-end LLM training throughput on one GPU: LoongForge's megatron backend (loongforge spec: SDPA flash
attention + Triton kernels + fused linear cross-entropy, no TransformerEngine) vs megatron-core's local spec vs
HF transformers eager vs HF transformers + torch.compile, same model, weights, data and optimizer settings.

    python benchmarks/llm_throughput.py --preset llama3.2-1b --seq 4096 --steps 20

Every variant runs in its own process (clean memory), starts from the same random-init HF checkpoint, trains on
the same synthetic tokens with AdamW (fp32 master weights, bf16 compute), and reports median tokens/s after
warm-up, MFU and peak memory. FLOPs per token (one formula for all): 6·(non-embedding params + output layer) +
12·layers·(heads·head_dim)·seq — the PaLM/Megatron estimate (causal masking not discounted). Ratios print last.
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

PEAK_BF16 = 989e12  # H100/H200 SXM dense bf16


def make_hf(preset: str, out: Path) -> None:
    import torch
    import transformers as tf
    from loongforge_megatron.models.registry import hf_config, presets

    spec, fields = presets()[preset]
    cfg = hf_config(spec.arch(fields), torch_dtype="bfloat16")
    config = tf.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k not in ("architectures",)})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = tf.AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model.save_pretrained(out)


def run_ours(args, spec: str, *, one_pass_loss: bool = True, grad_accum_fusion: bool = False) -> dict:
    import loongforge
    import torch
    import yaml

    if not one_pass_loss:  # A/B row: the per-token loss whose backward recomputes the logits (the pre-mask path)
        from loongforge_megatron.layers import output

        output._takes_token_weights = lambda fn: False

    recipe = {
        "backend": "megatron",
        "model": {"hf": args.hf_dir},
        "data": {"format": "synthetic", "seq_length": args.seq},
        "train": {"stage": "cpt", "steps": args.steps, "global_batch_size": args.mbs, "micro_batch_size": args.mbs,
                  "lr": 1e-4, "lr_schedule": "constant", "weight_decay": 0.0, "grad_clip": 1.0, "precision": "bf16",
                  "seed": 1},
        "checkpoint": {"load": args.hf_dir, "save_at_end": False},
        "accelerator": "cuda",
        "kernels": {"layers": spec, "grad_accum_fusion": grad_accum_fusion},
        "logging": {"tensorboard": False, "interval": 5},
    }
    tmp = Path(tempfile.mkdtemp())
    (tmp / "r.yaml").write_text(yaml.safe_dump(recipe))
    job, _ = loongforge.build_job(loongforge.load_recipe(tmp / "r.yaml"), output_dir=tmp / "run")
    torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    for _ in range(args.steps):
        m = job.step()
        losses.append(m["loss"])
        times.append(m["step_time"])
    peak = torch.cuda.max_memory_allocated()
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                job.step()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70), flush=True)
    job.close()
    return {"losses": losses, "times": times, "peak_gib": peak / 2**30}


def run_hf(args, compiled: bool) -> dict:
    import torch
    import transformers as tf
    from loongforge_megatron.data.datasets import SyntheticDataset

    model = tf.AutoModelForCausalLM.from_pretrained(args.hf_dir, torch_dtype=torch.float32, attn_implementation="sdpa").cuda()
    model.config.use_cache = False
    vocab = model.config.vocab_size
    fwd = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, fused=True)
    data = SyntheticDataset(vocab_size=vocab, seq_length=args.seq, seed=1)
    torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    for step in range(args.steps):
        samples = [data[step * args.mbs + i] for i in range(args.mbs)]
        tokens = torch.stack([s["tokens"] for s in samples]).cuda()
        labels = torch.stack([s["labels"] for s in samples]).cuda()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = fwd(input_ids=tokens).logits
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, vocab), labels.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    return {"losses": losses, "times": times, "peak_gib": torch.cuda.max_memory_allocated() / 2**30}


VARIANTS = {
    "loongforge": lambda a: run_ours(a, "loongforge"),
    "loongforge_recompute": lambda a: run_ours(a, "loongforge", one_pass_loss=False),
    # A/B row: weight gradients added into the fp32 main_grad inside the GEMM (kernels.grad_accum_fusion)
    "loongforge_gaf": lambda a: run_ours(a, "loongforge", grad_accum_fusion=True),
    "megatron_local": lambda a: run_ours(a, "local"),
    "hf_eager": lambda a: run_hf(a, False),
    "hf_compile": lambda a: run_hf(a, True),
}


def child(args) -> None:
    try:
        out = VARIANTS[args.variant](args)
    except Exception as exc:  # OOM or a failure: report it as a row, keep the other variants
        out = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    Path(args.json).write_text(json.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="llama3.2-1b")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--mbs", default="loongforge=4,loongforge_recompute=4,megatron_local=1,hf_eager=4,hf_compile=4")
    p.add_argument("--variants", default="loongforge,megatron_local,hf_eager,hf_compile")
    p.add_argument("--out", default=None, help="write the table (markdown) here too")
    p.add_argument("--profile", action="store_true", help="print a CUDA kernel profile of two of our steps")
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--hf-dir", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:
        args.mbs = int(args.mbs)
        return child(args)

    import torch
    from loongforge_megatron.models.hf_arch import arch_from_hf

    mbs = dict(kv.split("=") for kv in args.mbs.split(","))
    work = Path(tempfile.mkdtemp())
    hf_dir = work / "hf"
    make_hf(args.preset, hf_dir)
    arch = arch_from_hf(hf_dir)
    fpt = arch.flops_per_token(args.seq)
    device = torch.cuda.get_device_name()
    rows = {}
    for name in args.variants.split(","):
        js = work / f"{name}.json"
        cmd = [sys.executable, __file__, "--variant", name, "--hf-dir", str(hf_dir), "--json", str(js), "--seq", str(args.seq),
               "--steps", str(args.steps), "--mbs", mbs[name]] + (["--profile"] if args.profile and name == "loongforge" else [])
        t0 = time.time()
        subprocess.run(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=900)
        res = json.loads(js.read_text()) if js.is_file() else {"error": "no result (crashed)"}
        res["wall_s"] = time.time() - t0
        res["mbs"] = int(mbs[name])
        if "times" in res:
            t = statistics.median(res["times"][args.warmup:])
            res["tokens_per_s"] = res["mbs"] * args.seq / t
            res["mfu"] = res["tokens_per_s"] * fpt / PEAK_BF16
        rows[name] = res
        print(name, {k: v for k, v in res.items() if k not in ("losses", "times")}, flush=True)
        if args.out:  # NOTE: after every variant, so a timeout keeps the rows measured so far
            _write(args.out, render(args, rows, fpt, device))
    text = render(args, rows, fpt, device)
    print(text)
    if args.out:
        _write(args.out, text)


def _write(path: str, text: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text + "\n")


def render(args, rows: dict, fpt: float, device: str) -> str:
    lines = [f"# LLM training throughput — {args.preset}, seq {args.seq}, bf16, one {device}, {time.strftime('%Y-%m-%d')}",
             "", f"FLOPs/token = {fpt / 1e9:.2f} GFLOP (6·N + 12·L·H·s); MFU against {PEAK_BF16 / 1e12:.0f} TFLOP/s dense bf16.",
             f"{args.steps} steps, median step time after {args.warmup} warm-up steps. Same HF random-init weights and synthetic tokens for all.",
             "", "| variant | micro-batch | tokens/s | MFU | peak GiB | loss step 1 → last |", "|---|---|---|---|---|---|"]
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"| {name} | {r['mbs']} | {r['error']} | | | |")
            continue
        lines.append(f"| {name} | {r['mbs']} | {r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f}% | {r['peak_gib']:.1f} | "
                     f"{r['losses'][0]:.4f} → {r['losses'][-1]:.4f} |")
    ours = rows.get("loongforge", {})
    for peer in ("hf_eager", "hf_compile", "loongforge_recompute", "loongforge_gaf"):  # the loss check needs the same micro-batch (same tokens per step)
        r = rows.get(peer, {})
        if "losses" in ours and "losses" in r and r["mbs"] == ours["mbs"]:
            n = min(len(r["losses"]), len(ours["losses"]))
            diffs = [abs(a - b) / abs(b) for a, b in zip(ours["losses"][:n], r["losses"][:n], strict=True)]
            lines += ["", f"Loss vs {peer} over {n} steps (same weights, data, optimizer, micro-batch): max relative "
                          f"difference {max(diffs):.2e}, mean {statistics.mean(diffs):.2e}."]
    lines.append("")
    for peer in ("hf_eager", "hf_compile", "megatron_local", "loongforge_recompute", "loongforge_gaf"):
        if "tokens_per_s" in ours and "tokens_per_s" in rows.get(peer, {}):
            lines.append(f"loongforge / {peer}: {ours['tokens_per_s'] / rows[peer]['tokens_per_s']:.2f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
