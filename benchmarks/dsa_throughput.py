"""DeepSeek Sparse Attention training throughput on one GPU at long context: LoongForge's DeepSeek-V3.2 (MLA with
the lightning indexer; each query attends to its top-k keys through the sparse MLA kernel) vs the same model with
dense MLA (DeepSeek-V3: the checkpoint less its indexer), same weights, data and optimizer.

    python benchmarks/dsa_throughput.py --preset deepseek-v3.2-lite --layers 4 --seq 32768
    python benchmarks/dsa_throughput.py --smoke       # CPU, deepseek-v3.2-tiny, 2 steps: checks the script itself

Variants: ``loongforge_sparse`` (sparse training from step 0: ``model.dsa.warmup_steps`` 0),
``loongforge_warmup`` (the dense warm-up phase: full attention, the indexer scored and trained alongside), and
``loongforge_dense`` (DeepSeek-V3 from the same weights less the indexer). The dense model is the peer: sparse
attention's point is tokens/s at long context (the goal at 32k: sparse ≥ 2× dense). The loss curves differ by
design (different attention): their printed agreement says how far sparse attention moves the loss. MFU counts the attention each query does: its
top-k keys when sparse (the indexer's own scoring not counted), the causal-undiscounted full sequence when dense.
Rows go to ``benchmarks/results/dsa_throughput.md`` (see ``harness.py``).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import harness


def arch_of(args):
    from loongforge_megatron.models.registry import presets

    spec, fields = presets()[args.preset]
    return spec.arch({**fields, "num_layers": args.layers})


def make_hf(args, work: Path) -> None:
    """The DeepSeek-V3.2 checkpoint (random init, saved by transformers) and its dense twin: the same tensors less
    ``self_attn.indexer.*``, with a DeepSeek-V3 config."""
    import torch
    import transformers as tf
    from loongforge_megatron.models.registry import hf_config
    from safetensors.torch import load_file, save_file

    cfg = hf_config(arch_of(args), torch_dtype="bfloat16")
    config = tf.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    torch.manual_seed(0)
    with torch.device(args.device):
        model = tf.AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model.save_pretrained(work / "sparse")
    del model
    dense = work / "dense"
    dense.mkdir()
    for f in sorted((work / "sparse").glob("*.safetensors")):
        tensors = {k: v for k, v in load_file(f).items() if ".indexer." not in k}
        save_file(tensors, dense / f.name, metadata={"format": "pt"})
    index = work / "sparse" / "model.safetensors.index.json"
    if index.is_file():
        idx = json.loads(index.read_text())
        idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if ".indexer." not in k}
        (dense / index.name).write_text(json.dumps(idx))
    hf = json.loads((work / "sparse" / "config.json").read_text())
    hf = {k: v for k, v in hf.items() if not k.startswith("index_")}
    hf.update(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"])
    (dense / "config.json").write_text(json.dumps(hf, indent=2))
    if torch.cuda.is_available():  # NOTE: the parent holds no cached GPU memory while the variants run
        torch.cuda.empty_cache()


def run_ours(args, *, which: str) -> dict:
    import loongforge
    import yaml

    hf = str(Path(args.work) / ("dense" if which == "dense" else "sparse"))
    model = {"hf": hf}
    if which != "dense":
        model["dsa"] = {"warmup_steps": 0 if which == "sparse" else 10**6}
    recipe = {
        "backend": "megatron",
        "model": model,
        "data": {"format": "synthetic", "seq_length": args.seq},
        "train": {"stage": "cpt", "steps": args.steps + 2, "global_batch_size": args.mbs, "micro_batch_size": args.mbs,
                  "lr": 1e-4, "lr_schedule": "constant", "weight_decay": 0.0, "grad_clip": 1.0, "precision": "bf16",
                  "seed": 1},
        "checkpoint": {"load": hf, "save_at_end": False},
        "accelerator": args.device,
        "kernels": {"layers": "loongforge"},
        "parallel": {"recompute": args.recompute},
        "logging": {"tensorboard": False, "interval": 5},
    }
    tmp = Path(tempfile.mkdtemp())
    (tmp / "r.yaml").write_text(yaml.safe_dump(recipe))
    job, _ = loongforge.build_job(loongforge.load_recipe(tmp / "r.yaml"), output_dir=tmp / "run")
    res = harness.job_steps(job, steps=args.steps, device=args.device)
    job.close()
    arch = arch_of(args)
    keys = args.seq if which != "sparse" else min(args.seq, arch.dsa_index_topk)
    res.update(items=args.mbs * args.seq, flops_per_item=arch.flops_per_token(keys))
    return res


VARIANTS = {
    "loongforge_sparse": lambda a: run_ours(a, which="sparse"),
    "loongforge_warmup": lambda a: run_ours(a, which="warmup"),
    "loongforge_dense": lambda a: run_ours(a, which="dense"),
}
BENCH = harness.Bench(
    name="dsa_throughput", script=__file__, variants=VARIANTS, unit="tokens/s",
    pairs=[("loongforge_sparse", "loongforge_dense"), ("loongforge_warmup", "loongforge_dense")])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="deepseek-v3.2-lite", help="a DeepSeek-V3.2 preset")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--mbs", type=int, default=1)
    p.add_argument("--recompute", default="none", choices=["none", "selective", "full"],
                   help="parallel.recompute of every variant")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    harness.add_args(p, variants=VARIANTS, default="loongforge_sparse,loongforge_dense")
    args = harness.parse(p, argv, steps=10, warmup=3, smoke={
        "preset": "deepseek-v3.2-tiny", "layers": 2, "seq": 64, "device": "cpu",
        "variants": "loongforge_sparse,loongforge_dense"})
    arch = arch_of(args)
    setup = (f"{args.preset}, {args.layers} layers, seq {args.seq}, mbs {args.mbs}, top-{arch.dsa_index_topk} keys, "
             f"{arch.num_experts} experts top-{arch.moe_topk}, bf16"
             f"{'' if args.recompute == 'none' else f', recompute {args.recompute}'}")
    return BENCH.main(args, setup=setup, device=args.device, prepare=lambda a, work: make_hf(a, work))


if __name__ == "__main__":
    main()
