"""MoE training throughput on one GPU: LoongForge's megatron backend (loongforge spec: grouped_mm experts, SDPA
flash attention, Triton kernels, no TransformerEngine) vs transformers' own MoE model with its ``grouped_mm``
experts, eager and under torch.compile, and vs torchtitan's Qwen3 MoE model (its ``GroupedExperts``, eager and
with its per-block compile); same weights, data and optimizer.

    python benchmarks/moe_throughput.py --preset qwen3-30b-a3b --layers 4 --seq 4096 --mbs 2 --steps 20 \
        --variants loongforge,hf_grouped_mm,torchtitan
    python benchmarks/moe_throughput.py --preset deepseek-v3 --layers 4 --set num_experts=16 \
        --set moe_first_dense_layers=1 --seq 4096 --mbs 1 --variants loongforge

``--set FIELD=VALUE`` (repeatable) overrides a preset's architecture field (a reduced shape of a large model);
the HF checkpoint every variant loads is made from the overridden architecture. The ``torchtitan*`` variants need
torchtitan 0.2.2 (0.3.0 needs a newer torch than 2.11) with tyro, torchdata and datasets importable; its router's
``torch.histc`` over integer expert ids runs on CUDA only.

Every variant runs in its own process from the same random-init HF checkpoint (bf16 compute, fp32 master weights,
AdamW, grad clip 1.0) on the same synthetic tokens. Reported: median tokens/s after warm-up, active-parameter MFU,
GPU busy % (union of kernel intervals / wall time over two profiled steps), peak memory, loss agreement with HF.
Active-parameter FLOPs per token = 6 · (non-embedding parameters a token passes through: attention, norms, router,
top-k routed experts, shared experts + the output layer) + 12 · layers · heads · head_dim · seq
(``Arch.flops_per_token``; causal masking not discounted). Ratios print last; rows go to
``benchmarks/results/moe_throughput.md`` (see ``harness.py``).

    python benchmarks/moe_throughput.py --smoke       # CPU, qwen3-moe-tiny, 2 steps: checks the script itself
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import harness


def overrides(pairs: list[str]) -> dict:
    """``["num_experts=16", ...]`` -> ``{"num_experts": 16}`` (values parsed as YAML scalars)."""
    import yaml

    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set {pair!r}: expected FIELD=VALUE")
        out[key.strip()] = yaml.safe_load(value)
    return out


def arch_of(args):
    from loongforge_megatron.models.registry import presets

    spec, fields = presets()[args.preset]
    return spec.arch({**fields, **overrides(args.set), "num_layers": args.layers})


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
    del model
    if torch.cuda.is_available():  # NOTE: the parent holds no cached GPU memory while the variants run
        torch.cuda.empty_cache()


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


def _hf(args) -> str:
    return str(Path(args.work) / "hf")


def _items(args, res: dict) -> dict:
    res.update(items=args.mbs * args.seq, flops_per_item=arch_of(args).flops_per_token(args.seq))
    return res


def run_ours(args, *, grouped: bool | None = None, dispatcher: str | None = None, router_fusion: bool = True) -> dict:
    import tempfile

    import loongforge
    import yaml

    recipe = {
        "backend": "megatron",
        "model": {"hf": _hf(args), **({"moe_token_dispatcher": dispatcher} if dispatcher else {})},
        "data": {"format": "synthetic", "seq_length": args.seq},
        "train": {"stage": "cpt", "steps": args.steps + 2, "global_batch_size": args.mbs, "micro_batch_size": args.mbs,
                  "lr": 1e-4, "lr_schedule": "constant", "weight_decay": 0.0, "grad_clip": 1.0, "precision": "bf16",
                  "seed": 1},
        "checkpoint": {"load": _hf(args), "save_at_end": False},
        "accelerator": args.device,
        "kernels": {"layers": "loongforge", "moe_grouped_gemm": grouped, "moe_router_fusion": router_fusion},
        "logging": {"tensorboard": False, "interval": 5},
    }
    tmp = Path(tempfile.mkdtemp())
    (tmp / "r.yaml").write_text(yaml.safe_dump(recipe))
    job, _ = loongforge.build_job(loongforge.load_recipe(tmp / "r.yaml"), output_dir=tmp / "run")
    res = harness.job_steps(job, steps=args.steps, device=args.device)
    res["busy"], res["profile"] = busy(job.step)
    job.close()
    return _items(args, res)


def _batches(args, vocab: int):
    """The synthetic (tokens, labels) micro-batches every peer variant trains on (ours reads the same dataset)."""
    import torch
    from loongforge_megatron.data.datasets import SyntheticDataset

    data = SyntheticDataset(vocab_size=vocab, seq_length=args.seq, seed=1)
    for i in range(10**6):
        samples = [data[i * args.mbs + j] for j in range(args.mbs)]
        yield (torch.stack([s["tokens"] for s in samples]).to(args.device),
               torch.stack([s["labels"] for s in samples]).to(args.device))


def _train(args, *, params: list, loss_of) -> dict:
    """Time ``args.steps`` steps of ``loss_of(tokens, labels)`` + backward, clip 1.0 and fused AdamW (the optimizer
    numerics ours has), then profile two more."""
    import torch

    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
                            fused=args.device == "cuda")
    batches = _batches(args, args.vocab)

    def step() -> float:
        tokens, labels = next(batches)
        loss = loss_of(tokens, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    res = harness.time_steps(step, steps=args.steps, device=args.device)
    res["busy"], res["profile"] = busy(step)
    return _items(args, res)


def run_hf(args, compiled: bool, *, bf16_weights: bool = False) -> dict:
    """transformers' model; fp32 master weights under bf16 autocast (as ours), or all-bf16 weights and AdamW
    (``bf16_weights``: not the same optimizer numerics, but grouped_mm then runs in bf16 — transformers casts the
    experts' input to their weights' dtype, so under autocast its grouped_mm sees fp32)."""
    import torch
    import transformers as tf

    dtype = torch.bfloat16 if bf16_weights else torch.float32
    model = tf.AutoModelForCausalLM.from_pretrained(_hf(args), torch_dtype=dtype, attn_implementation="sdpa",
                                                    experts_implementation="grouped_mm",
                                                    device_map=args.device)
    model.config.use_cache = False
    args.vocab = vocab = model.config.vocab_size
    fwd = torch.compile(model) if compiled else model

    def loss_of(tokens, labels):
        with torch.autocast(args.device, dtype=torch.bfloat16):
            logits = fwd(input_ids=tokens).logits
        return torch.nn.functional.cross_entropy(logits.float().view(-1, vocab), labels.view(-1))

    return _train(args, params=list(model.parameters()), loss_of=loss_of)


def titan_args(hf: dict, *, seq: int, grouped_mm: bool = True):
    """torchtitan's ``Qwen3ModelArgs`` for an HF Qwen3-MoE ``config.json``: its own MoE (``GroupedExperts`` over
    ``torch._grouped_mm``, token-choice softmax top-k router with normalised weights, no shared expert, SDPA causal
    attention). The aux-loss-free expert bias is off (``load_balance_coeff=None``): HF and ours route without one."""
    from torchtitan.models.moe import MoEArgs
    from torchtitan.models.qwen3.model.args import Qwen3ModelArgs

    theta = hf.get("rope_theta") or hf["rope_parameters"]["rope_theta"]  # transformers 5 nests it
    experts = hf.get("num_experts") or hf["num_local_experts"]  # renamed in transformers 5.2x
    return Qwen3ModelArgs(
        vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
        n_heads=hf["num_attention_heads"], n_kv_heads=hf["num_key_value_heads"], head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        hidden_dim=hf["intermediate_size"], norm_eps=hf["rms_norm_eps"], rope_theta=theta, qk_norm=True,
        max_seq_len=seq, enable_weight_tying=bool(hf.get("tie_word_embeddings")), moe_enabled=True,
        moe_inter_dim=hf["moe_intermediate_size"],
        moe_args=MoEArgs(num_experts=experts, num_shared_experts=0, top_k=hf["num_experts_per_tok"],
                         score_func="softmax", route_norm=bool(hf["norm_topk_prob"]), route_scale=1.0,
                         score_before_experts=False, use_grouped_mm=grouped_mm, load_balance_coeff=None))


def run_torchtitan(args, compiled: bool) -> dict:
    """torchtitan's Qwen3 MoE (``Qwen3Model`` from its args class, HF weights through its ``Qwen3StateDictAdapter``),
    trained as its single-device default does: fp32 parameters under bf16 autocast (``mixed_precision_param``),
    its ``cross_entropy_loss``; ``compiled`` applies its per-TransformerBlock ``apply_compile``."""
    import dataclasses

    import torch
    from safetensors.torch import load_file
    from torchtitan.models.qwen3 import qwen3_args
    from torchtitan.models.qwen3.model.model import Qwen3Model
    from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter

    hf = json.loads((Path(_hf(args)) / "config.json").read_text())
    # NOTE: torchtitan's generate_permute_indices (grouped_mm padding) is a Triton kernel: the CPU smoke run
    # takes its for-loop experts instead
    margs = titan_args(hf, seq=args.seq, grouped_mm=args.device == "cuda")
    if args.preset == "qwen3-30b-a3b" and not args.set:  # the model is torchtitan's own 30B-A3B flavour, cut short
        ref = qwen3_args["30B-A3B"]
        own = dataclasses.replace(ref, n_layers=args.layers, max_seq_len=args.seq,
                                  moe_args=dataclasses.replace(ref.moe_args, load_balance_coeff=None))
        assert margs == own, (margs, own)
    with torch.device("meta"):
        model = Qwen3Model(margs)
    model.to_empty(device=args.device)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device(args.device))
    hf_sd = {}
    for f in sorted(Path(_hf(args)).glob("*.safetensors")):
        hf_sd.update(load_file(f))
    model.load_state_dict(Qwen3StateDictAdapter(margs, None).from_hf(hf_sd), strict=True)
    del hf_sd
    model.train()
    if compiled:
        from torchtitan.config.job_config import Compile
        from torchtitan.models.llama4.infra.parallelize import apply_compile

        apply_compile(model, Compile(enable=True, components=["model"]), ep_enabled=False)
    from torchtitan.components.loss import cross_entropy_loss

    args.vocab = margs.vocab_size

    def loss_of(tokens, labels):
        with torch.autocast(args.device, dtype=torch.bfloat16):
            pred = model(tokens)
        return cross_entropy_loss(pred, labels) / labels.numel()

    return _train(args, params=list(model.parameters()), loss_of=loss_of)


VARIANTS = {
    "loongforge": lambda a: run_ours(a),
    "loongforge_sequential": lambda a: run_ours(a, grouped=False),  # A/B: megatron's SequentialMLP experts
    "loongforge_alltoall": lambda a: run_ours(a, dispatcher="alltoall"),  # A/B: megatron's dispatcher, grouped
    "loongforge_torch_router": lambda a: run_ours(a, router_fusion=False),  # A/B: megatron's torch routing
    "hf_grouped_mm": lambda a: run_hf(a, False),
    "hf_grouped_mm_compile": lambda a: run_hf(a, True),
    "hf_grouped_mm_bf16": lambda a: run_hf(a, False, bf16_weights=True),
    "torchtitan": lambda a: run_torchtitan(a, False),
    "torchtitan_compile": lambda a: run_torchtitan(a, True),
}


OURS_AB = ("loongforge_sequential", "loongforge_alltoall", "loongforge_torch_router")
PEERS = ("hf_grouped_mm_bf16", "hf_grouped_mm", "hf_grouped_mm_compile", "torchtitan", "torchtitan_compile")
BENCH = harness.Bench(
    name="moe_throughput", script=__file__, variants=VARIANTS, unit="tokens/s",
    pairs=[("loongforge", p) for p in (*OURS_AB, *PEERS)],
    columns={"GPU busy": lambda r: f"{100 * r['busy']:.0f}%" if r.get("busy") else ""})


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override an architecture field of the preset (repeatable)")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    harness.add_args(p, variants=VARIANTS, default="loongforge,hf_grouped_mm,hf_grouped_mm_compile")
    args = harness.parse(p, argv, steps=20, warmup=5, smoke={
        "preset": "qwen3-moe-tiny", "layers": 2, "seq": 64, "mbs": 2, "device": "cpu",
        "variants": "loongforge,hf_grouped_mm"})
    arch = arch_of(args)
    reduced = f" ({', '.join(args.set)})" if args.set else ""
    setup = (f"{args.preset}{reduced}, {args.layers} layers, seq {args.seq}, mbs {args.mbs}; {arch.num_experts} "
             f"experts top-{arch.moe_topk}, {arch.num_params() / 1e9:.2f}B params; MFU on active params")
    return BENCH.main(args, setup=setup, device=args.device, prepare=lambda a, work: make_hf(a, work / "hf"))


if __name__ == "__main__":
    main()
