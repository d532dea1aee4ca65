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
warm-up; ratios print last (see ``harness.py``); rows go to ``benchmarks/results/fp8_throughput.md`` and, with
``--out FILE``, every step's loss per variant to ``FILE.losses.json``.

    python benchmarks/fp8_throughput.py --smoke     # CPU, llama-tiny, ours_bf16 vs hf_eager_bf16, 2 steps
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import harness

OURS = {"ours_bf16": None, "ours_fp8_tensorwise": "tensorwise", "ours_fp8_rowwise": "rowwise",
        "ours_fp8_blockwise": "blockwise", "ours_fp8_adaptive": "adaptive"}
TORCHAO = {"torchao_tensorwise": "tensorwise", "torchao_rowwise": "rowwise", "hf_compile_bf16": None}


def _recipe(args, fp8: dict | None) -> dict:
    train = {"stage": "pretrain", "steps": args.steps, "global_batch_size": args.mbs, "micro_batch_size": args.mbs,
             "lr": 1e-4, "lr_schedule": "constant", "weight_decay": 0.0, "grad_clip": 1.0,
             "precision": "bf16" if args.device == "cuda" else "fp32", "seed": 1}
    if fp8 is not None:
        train["fp8"] = fp8
    return {"backend": "megatron", "model": {"preset": args.preset, "num_layers": args.layers},
            "data": {"format": "synthetic", "seq_length": args.seq}, "train": train,
            "checkpoint": {"save_at_end": False}, "accelerator": args.device,
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
    import tempfile

    import loongforge
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
    out = harness.job_steps(job, steps=args.steps, device=args.device)
    from loongforge_megatron.layers.fp8 import Fp8ParallelLinear
    from loongforge_megatron.layers.grouped_experts import GroupedMLP

    mods = [m for c in job.chunks for m in c.modules()]
    out.update(items=args.mbs * args.seq, fp8_linears=sum(isinstance(m, Fp8ParallelLinear) for m in mods),
               fp8_expert_layers=sum(isinstance(m, GroupedMLP) and m.fp8_gemms is not None for m in mods))
    if args.profile:
        out["kernel_profile"] = _profile_steps(job)
    job.close()
    return out


def run_hf(args, fp8: str | None, *, compiled: bool = True) -> dict:
    import torch
    import transformers as tf
    from loongforge_megatron.models.registry import hf_config, presets

    spec, fields = presets()[args.preset]
    cfg = hf_config(spec.arch({**fields, "num_layers": args.layers}), torch_dtype="float32")
    config = tf.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(args.device):
        model = tf.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    model.config.use_cache = False
    if fp8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(fp8),
                                   module_filter_fn=lambda mod, fqn: fqn != "lm_head")
    fwd = torch.compile(model) if compiled else model
    vocab = config.vocab_size
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
                            fused=args.device == "cuda")
    gen = torch.Generator(device=args.device).manual_seed(1)

    def step():
        tokens = torch.randint(0, vocab, (args.mbs, args.seq + 1), device=args.device, generator=gen)
        with torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.device == "cuda"):
            logits = fwd(input_ids=tokens[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    # NOTE: the first step compiles
    return {**harness.time_steps(step, steps=args.steps, device=args.device), "items": args.mbs * args.seq}


def make_policy(args, work: Path) -> None:
    """``loongforge fp8 profile`` of the benchmark's recipe: the adaptive variant's policy file."""
    import yaml

    grad = args.grad_dtype if args.adaptive_recipe == "tensorwise" else "e4m3"
    section = {"recipe": args.adaptive_recipe, "grad_dtype": grad, **({"experts": True} if args.experts else {})}
    (work / "adaptive.yaml").write_text(yaml.safe_dump(_recipe(args, section)))
    subprocess.run([sys.executable, "-m", "loongforge", "fp8", "profile", str(work / "adaptive.yaml"), "-o", args.policy],
                   timeout=600, check=False)


VARIANTS = {**{name: (lambda a, r=r: run_ours(a, r)) for name, r in OURS.items()},
            **{name: (lambda a, r=r: run_hf(a, r)) for name, r in TORCHAO.items()},
            # HF eager in bf16 autocast (no compile, no torchao): the CPU smoke run's peer
            "hf_eager_bf16": lambda a: run_hf(a, None, compiled=False)}


def notes(args) -> Callable[[dict[str, dict]], list[str]]:
    """Each FP8 row's last loss against ours_bf16 (same init and tokens), and the kernel-time profiles."""

    def lines(rows: dict[str, dict]) -> list[str]:
        out = []
        base = rows.get("ours_bf16", {})
        tail = min(50, max(1, args.steps // 4))  # NOTE: 200 steps -> the last 50, where the curves have flattened
        for name, r in rows.items():
            if not (name.startswith("ours_fp8") and r.get("losses") and base.get("losses")):
                continue
            a, b = r["losses"], base["losses"]
            mean = lambda v: sum(v[-tail:]) / len(v[-tail:])  # noqa: E731
            out.append(f"{name}: mean of the last {tail} losses {(mean(a) - mean(b)) / mean(b):+.2%} vs ours_bf16, "
                       f"max per-step difference {harness.loss_diff(a, b):.2%}.")
        for name, r in rows.items():
            if r.get("kernel_profile"):
                cats = r["kernel_profile"]["categories_ms"]
                out.append(f"{name} kernel time a step: {sum(cats.values()):.1f} ms = " + ", ".join(
                    f"{c} {ms:.1f}" for c, ms in sorted(cats.items(), key=lambda kv: -kv[1])))
                out.extend(f"    {ms:8.3f} ms  {k}" for k, ms in r["kernel_profile"]["top_ms"])
        if args.concurrent:
            out.append("Variants ran side by side: their tokens/s are not comparable, only their losses.")
        return out

    return lines


def run_side_by_side(args, names: list[str]) -> dict[str, dict]:
    """--concurrent: every variant's process at once (for loss curves; one GPU shared)."""
    procs, t0 = [], time.time()
    for name in names:  # NOTE: staggered, so two ranks' free-port picks cannot collide
        procs.append(subprocess.Popen(BENCH.child_command(name, args)))
        time.sleep(3)
    timeout = float(args.timeout) if "=" not in str(args.timeout) else 900.0
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, timeout - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            proc.kill()
    return {name: BENCH.child_result(name, args) for name in names}


BENCH = harness.Bench(
    name="fp8_throughput", script=__file__, variants=VARIANTS, unit="tokens/s",
    pairs=[*((o, p) for o in OURS if o != "ours_bf16" for p in ("ours_bf16", *TORCHAO)),
           ("ours_bf16", "hf_eager_bf16"),
           *((t, "hf_compile_bf16") for t in ("torchao_tensorwise", "torchao_rowwise"))],
    columns={"FP8 linears / expert layers": lambda r: f"{r.get('fp8_linears', '')} / {r.get('fp8_expert_layers', '')}"
             if "fp8_linears" in r else ""})


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama3.1-8b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--mbs", type=int, default=1)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: ours_bf16 and hf_eager_bf16 only")
    p.add_argument("--grad-dtype", default="e4m3", help="ours tensorwise: gradient FP8 format")
    p.add_argument("--adaptive-recipe", default="tensorwise")
    p.add_argument("--policy", default=None, help="ours_fp8_adaptive: the policy file (default: profiled first)")
    p.add_argument("--data", choices=("uniform", "bigram"), default="uniform", help="ours: synthetic token stream")
    p.add_argument("--concurrent", action="store_true", help="run the variants side by side (loss curves)")
    p.add_argument("--profile", action="store_true", help="ours: kernel-time breakdown of two more steps")
    p.add_argument("--experts", action="store_true", help="ours FP8: MoE experts in FP8 too (train.fp8.experts)")
    p.add_argument("--grad-accum-fusion", action="store_true",
                   help="ours, bf16 and FP8 alike: kernels.grad_accum_fusion (weight grads into the fp32 main_grad)")
    harness.add_args(p, variants=VARIANTS, default=",".join([*OURS, "torchao_tensorwise", "torchao_rowwise"]))
    args = harness.parse(p, argv, steps=20, warmup=5, smoke={
        "preset": "llama-tiny", "layers": 2, "seq": 64, "mbs": 2, "device": "cpu",
        "variants": "ours_bf16,hf_eager_bf16"})

    def prepare(a, work: Path) -> None:
        a.policy = a.policy or str(work / "fp8_policy.json")
        if "ours_fp8_adaptive" in a.variants.split(",") and not Path(a.policy).is_file():
            make_policy(a, work)
        a.argv += ["--policy", a.policy]

    setup = (f"{args.preset}, {args.layers} layers, seq {args.seq}, mbs {args.mbs}, {args.data} tokens"
             + (", grad_accum_fusion" if args.grad_accum_fusion else "") + (", side by side" if args.concurrent else ""))
    BENCH.notes, BENCH.ratios = notes(args), not args.concurrent
    rows = BENCH.main(args, setup=setup, device=args.device, prepare=prepare,
                      run_all=run_side_by_side if args.concurrent and not args.in_process else None)
    if args.out and not args.variant:  # every step's loss, per variant
        curves = {k: v["losses"] for k, v in rows.items() if "losses" in v}
        Path(args.out).with_suffix(".losses.json").write_text(json.dumps(curves))
    return rows


if __name__ == "__main__":
    main()
