"""MoE training throughput on one GPU: LoongForge's megatron backend (loongforge spec: grouped_mm experts, SDPA
flash attention, Triton kernels, no TransformerEngine) vs transformers' own MoE model with its ``grouped_mm``
experts, eager and under torch.compile; same weights, data and optimizer.

    python benchmarks/moe_throughput.py --preset qwen3-30b-a3b --layers 4 --seq 4096 --mbs 2 --steps 20

Every variant runs in its own process from the same random-init HF checkpoint (bf16 compute, fp32 master weights,
AdamW, grad clip 1.0) on the same synthetic tokens. Reported: median tokens/s after warm-up, active-parameter MFU,
GPU busy % (union of kernel intervals / wall time over two profiled steps), peak memory, loss agreement with HF.
Active-parameter FLOPs per token = 6 · (non-embedding parameters a token passes through: attention, norms, router,
top-k routed experts, shared experts + the output layer) + 12 · layers · heads · head_dim · seq
(``Arch.flops_per_token``; causal masking not discounted). Ratios print last.
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


def arch_of(args):
    from loongforge_megatron.models.registry import presets

    spec, fields = presets()[args.preset]
    return spec.arch({**fields, "num_layers": args.layers})


def make_hf(args, out: Path) -> None:
    import torch
    import transformers as tf
    from loongforge_megatron.models.registry import hf_config

    cfg = hf_config(arch_of(args), torch_dtype="bfloat16")
    config = tf.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    torch.manual_seed(0)
    with torch.device(args.device):
        model = tf.AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model.save_pretrained(out)


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def busy(step, n: int = 2) -> tuple[float, str]:
    """(GPU busy fraction over ``n`` calls of ``step``, the profiler's top kernels table)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():  # the CPU smoke run (--device cpu)
        return 0.0, ""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA)
    covered, end = 0.0, float("-inf")
    for s, e in spans:
        if e > end:
            covered += e - max(s, end)
            end = e
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=60)
    return min(1.0, covered / 1e6 / wall), table


def _reset_peak() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _peak() -> int:
    import torch

    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0


def run_ours(args, *, grouped: bool | None = None, dispatcher: str | None = None, router_fusion: bool = True) -> dict:
    import loongforge
    import yaml

    recipe = {
        "backend": "megatron",
        "model": {"hf": args.hf_dir, **({"moe_token_dispatcher": dispatcher} if dispatcher else {})},
        "data": {"format": "synthetic", "seq_length": args.seq},
        "train": {"stage": "cpt", "steps": args.steps + 2, "global_batch_size": args.mbs, "micro_batch_size": args.mbs,
                  "lr": 1e-4, "lr_schedule": "constant", "weight_decay": 0.0, "grad_clip": 1.0, "precision": "bf16",
                  "seed": 1},
        "checkpoint": {"load": args.hf_dir, "save_at_end": False},
        "accelerator": args.device,
        "kernels": {"spec": "loongforge", "moe_grouped_gemm": grouped, "moe_router_fusion": router_fusion},
        "logging": {"tensorboard": False, "interval": 5},
    }
    tmp = Path(tempfile.mkdtemp())
    (tmp / "r.yaml").write_text(yaml.safe_dump(recipe))
    job, _ = loongforge.build_job(loongforge.load_recipe(tmp / "r.yaml"), output_dir=tmp / "run")
    _reset_peak()
    losses, times = [], []
    for _ in range(args.steps):
        m = job.step()
        losses.append(m["loss"])
        times.append(m["step_time"])
    peak = _peak()
    frac, table = busy(job.step)
    job.close()
    return {"losses": losses, "times": times, "peak_gib": peak / 2**30, "busy": frac, "profile": table}


def run_hf(args, compiled: bool, *, bf16_weights: bool = False) -> dict:
    """transformers' model; fp32 master weights under bf16 autocast (as ours), or all-bf16 weights and AdamW
    (``bf16_weights``: not the same optimizer numerics, but grouped_mm then runs in bf16 — transformers casts the
    experts' input to their weights' dtype, so under autocast its grouped_mm sees fp32)."""
    import torch
    import transformers as tf
    from loongforge_megatron.data.datasets import SyntheticDataset

    dtype = torch.bfloat16 if bf16_weights else torch.float32
    model = tf.AutoModelForCausalLM.from_pretrained(args.hf_dir, torch_dtype=dtype, attn_implementation="sdpa",
                                                    experts_implementation="grouped_mm",
                                                    device_map=args.device)
    model.config.use_cache = False
    vocab = model.config.vocab_size
    fwd = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
                            fused=args.device == "cuda")
    data = SyntheticDataset(vocab_size=vocab, seq_length=args.seq, seed=1)
    it = iter(range(10**6))

    def step() -> float:
        i = next(it)
        samples = [data[i * args.mbs + j] for j in range(args.mbs)]
        tokens = torch.stack([s["tokens"] for s in samples]).to(args.device)
        labels = torch.stack([s["labels"] for s in samples]).to(args.device)
        with torch.autocast(args.device, dtype=torch.bfloat16):
            logits = fwd(input_ids=tokens).logits
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, vocab), labels.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    _reset_peak()
    losses, times = [], []
    for _ in range(args.steps):
        _sync()
        t0 = time.perf_counter()
        losses.append(step())
        _sync()
        times.append(time.perf_counter() - t0)
    peak = _peak()
    frac, table = busy(step)
    return {"losses": losses, "times": times, "peak_gib": peak / 2**30, "busy": frac, "profile": table}


VARIANTS = {
    "loongforge": lambda a: run_ours(a),
    "loongforge_sequential": lambda a: run_ours(a, grouped=False),  # A/B: megatron's SequentialMLP experts
    "loongforge_alltoall": lambda a: run_ours(a, dispatcher="alltoall"),  # A/B: megatron's dispatcher, grouped
    "loongforge_torch_router": lambda a: run_ours(a, router_fusion=False),  # A/B: megatron's torch routing
    "hf_grouped_mm": lambda a: run_hf(a, False),
    "hf_grouped_mm_compile": lambda a: run_hf(a, True),
    "hf_grouped_mm_bf16": lambda a: run_hf(a, False, bf16_weights=True),
}


def child(args) -> None:
    try:
        out = VARIANTS[args.variant](args)
    except Exception as exc:  # OOM or a failure: report it as a row, keep the other variants
        import traceback

        traceback.print_exc()
        out = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}
    Path(args.json).write_text(json.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--variants", default="loongforge,hf_grouped_mm,hf_grouped_mm_compile")
    p.add_argument("--timeout", type=int, default=600, help="seconds per variant")
    p.add_argument("--out", default=None, help="write the table (markdown) here too")
    p.add_argument("--device", default="cuda", help="cuda; cpu only for a smoke run of the script itself")
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--hf-dir", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:
        return child(args)

    import torch

    work = Path(tempfile.mkdtemp())
    hf_dir = work / "hf"
    make_hf(args, hf_dir)
    arch = arch_of(args)
    fpt = arch.flops_per_token(args.seq)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    rows = {}
    for name in args.variants.split(","):
        js = work / f"{name}.json"
        cmd = [sys.executable, __file__, "--variant", name, "--hf-dir", str(hf_dir), "--json", str(js),
               "--seq", str(args.seq), "--steps", str(args.steps), "--mbs", str(args.mbs), "--preset", args.preset,
               "--layers", str(args.layers), "--device", args.device]
        t0 = time.time()
        try:
            subprocess.run(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            pass
        res = json.loads(js.read_text()) if js.is_file() else {"error": "no result (crashed or timed out)"}
        res["wall_s"] = time.time() - t0
        if "times" in res:
            t = statistics.median(res["times"][args.warmup:])
            res["tokens_per_s"] = args.mbs * args.seq / t
            res["mfu"] = res["tokens_per_s"] * fpt / PEAK_BF16
        if res.get("profile"):
            print(f"--- {name}: top kernels over two profiled steps\n{res['profile']}", flush=True)
        rows[name] = res
        print(name, {k: v for k, v in res.items() if k not in ("losses", "times", "profile")}, flush=True)
        if args.out:  # NOTE: after every variant, so a timeout keeps the rows measured so far
            _write(args.out, render(args, rows, fpt, device, arch))
    text = render(args, rows, fpt, device, arch)
    print(text)
    if args.out:
        _write(args.out, text)


def _write(path: str, text: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text + "\n")


def render(args, rows: dict, fpt: float, device: str, arch) -> str:
    lines = [f"# MoE training throughput — {args.preset} shape, {args.layers} layers, seq {args.seq}, micro-batch "
             f"{args.mbs}, bf16, one {device}, {time.strftime('%Y-%m-%d')}", "",
             f"{arch.num_experts} experts, top-{arch.moe_topk}, expert ffn {arch.moe_ffn_hidden_size}, hidden "
             f"{arch.hidden_size}; {arch.num_params() / 1e9:.2f}B parameters.",
             f"Active-parameter FLOPs/token = {fpt / 1e9:.2f} GFLOP (6·N_active + 12·L·heads·head_dim·s); MFU against "
             f"{PEAK_BF16 / 1e12:.0f} TFLOP/s dense bf16. {args.steps} steps, median step time after {args.warmup} "
             "warm-up steps; GPU busy = union of kernel time / wall time over two more (profiled) steps.", "",
             "| variant | tokens/s | MFU | GPU busy | peak GiB | loss step 1 → last |", "|---|---|---|---|---|---|"]
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"| {name} | {r['error']} | | | | |")
            continue
        lines.append(f"| {name} | {r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f}% | {100 * r['busy']:.0f}% | "
                     f"{r['peak_gib']:.1f} | {r['losses'][0]:.4f} → {r['losses'][-1]:.4f} |")
    ours = rows.get("loongforge", {})
    for peer in ("hf_grouped_mm", "hf_grouped_mm_compile", "hf_grouped_mm_bf16", "loongforge_sequential",
                 "loongforge_alltoall", "loongforge_torch_router"):
        r = rows.get(peer, {})
        if "losses" in ours and "losses" in r:
            n = min(len(r["losses"]), len(ours["losses"]))
            diffs = [abs(a - b) / abs(b) for a, b in zip(ours["losses"][:n], r["losses"][:n], strict=True)]
            lines += ["", f"Loss vs {peer} over {n} steps (same weights, data, optimizer): max relative difference "
                          f"{max(diffs):.2e}, mean {statistics.mean(diffs):.2e}."]
    lines.append("")
    for peer in ("loongforge_sequential", "loongforge_alltoall", "loongforge_torch_router", "hf_grouped_mm_bf16",
                 "hf_grouped_mm", "hf_grouped_mm_compile"):
        if "tokens_per_s" in ours and "tokens_per_s" in rows.get(peer, {}):
            lines.append(f"loongforge / {peer}: {ours['tokens_per_s'] / rows[peer]['tokens_per_s']:.2f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
