"""FP8 training throughput on one GPU: LoongForge's megatron backend in bf16 and with train.fp8 (tensorwise,
rowwise, blockwise, and adaptive: the policy of `loongforge fp8 profile`) vs torchao float8 training (tensorwise,
rowwise) on HF transformers + torch.compile, same model shape, sequence length and micro-batch.

    python benchmarks/fp8_throughput.py --preset llama3.1-8b --layers 8 --seq 8192 --steps 20 --out FILE

Shapes of the benchmark (one command each; see benchmarks/results/fp8_throughput_*):

    --preset llama3.1-8b --layers 8 --seq 8192            the 8B shape, reduced depth
    --preset llama3.2-1b --layers 16 --seq 8192           the 1B shape (+ hf_compile_bf16: torchao's own baseline)
    --preset qwen3-30b-a3b --layers 4 --seq 4096 --mbs 2 --experts
                                                          MoE: FP8 grouped experts (ours_bf16 vs ours_fp8_rowwise)
    --layers 2 --seq 1024 --mbs 2 --steps 200 --data bigram --concurrent --variants ours_bf16,ours_fp8_...
                                                          the loss of each FP8 recipe vs bf16 after 200 steps

``--data bigram`` replaces the synthetic uniform tokens (nothing to learn past the unigram) by a learnable stream:
each token follows its predecessor through a fixed random permutation of 4,096 tokens with probability 0.9, else
is uniform over them, so the loss falls far below ln(vocab) in a few hundred steps and FP8 errors show in the
curve. ``--concurrent`` runs the variants side by side on the GPU (for loss curves only: their tokens/s are not
comparable then; at the 8B shape with 2 layers each process takes ~36 GiB, so at most three fit on one
141 GB GPU). ``--profile`` adds a kernel-time breakdown of two steps of each of ours (torch.profiler).
``--grad-accum-fusion`` sets ``kernels.grad_accum_fusion`` for every one of ours (bf16 and FP8 alike): weight grads
go into the fp32 ``main_grad`` inside the GEMM (bf16: cuBLAS accumulating; FP8: the first micro-batch writes fp32).

Every variant runs in its own process. Ours start from the same random init (same seed) and train on the same
synthetic tokens, so their losses compare directly (FP8 vs bf16 after N steps); the torchao rows are an HF model of
the same shape (its own random init), reported for throughput and with their own loss. Median tokens/s after
warm-up; ratios print last.
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

OURS = {"ours_bf16": None, "ours_fp8_tensorwise": "tensorwise", "ours_fp8_rowwise": "rowwise",
        "ours_fp8_blockwise": "blockwise", "ours_fp8_adaptive": "adaptive"}
TORCHAO = {"torchao_tensorwise": "tensorwise", "torchao_rowwise": "rowwise", "hf_compile_bf16": None}


def _recipe(args, fp8: dict | None) -> dict:
    train = {"stage": "pretrain", "steps": args.steps, "global_batch_size": args.mbs, "micro_batch_size": args.mbs,
             "lr": 1e-4, "lr_schedule": "constant", "weight_decay": 0.0, "grad_clip": 1.0, "precision": "bf16", "seed": 1}
    if fp8 is not None:
        train["fp8"] = fp8
    return {"backend": "megatron", "model": {"preset": args.preset, "num_layers": args.layers},
            "data": {"format": "synthetic", "seq_length": args.seq}, "train": train,
            "checkpoint": {"save_at_end": False}, "accelerator": "cuda",
            "kernels": {"layers": "loongforge", "grad_accum_fusion": args.grad_accum_fusion},
            "logging": {"tensorboard": False, "interval": 5}}


BIGRAM_VOCAB = 4096


def bigram_tokens(idx: int, length: int, seed: int):
    """Sample ``idx`` of the learnable synthetic stream (see the module docstring)."""
    import torch

    perm = torch.randperm(BIGRAM_VOCAB, generator=torch.Generator().manual_seed(1234)).tolist()
    g = torch.Generator().manual_seed(seed * 1_000_003 + idx)
    noise = torch.randint(0, BIGRAM_VOCAB, (length,), generator=g).tolist()
    keep = (torch.rand(length, generator=g) < 0.9).tolist()
    out = [noise[0]]
    for i in range(1, length):  # NOTE: plain ints: a few thousand tokens a sample in about a millisecond
        out.append(perm[out[-1]] if keep[i] else noise[i])
    return torch.tensor(out)


def _use_bigram_data() -> None:
    import torch
    from loongforge_megatron.data import datasets

    def getitem(self, idx):
        text = bigram_tokens(idx, self.seq_length + 1, self.seed)
        return {"tokens": text[:-1], "labels": text[1:], "loss_mask": torch.ones(self.seq_length),
                "position_ids": torch.arange(self.seq_length)}

    datasets.SyntheticDataset.__getitem__ = getitem


CATEGORIES = (("fp8 quantize", ("_tile_kernel", "_amax_kernel", "_row_kernel", "_col_amax_kernel")),
              ("attention", ("flash", "fmha", "attention", "attn")),
              ("fused CE", ("cross_entropy", "_ce_", "flce", "logsumexp")),
              ("optimizer", ("adam", "multi_tensor", "l2norm")),
              ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "cublas")))


def _profile_steps(job, steps: int = 2) -> dict:
    """CUDA kernel time of ``steps`` steps by category (ms a step) and the top kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            job.step()
    kernels: dict[str, float] = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
        if t and ev.key:
            kernels[ev.key] = kernels.get(ev.key, 0.0) + t / 1e3 / steps
    cats: dict[str, float] = {}
    for name, ms in kernels.items():
        low = name.lower()
        cat = next((c for c, keys in CATEGORIES if any(k in low for k in keys)), "other")
        cats[cat] = cats.get(cat, 0.0) + ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:15]
    torch.cuda.synchronize()
    return {"categories_ms": cats, "top_ms": [(n[:110], round(v, 3)) for n, v in top]}


def run_ours(args, fp8: str | None) -> dict:
    import loongforge
    import torch
    import yaml

    if args.data == "bigram":
        _use_bigram_data()

    tmp = Path(tempfile.mkdtemp())
    section = None
    if fp8 == "adaptive":
        section = {"recipe": args.adaptive_recipe, "policy": str(args.policy)}
    elif fp8:
        section = {"recipe": fp8, "grad_dtype": args.grad_dtype if fp8 == "tensorwise" else "e4m3"}
    if section is not None and args.experts:
        section["experts"] = True
    (tmp / "r.yaml").write_text(yaml.safe_dump(_recipe(args, section)))
    job, _ = loongforge.build_job(loongforge.load_recipe(tmp / "r.yaml"), output_dir=tmp / "run")
    torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    for _ in range(args.steps):
        m = job.step()
        losses.append(m["loss"])
        times.append(m["step_time"])
    peak = torch.cuda.max_memory_allocated()
    from loongforge_megatron.layers.fp8 import Fp8ParallelLinear
    from loongforge_megatron.layers.grouped_experts import GroupedMLP

    mods = [m for c in job.chunks for m in c.modules()]
    out = {"losses": losses, "times": times, "peak_gib": peak / 2**30,
           "fp8_linears": sum(isinstance(m, Fp8ParallelLinear) for m in mods),
           "fp8_expert_layers": sum(isinstance(m, GroupedMLP) and m.fp8_gemms is not None for m in mods)}
    if args.profile:
        out["profile"] = _profile_steps(job)
    job.close()
    return out


def run_hf(args, fp8: str | None) -> dict:
    import torch
    import transformers as tf
    from loongforge_megatron.models.registry import hf_config, presets

    spec, fields = presets()[args.preset]
    cfg = hf_config(spec.arch({**fields, "num_layers": args.layers}), torch_dtype="float32")
    config = tf.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = tf.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    model.config.use_cache = False
    if fp8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(fp8),
                                   module_filter_fn=lambda mod, fqn: fqn != "lm_head")
    fwd = torch.compile(model)
    vocab = config.vocab_size
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, fused=True)
    gen = torch.Generator(device="cuda").manual_seed(1)
    torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    for _ in range(args.steps):
        tokens = torch.randint(0, vocab, (args.mbs, args.seq + 1), device="cuda", generator=gen)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = fwd(input_ids=tokens[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
        print(f"{fp8 or 'bf16'} step {len(times)}: {times[-1]:.3f} s", flush=True)  # NOTE: the first one compiles
    return {"losses": losses, "times": times, "peak_gib": torch.cuda.max_memory_allocated() / 2**30}


def make_policy(args, work: Path) -> None:
    """``loongforge fp8 profile`` of the benchmark's recipe: the adaptive variant's policy file."""
    import yaml

    grad = args.grad_dtype if args.adaptive_recipe == "tensorwise" else "e4m3"
    section = {"recipe": args.adaptive_recipe, "grad_dtype": grad, **({"experts": True} if args.experts else {})}
    (work / "adaptive.yaml").write_text(yaml.safe_dump(_recipe(args, section)))
    subprocess.run([sys.executable, "-m", "loongforge", "fp8", "profile", str(work / "adaptive.yaml"), "-o", args.policy],
                   timeout=args.timeout, check=False)


def child(args) -> None:
    try:
        if args.variant in OURS:
            out = run_ours(args, OURS[args.variant])
        else:
            out = run_hf(args, TORCHAO[args.variant])
    except Exception as exc:  # OOM or a failure: report it as a row, keep the other variants
        out = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:240] if str(exc) else ''}"}
    Path(args.json).write_text(json.dumps(out))


def render(args, rows: dict, device: str) -> str:
    lines = [f"## {args.preset}, {args.layers} layers, seq {args.seq}, micro-batch {args.mbs}, one {device}, "
             f"{time.strftime('%Y-%m-%d')}" + (", ours with kernels.grad_accum_fusion" if args.grad_accum_fusion
                                                else ""), "",
             f"{args.steps} steps, median step time after {args.warmup} warm-up steps. Loss: ours vs ours_bf16 at the "
             "last step (same init and tokens); torchao rows: their own model init.", "",
             "| variant | tokens/s | peak GiB | loss step 1 → last | last loss vs ours_bf16 |", "|---|---|---|---|---|"]
    base = rows.get("ours_bf16", {})
    tail = min(50, max(1, args.steps // 4))  # NOTE: 200 steps -> the last 50, where the curves have flattened
    if args.concurrent:
        lines[2] = (f"{args.steps} steps, variants run side by side (tokens/s not comparable). Loss: mean of the last "
                    f"{tail} steps vs ours_bf16's (same init and tokens); max |relative difference| per step over "
                    "the whole curve.")
        lines[4] = "| variant | loss step 1 → last | last-steps mean vs ours_bf16 | max per-step difference |"
        lines[5] = "|---|---|---|---|"
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"| {name} | {r['error']} | | | |")
            continue
        rel = ""
        if name.startswith("ours") and "losses" in base:
            if args.concurrent:
                a, b = r["losses"], base["losses"]
                mean = lambda v: sum(v[-tail:]) / tail  # noqa: E731
                worst = max(abs(x - y) / y for x, y in zip(a, b, strict=False))
                lines.append(f"| {name} | {a[0]:.4f} → {a[-1]:.4f} | {(mean(a) - mean(b)) / mean(b):+.2%} | "
                             f"{worst:.2%} |")
                continue
            rel = f"{(r['losses'][-1] - base['losses'][-1]) / base['losses'][-1]:+.2%}"
        fp8 = f" ({r['fp8_linears']} FP8 linears, {r['fp8_expert_layers']} FP8 expert layers)" \
            if r.get("fp8_linears") or r.get("fp8_expert_layers") else ""
        lines.append(f"| {name}{fp8} | {r['tokens_per_s']:,.0f} | {r['peak_gib']:.1f} | "
                     f"{r['losses'][0]:.4f} → {r['losses'][-1]:.4f} | {rel} |")
    lines.append("")
    for name, r in rows.items():
        if "profile" in r:
            cats = r["profile"]["categories_ms"]
            total = sum(cats.values())
            lines.append(f"{name} kernel time a step: {total:.1f} ms = " + ", ".join(
                f"{c} {ms:.1f}" for c, ms in sorted(cats.items(), key=lambda kv: -kv[1])))
            lines.extend(f"    {ms:8.3f} ms  {k}" for k, ms in r["profile"]["top_ms"])
    if args.concurrent:
        return "\n".join(lines)
    tps = {k: v["tokens_per_s"] for k, v in rows.items() if "tokens_per_s" in v}
    for name in [k for k in tps if k.startswith("ours_fp8")]:
        parts = []
        for peer in ("ours_bf16", "torchao_tensorwise", "torchao_rowwise", "hf_compile_bf16"):
            if peer in tps:
                parts.append(f"{tps[name] / tps[peer]:.2f}x {peer}")
        lines.append(f"{name}: " + ", ".join(parts))
    for name in ("torchao_tensorwise", "torchao_rowwise"):
        if name in tps and "hf_compile_bf16" in tps:
            lines.append(f"{name}: {tps[name] / tps['hf_compile_bf16']:.2f}x hf_compile_bf16 (torchao's own speed-up)")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="llama3.1-8b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--mbs", type=int, default=1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--grad-dtype", default="e4m3", help="ours tensorwise: gradient FP8 format")
    p.add_argument("--adaptive-recipe", default="tensorwise")
    p.add_argument("--variants", default=",".join([*OURS, "torchao_tensorwise", "torchao_rowwise"]))
    p.add_argument("--timeout", type=int, default=240, help="seconds per variant")
    p.add_argument("--out", default=None, help="append the table (markdown) to this file; losses to FILE.losses.json")
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    p.add_argument("--policy", default=None)
    p.add_argument("--data", choices=("uniform", "bigram"), default="uniform", help="ours: synthetic token stream")
    p.add_argument("--concurrent", action="store_true", help="run the variants side by side (loss curves)")
    p.add_argument("--profile", action="store_true", help="ours: kernel-time breakdown of two more steps")
    p.add_argument("--experts", action="store_true", help="ours FP8: MoE experts in FP8 too (train.fp8.experts)")
    p.add_argument("--grad-accum-fusion", action="store_true",
                   help="ours, bf16 and FP8 alike: kernels.grad_accum_fusion (weight grads into the fp32 main_grad)")
    args = p.parse_args()
    if args.variant:
        return child(args)

    import torch

    work = Path(tempfile.mkdtemp())
    args.policy = args.policy or str(work / "fp8_policy.json")
    device = torch.cuda.get_device_name()
    rows: dict = {}
    names = args.variants.split(",")
    if "ours_fp8_adaptive" in names and not Path(args.policy).is_file():
        make_policy(args, work)

    def cmd(name: str) -> list[str]:
        return [sys.executable, __file__, "--variant", name, "--json", str(work / f"{name}.json"), "--preset",
                args.preset, "--layers", str(args.layers), "--seq", str(args.seq), "--mbs", str(args.mbs), "--steps",
                str(args.steps), "--grad-dtype", args.grad_dtype, "--adaptive-recipe", args.adaptive_recipe,
                "--policy", args.policy, "--data", args.data] + (["--profile"] if args.profile else []) + (
                    ["--experts"] if args.experts else []) + (["--grad-accum-fusion"] if args.grad_accum_fusion else [])

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    t0 = time.time()
    if args.concurrent:
        procs = []
        for name in names:  # NOTE: staggered, so two ranks' free-port picks cannot collide
            procs.append(subprocess.Popen(cmd(name), env=env))
            time.sleep(3)
        for proc in procs:
            try:
                proc.wait(timeout=max(1.0, args.timeout - (time.time() - t0)))
            except subprocess.TimeoutExpired:
                proc.kill()
    for name in names:
        if not args.concurrent:
            t0 = time.time()
            try:
                subprocess.run(cmd(name), env=env, timeout=args.timeout)
            except subprocess.TimeoutExpired:
                pass
        js = work / f"{name}.json"
        res = json.loads(js.read_text()) if js.is_file() else {"error": f"no result (crashed or > {args.timeout} s)"}
        res["wall_s"] = time.time() - t0
        if "times" in res:
            res["tokens_per_s"] = args.mbs * args.seq / statistics.median(res["times"][args.warmup:])
        rows[name] = res
        print(name, {k: v for k, v in res.items() if k not in ("losses", "times", "profile")}, flush=True)
    text = render(args, rows, device)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a") as f:
            f.write(text + "\n\n")
        curves = {k: v["losses"] for k, v in rows.items() if "losses" in v}
        Path(args.out).with_suffix(".losses.json").write_text(json.dumps(curves))  # every step's loss, per variant


if __name__ == "__main__":
    main()
