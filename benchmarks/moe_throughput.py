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
        "kernels": {"layers": "loongforge", "moe_grouped_gemm": grouped, "moe_router_fusion": router_fusion},
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
        return float(loss.detach())

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


def run_hf(args, compiled: bool, *, bf16_weights: bool = False) -> dict:
    """transformers' model; fp32 master weights under bf16 autocast (as ours), or all-bf16 weights and AdamW
    (``bf16_weights``: not the same optimizer numerics, but grouped_mm then runs in bf16 — transformers casts the
    experts' input to their weights' dtype, so under autocast its grouped_mm sees fp32)."""
    import torch
    import transformers as tf

    dtype = torch.bfloat16 if bf16_weights else torch.float32
    model = tf.AutoModelForCausalLM.from_pretrained(args.hf_dir, torch_dtype=dtype, attn_implementation="sdpa",
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

    hf = json.loads((Path(args.hf_dir) / "config.json").read_text())
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
    for f in sorted(Path(args.hf_dir).glob("*.safetensors")):
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
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override an architecture field of the preset (repeatable)")
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
               "--layers", str(args.layers), "--device", args.device, *(f"--set={kv}" for kv in args.set)]
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
    reduced = f" ({', '.join(args.set)})" if args.set else ""
    lines = [f"# MoE training throughput — {args.preset} shape{reduced}, {args.layers} layers, seq {args.seq}, "
             f"micro-batch {args.mbs}, bf16, one {device}, {time.strftime('%Y-%m-%d')}", "",
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
    for peer in ("hf_grouped_mm", "hf_grouped_mm_compile", "hf_grouped_mm_bf16", "torchtitan", "torchtitan_compile",
                 "loongforge_sequential", "loongforge_alltoall", "loongforge_torch_router"):
        r = rows.get(peer, {})
        if "losses" in ours and "losses" in r:
            n = min(len(r["losses"]), len(ours["losses"]))
            diffs = [abs(a - b) / abs(b) for a, b in zip(ours["losses"][:n], r["losses"][:n], strict=True)]
            lines += ["", f"Loss vs {peer} over {n} steps (same weights, data, optimizer): max relative difference "
                          f"{max(diffs):.2e}, mean {statistics.mean(diffs):.2e}."]
    lines.append("")
    for peer in ("loongforge_sequential", "loongforge_alltoall", "loongforge_torch_router", "hf_grouped_mm_bf16",
                 "hf_grouped_mm", "hf_grouped_mm_compile", "torchtitan", "torchtitan_compile"):
        if "tokens_per_s" in ours and "tokens_per_s" in rows.get(peer, {}):
            lines.append(f"loongforge / {peer}: {ours['tokens_per_s'] / rows[peer]['tokens_per_s']:.2f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
