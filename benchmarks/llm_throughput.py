"""End-to-end LLM training throughput on one GPU: LoongForge's megatron backend (loongforge layers: SDPA flash
attention + Triton kernels + fused linear cross-entropy, no TransformerEngine) vs megatron-core's local layers vs
HF transformers eager vs HF transformers + torch.compile, same model, weights, data and optimizer settings.

    python benchmarks/llm_throughput.py --preset llama3.2-1b --seq 4096 --steps 20
    python benchmarks/llm_throughput.py --smoke          # CPU, llama-tiny, 2 steps: checks the script itself

Every variant runs in its own process (clean memory, see ``harness.py``), starts from the same random-init HF
checkpoint, trains on the same synthetic tokens with AdamW (fp32 master weights, bf16 compute), and reports median
tokens/s after warm-up, MFU and peak memory. FLOPs per token (one formula for all): 6·(non-embedding params + output
layer) + 12·layers·(heads·head_dim)·seq — the PaLM/Megatron estimate (causal masking not discounted). Ratios print
last; rows go to ``benchmarks/results/llm_throughput.md``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import harness


def make_hf(args, out: Path) -> None:
    import torch
    import transformers as tf
    from loongforge_megatron.models.registry import hf_config, presets

    spec, fields = presets()[args.preset]
    cfg = hf_config(spec.arch(fields), torch_dtype="bfloat16")
    config = tf.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k not in ("architectures",)})
    torch.manual_seed(0)
    with torch.device(args.device):
        model = tf.AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model.save_pretrained(out)


def _mbs(args) -> int:
    mbs = dict(kv.split("=") for kv in args.mbs.split(","))
    return int(mbs.get(args.variant_name, 1))


def _items(args, res: dict) -> dict:
    from loongforge_megatron.models.hf_arch import arch_from_hf

    res["items"] = _mbs(args) * args.seq
    res["flops_per_item"] = arch_from_hf(_hf(args)).flops_per_token(args.seq)
    res["mbs"] = _mbs(args)
    return res


def _hf(args) -> Path:
    return Path(args.work) / "hf"


def run_ours(args, spec: str, *, one_pass_loss: bool = True, grad_accum_fusion: bool = False) -> dict:
    import loongforge
    import yaml

    if not one_pass_loss:  # A/B row: the per-token loss whose backward recomputes the logits (the pre-mask path)
        from loongforge_megatron.layers import output

        output._takes_token_weights = lambda fn: False

    recipe = {
        "backend": "megatron",
        "model": {"hf": str(_hf(args))},
        "data": {"format": "synthetic", "seq_length": args.seq},
        "train": {"stage": "cpt", "steps": args.steps, "global_batch_size": _mbs(args), "micro_batch_size": _mbs(args),
                  "lr": 1e-4, "lr_schedule": "constant", "weight_decay": 0.0, "grad_clip": 1.0,
                  "precision": "bf16" if args.device == "cuda" else "fp32", "seed": 1},
        "checkpoint": {"load": str(_hf(args)), "save_at_end": False},
        "accelerator": args.device,
        "kernels": {"layers": spec, "grad_accum_fusion": grad_accum_fusion},
        "logging": {"tensorboard": False, "interval": 5},
    }
    tmp = Path(tempfile.mkdtemp())
    (tmp / "r.yaml").write_text(yaml.safe_dump(recipe))
    job, _ = loongforge.build_job(loongforge.load_recipe(tmp / "r.yaml"), output_dir=tmp / "run")
    res = harness.job_steps(job, steps=args.steps, device=args.device)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                job.step()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70), flush=True)
    job.close()
    return _items(args, res)


def run_hf(args, compiled: bool) -> dict:
    import torch
    import transformers as tf
    from loongforge_megatron.data.datasets import SyntheticDataset

    model = tf.AutoModelForCausalLM.from_pretrained(_hf(args), torch_dtype=torch.float32, attn_implementation="sdpa")
    model = model.to(args.device)
    model.config.use_cache = False
    vocab = model.config.vocab_size
    fwd = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
                            fused=args.device == "cuda")
    data = SyntheticDataset(vocab_size=vocab, seq_length=args.seq, seed=1)
    mbs, steps = _mbs(args), iter(range(10**9))

    def step() -> float:
        i = next(steps)
        samples = [data[i * mbs + j] for j in range(mbs)]
        tokens = torch.stack([s["tokens"] for s in samples]).to(args.device)
        labels = torch.stack([s["labels"] for s in samples]).to(args.device)
        with torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.device == "cuda"):
            logits = fwd(input_ids=tokens).logits
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, vocab), labels.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return _items(args, harness.time_steps(step, steps=args.steps, device=args.device))


VARIANTS = {
    "loongforge": lambda a: run_ours(a, "loongforge"),
    "loongforge_recompute": lambda a: run_ours(a, "loongforge", one_pass_loss=False),
    # A/B row: weight gradients added into the fp32 main_grad inside the GEMM (kernels.grad_accum_fusion)
    "loongforge_gaf": lambda a: run_ours(a, "loongforge", grad_accum_fusion=True),
    "megatron_local": lambda a: run_ours(a, "local"),
    "hf_eager": lambda a: run_hf(a, False),
    "hf_compile": lambda a: run_hf(a, True),
}


BENCH = harness.Bench(
    name="llm_throughput", script=__file__, variants=VARIANTS, unit="tokens/s",
    pairs=[("loongforge", p) for p in ("hf_eager", "hf_compile", "megatron_local", "loongforge_recompute",
                                       "loongforge_gaf")])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama3.2-1b")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--mbs", default="loongforge=4,loongforge_recompute=4,loongforge_gaf=4,megatron_local=1,"
                   "hf_eager=4,hf_compile=4", help="micro-batch per variant (the loss check needs equal ones)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--profile", action="store_true", help="print a CUDA kernel profile of two of our steps")
    harness.add_args(p, variants=VARIANTS, default="loongforge,megatron_local,hf_eager,hf_compile")
    args = harness.parse(p, argv, steps=20, warmup=5, smoke={
        "preset": "llama-tiny", "seq": 64, "device": "cpu", "variants": "loongforge,hf_eager",
        "mbs": "loongforge=2,hf_eager=2"})
    setup = f"{args.preset}, seq {args.seq}, {'bf16' if args.device == 'cuda' else 'fp32'}"
    return BENCH.main(args, setup=setup, device=args.device, prepare=lambda a, work: make_hf(a, work / "hf"))


if __name__ == "__main__":
    main()
