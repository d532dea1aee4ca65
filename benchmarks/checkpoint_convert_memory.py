"""Peak memory of streaming HF <-> megatron conversion on a ~2 GB Llama-shaped fp32 checkpoint.

Generates random weights with safetensors directly (no transformers model), converts HF -> megatron (tp=2)
and back in child processes, and compares each child's peak RSS (above its post-import baseline) with the
bytes of the largest tensor group (the peer: a converter that holds one group at a time). Ratios per
direction, the worst printed last; nothing is asserted. One row per direction is appended to
``benchmarks/results/checkpoint_convert_memory.md`` with the date and hardware (see ``harness.py``).

    uv run python benchmarks/checkpoint_convert_memory.py [--workdir DIR] [--layers 16]
    uv run python benchmarks/checkpoint_convert_memory.py --smoke   # a tiny checkpoint, steps in this process
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

SHAPE = dict(hidden=2048, layers=16, vocab=32000, intermediate=2048, heads=16, kv_heads=4)
SMOKE_SHAPE = dict(hidden=64, layers=2, vocab=512, intermediate=128, heads=4, kv_heads=2)


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def generate(hf_dir: Path, *, layers: int) -> int:
    """Write a random Llama-shaped HF checkpoint tensor by tensor; return the largest group's bytes."""
    import torch
    from loongforge.checkpoint import ShardedSafetensorsWriter

    h, v, i = SHAPE["hidden"], SHAPE["vocab"], SHAPE["intermediate"]
    d = h // SHAPE["heads"]
    per_layer = {
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (h, h), "self_attn.k_proj.weight": (SHAPE["kv_heads"] * d, h),
        "self_attn.v_proj.weight": (SHAPE["kv_heads"] * d, h), "self_attn.o_proj.weight": (h, h),
        "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i),
    }
    shapes = {"model.embed_tokens.weight": (v, h)}
    for layer in range(layers):
        shapes.update({f"model.layers.{layer}.{k}": s for k, s in per_layer.items()})
    shapes.update({"model.norm.weight": (h,), "lm_head.weight": (v, h)})
    specs = {k: (torch.float32, s) for k, s in shapes.items()}
    with ShardedSafetensorsWriter(hf_dir, specs, max_shard_bytes=512 * 2**20) as w:
        for k, s in shapes.items():
            w.add(k, torch.randn(s) * 0.02)
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": h, "intermediate_size": i,
        "num_hidden_layers": layers, "num_attention_heads": SHAPE["heads"], "num_key_value_heads": SHAPE["kv_heads"],
        "vocab_size": v, "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False,
        "max_position_embeddings": 4096, "rope_theta": 10000.0, "torch_dtype": "float32",
    }
    (hf_dir / "config.json").write_text(json.dumps(config))
    groups = [v * h * 4, (h * h + 2 * SHAPE["kv_heads"] * d * h) * 4, 2 * i * h * 4]  # embedding, qkv, gate+up
    return max(groups)


def child(direction: str, src: str, dst: str) -> dict:
    """Run one step (in a fresh process) and return its peak RSS and its post-import baseline."""
    import torch  # noqa: F401
    from loongforge_megatron.conversion import hf_to_megatron, megatron_to_hf

    if direction == "generate":
        return {"group_bytes": generate(Path(dst), layers=int(src))}

    base = _rss_mb()
    t0 = time.perf_counter()
    if direction == "hf_to_megatron":
        hf_to_megatron(src, dst, tp=2)
    else:
        megatron_to_hf(src, dst, max_shard_bytes=512 * 2**20)
    return {"baseline_mb": base, "peak_mb": _rss_mb(), "seconds": time.perf_counter() - t0}


def run_child(direction: str, src: Path, dst: Path, *, smoke: bool = False) -> dict:
    # NOTE: every step runs in its own process (the parent never imports torch), so each peak is its own; the
    # smoke run checks the script, not the memory, and runs them here
    if smoke:
        return child(direction, str(src), str(dst))
    out = subprocess.run([sys.executable, __file__, "--child", direction, str(src), str(dst)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--layers", type=int, default=SHAPE["layers"])
    ap.add_argument("--results", default=None, help=f"folder of the results table (default {harness.RESULTS})")
    ap.add_argument("--smoke", action="store_true", help="a tiny checkpoint, the steps in this process")
    ap.add_argument("--child", nargs=3, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)))
        return []
    if args.smoke:
        SHAPE.update(SMOKE_SHAPE)
        args.layers = SMOKE_SHAPE["layers"]
    work = Path(args.workdir or tempfile.mkdtemp(prefix="lf_ckpt_bench_"))
    rows = []
    try:
        group = run_child("generate", args.layers, work / "hf", smoke=args.smoke)["group_bytes"]
        size = sum(f.stat().st_size for f in (work / "hf").glob("*.safetensors"))
        print(f"checkpoint: {size / 2**30:.2f} GiB fp32, {args.layers} layers; largest group {group / 2**20:.0f} MiB")
        worst = 0.0
        for direction, src, dst in (("hf_to_megatron", work / "hf", work / "mg"),
                                    ("megatron_to_hf", work / "mg", work / "hf_back")):
            r = run_child(direction, src, dst, smoke=args.smoke)
            extra = r["peak_mb"] - r["baseline_mb"]
            ratio = extra * 2**20 / group
            worst = max(worst, ratio)
            rows.append({"direction": direction, "ratio": ratio, **r})
            print(f"{direction:15s} tp=2: {r['seconds']:6.1f}s  peak RSS {r['peak_mb']:7.0f} MiB "
                  f"(post-import baseline {r['baseline_mb']:.0f} MiB, +{extra:.0f} MiB = {ratio:.2f}x largest group)")
        print(f"peak RSS above baseline / largest group bytes, worst direction (target < 2x): {worst:.2f}")
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    results = Path(args.results) if args.results else (None if args.smoke else harness.RESULTS)
    if results is not None:
        setup = f"{size / 2**30:.2f} GiB fp32 Llama shape, {args.layers} layers, tp 2"
        harness.append_rows(results / "checkpoint_convert_memory.md", script=__file__, hardware=harness.hardware("cpu"),
                            head=["setup", "direction", "seconds", "peak RSS MiB", "above baseline / largest group"],
                            rows=[[setup, r["direction"], f"{r['seconds']:.1f}", f"{r['peak_mb']:.0f}",
                                   f"{r['ratio']:.2f}x"] for r in rows])
    return rows


if __name__ == "__main__":
    main()
