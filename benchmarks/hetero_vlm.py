"""Heterogeneous VLM layouts: where a vision tower's and a language model's time goes under each parallel layout of
a Qwen2.5-VL-7B-shaped model on 8 GPUs (modelled), and the same layouts measured on CPU gloo ranks with the tiny
Qwen2.5-VL (measured).

    python benchmarks/hetero_vlm.py                      # modelled rows + measured CPU rows
    python benchmarks/hetero_vlm.py --vit-tflops 310 --lm-tflops 420    # model from one-GPU timings
    python benchmarks/hetero_vlm.py --smoke              # CPU, two measured layouts, 2 steps: checks the script

**Modelled rows** (``model_*``): one global batch of ``--samples`` image-text samples (one image each; image sides
lognormal around 448 px, text lognormal around 512 tokens, seeded) costed per sample from the model's shape:
training FLOPs (3x the forward) of the ViT (window attention over 8x8 patches except its full-attention blocks,
the 2x2 merger) and of the language model (causal attention, the output layer), turned into seconds at
``--vit-tflops`` / ``--lm-tflops`` achieved per GPU (defaults: 30% / 45% of 989 TFLOP/s dense bf16; pass the
rates one GPU measures on the real shapes, e.g. from ``vlm_throughput.py``). A TP split costs ``--tp-overhead``
extra. Pipelines are simulated as megatron's 1F1B (backward = 2x forward); hetero-DP shares each micro-batch's
images over the copies like ``engine/encoder_split.py``; the balanced row places samples with
``loongforge.parallel.balance``. Columns: the slowest rank's ViT and language-model seconds, the step, the idle
share of all 8 GPUs' time (pipeline bubble, waiting for the slowest DP rank, a copy with fewer images) and the DP
imbalance (max / mean of the DP ranks' work). ``runs here = no`` marks a target layout the backend does not run yet.

**Measured rows** (``cpu_*``): ``loongforge train --nproc N`` of the tiny Qwen2.5-VL recipe on CPU (gloo, fp32):
the median step time, each rank's tower time from the job's ``encoder_time_r<rank>`` metrics, the language model's
as the step minus the slowest tower (an estimate: it includes communication), the losses (every layout trains the
same global batches: they agree with ``cpu_one``). The ratios print last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import harness

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "vlm" / "qwen2_5_vl_tiny.yaml"
TINY_GLOBAL_BATCH = 4  # the recipe's train.global_batch_size

# Qwen2.5-VL-7B: the ViT (32 blocks, 4 with full attention, window 112 px = 8x8 patches of 14 px, 2x2 merger)
VIT = dict(depth=32, hidden=1280, mlp=3420, full_blocks=4, patch=14, window=64, merge=2)
LM = dict(layers=28, hidden=3584, ffn=18944, heads=28, kv_heads=4, vocab=152064)

# ---------------------------------------------------------------------------------------------------- the model


def samples(n: int, *, seed: int) -> list[tuple[int, int]]:
    """(image patches, text tokens) of ``n`` samples: lognormal image sides (multiples of 28 px, 224-1792) and
    text lengths (32-4096)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    side = np.clip(np.exp(rng.normal(math.log(448), 0.45, n)), 224, 1792)
    text = np.clip(np.exp(rng.normal(math.log(512), 0.8, n)), 32, 4096).astype(int)
    cells = (np.round(side / 28) * 2).astype(int)  # NOTE: patches per side, even (2x2 merge)
    return [(int(c * c), int(t)) for c, t in zip(cells, text, strict=True)]


def vit_flops(patches: int) -> float:
    """Training FLOPs of one image through the ViT and merger (3x the forward)."""
    h, m = VIT["hidden"], VIT["mlp"]
    linear = 2 * (4 * h * h + 3 * h * m) * patches * VIT["depth"]
    window = VIT["depth"] - VIT["full_blocks"]
    attn = 4 * h * patches * (window * min(patches, VIT["window"]) + VIT["full_blocks"] * patches)
    merged = patches // VIT["merge"] ** 2
    merger = 2 * ((4 * h) ** 2 + 4 * h * LM["hidden"]) * merged
    return 3 * (linear + attn + merger)


def lm_flops(tokens: int) -> float:
    """Training FLOPs of one sequence through the language model (causal attention, output layer)."""
    h, kv = LM["hidden"], LM["hidden"] // LM["heads"] * LM["kv_heads"]
    per_layer = 2 * (2 * h * h + 2 * h * kv + 3 * h * LM["ffn"]) * tokens + 2 * h * tokens * tokens
    return 3 * (LM["layers"] * per_layer + 2 * h * LM["vocab"] * tokens)


def simulate_1f1b(fwd: list[list[float]]) -> tuple[float, list[float]]:
    """megatron's 1F1B over ``fwd[stage][micro-batch]`` forward times (backward 2x): (the step, each stage's busy
    time). Each stage runs its warm-up forwards, then one forward one backward, then the rest of the backwards;
    a forward waits for the previous stage's, a backward for the next stage's."""
    p, m = len(fwd), len(fwd[0])
    ops = []
    for s in range(p):
        warm = min(p - s - 1, m)
        order = [("F", i) for i in range(warm)]
        for i in range(m - warm):
            order += [("F", warm + i), ("B", i)]
        order += [("B", i) for i in range(m - warm, m)]
        ops.append(order)
    done: dict[tuple[str, int, int], float] = {}
    clock, pos = [0.0] * p, [0] * p
    while any(pos[s] < len(ops[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if pos[s] == len(ops[s]):
                continue
            kind, i = ops[s][pos[s]]
            dep = ("F", s - 1, i) if kind == "F" and s > 0 else ("B", s + 1, i) if kind == "B" and s < p - 1 else None
            if dep is not None and dep not in done:
                continue
            start = max(clock[s], done.get(dep, 0.0))
            clock[s] = start + fwd[s][i] * (1 if kind == "F" else 2)
            done[(kind, s, i)] = clock[s]
            pos[s] += 1
            progressed = True
        if not progressed:
            raise RuntimeError("1F1B simulation stalled")
    return max(clock), [3 * sum(f) for f in fwd]


def _rows(placement: list[list[list[int]]], data: list[tuple[int, int]]) -> list[list[list[tuple[int, int]]]]:
    return [[[data[i] for i in mb] for mb in rank] for rank in placement]


def _in_order(n: int, *, dp: int, mbs: int) -> list[list[list[int]]]:
    """megatron's plain placement: micro-batch m of DP rank r is samples m*dp*mbs + r*mbs ... (+ mbs)."""
    return [[[m * dp * mbs + r * mbs + b for b in range(mbs)] for m in range(n // (dp * mbs))] for r in range(dp)]


def _balanced(data: list[tuple[int, int]], *, dp: int, mbs: int, vit_s: float, lm_s: float) -> list[list[list[int]]]:
    from loongforge.parallel.balance import CostModel, balance

    # NOTE: the cost model's own terms: Σl² and Σl of the sequence, the image's patches (rates per GPU)
    h = LM["hidden"]
    per_token = 3 * LM["layers"] * 2 * (2 * h * h + 2 * h * h // LM["heads"] * LM["kv_heads"] + 3 * h * LM["ffn"])
    cost = CostModel(a=3 * LM["layers"] * 2 * h / lm_s, b=per_token / lm_s,
                     v=vit_flops(1024) / 1024 / vit_s)
    feats = [((p // 4 + t) ** 2, p // 4 + t, p) for p, t in data]
    return balance(feats, ranks=dp, microbatches=len(data) // (dp * mbs), micro_batch_size=mbs,
                   cost=cost).microbatches


def model_layout(args: argparse.Namespace) -> dict:
    """One modelled layout on 8 GPUs, ``args.variant_name`` (see the module docstring)."""
    name = args.variant_name
    from loongforge_megatron.engine.encoder_split import share_images

    vit_s, lm_s, o = args.vit_tflops * 1e12, args.lm_tflops * 1e12, args.tp_overhead
    data = samples(args.samples, seed=args.seed)
    vit = lambda p: vit_flops(p) / vit_s  # noqa: E731
    lm = lambda p, t: lm_flops(p // VIT["merge"] ** 2 + t) / lm_s  # noqa: E731
    tp, mbs, gpus = 2, args.mbs, 8
    split = lambda x: x / tp * (1 + o)  # noqa: E731

    def mb_vit_hetero(mb):  # the slowest copy's images of one micro-batch (vision tp 1, 2 copies)
        shares = share_images([vit(p) for p, _ in mb], tp)
        return max(sum(vit(mb[i][0]) for i in share) for share in shares), sum(vit(p) for p, _ in mb) / tp

    runs, busy, vit_max, lm_max, dp_work = True, 0.0, 0.0, 0.0, []
    if name.startswith("model_tp2_dp4") or name.startswith("model_tp2_vtp1_dp4"):
        dp = gpus // tp
        place = _in_order(len(data), dp=dp, mbs=mbs) if not name.endswith("balanced") else \
            _balanced(data, dp=dp, mbs=mbs, vit_s=vit_s, lm_s=lm_s)
        ranks = []
        for rank in _rows(place, data):
            if "vtp1" in name:
                v = [mb_vit_hetero(mb) for mb in rank]
                v_slow, v_mean = sum(x[0] for x in v), sum(x[1] for x in v)
            else:
                v_slow = v_mean = sum(split(vit(p)) for mb in rank for p, _ in mb)
            lm_t = sum(split(lm(p, t)) for mb in rank for p, t in mb)
            ranks.append((v_slow + lm_t, v_mean + lm_t, v_slow, lm_t))
        step = max(r[0] for r in ranks)
        busy = sum(r[1] for r in ranks) * tp
        vit_max, lm_max = max(r[2] for r in ranks), max(r[3] for r in ranks)
        dp_work = [r[1] for r in ranks]
    elif name.startswith("model_tp2_pp2"):
        dp, pp = gpus // (tp * 2), 2
        steps, works = [], []
        for rank in _rows(_in_order(len(data), dp=dp, mbs=mbs), data):
            v_f = [sum(split(vit(p)) for p, _ in mb) / 3 for mb in rank]  # forward share
            l_f = [sum(split(lm(p, t)) for p, t in mb) / 3 / pp for mb in rank]
            if name.endswith("inline"):
                step, stage_busy = simulate_1f1b([[v + lf for v, lf in zip(v_f, l_f, strict=True)], l_f])
                vit_max = max(vit_max, 3 * sum(v_f))
            else:
                pipe, stage_busy = simulate_1f1b([l_f, l_f])
                encode = 3 * sum(v_f)  # NOTE: forward before the schedule + backward after it
                if name.endswith("shared"):  # every rank of the DP rank's 4 encodes a quarter (tp 1 copies)
                    encode = encode * tp / (1 + o) / (tp * pp)
                    runs = False
                step = pipe + encode
                stage_busy = [stage_busy[0] + encode, stage_busy[1] + (encode if name.endswith("shared") else 0)]
                vit_max = max(vit_max, encode)
            steps.append(step)
            works.append(sum(stage_busy))
            lm_max = max(lm_max, 3 * sum(l_f))
        step = max(steps)
        busy = sum(works) * tp
        dp_work = works
    elif name == "model_disjoint_v2_lm6":  # vision on 2 GPUs (2 tp-1 copies), LM on 6 (tp 2, dp 3); steps overlap
        runs, dp = False, 3
        shares = share_images([vit(p) for p, _ in data], 2)
        vit_ranks = [sum(vit(data[i][0]) for i in s) for s in shares]
        lm_ranks = [sum(split(lm(p, t)) for mb in rank for p, t in mb)
                    for rank in _rows(_in_order(len(data), dp=dp, mbs=mbs), data)]
        step = max(max(vit_ranks), max(lm_ranks))
        busy = sum(vit_ranks) + sum(lm_ranks) * tp
        vit_max, lm_max, dp_work = max(vit_ranks), max(lm_ranks), lm_ranks
    else:
        raise ValueError(name)
    return {"losses": [], "times": [step], "items": len(data), "kind": "modelled, 8 GPUs", "runs": runs,
            "vit_s": vit_max, "lm_s": lm_max, "idle": 1 - busy / (gpus * step),
            "dp_imbalance": max(dp_work) / (sum(dp_work) / len(dp_work))}


MODELLED = ["model_tp2_dp4", "model_tp2_vtp1_dp4", "model_tp2_vtp1_dp4_balanced", "model_tp2_pp2_inline",
            "model_tp2_pp2_decoupled", "model_tp2_pp2_decoupled_shared", "model_disjoint_v2_lm6"]

# ---------------------------------------------------------------------------------------------- measured on CPU

MEASURED = {  # name: (processes, overrides)
    "cpu_one": (1, []),
    "cpu_tp2": (2, ["parallel.tp=2", "parallel.components.vision.tp=2"]),
    "cpu_tp2_vtp1": (2, ["parallel.tp=2", "parallel.components.vision.tp=1"]),
    "cpu_pp2_inline": (2, ["parallel.pp=2", "train.micro_batch_size=1"]),
    "cpu_pp2_decoupled": (2, ["parallel.pp=2", "parallel.components.vision.decoupled=true",
                              "train.micro_batch_size=1"]),
    "cpu_dp2": (2, []),
}


def run_measured(args: argparse.Namespace) -> dict:
    """``loongforge train --nproc N`` of the tiny recipe in this layout; its metrics.jsonl's rows."""
    n, over = MEASURED[args.variant_name]
    run = Path(tempfile.mkdtemp(prefix="hetero-vlm-", dir=args.work)) / "run"
    cmd = [sys.executable, "-m", "loongforge", "train", str(RECIPE), "--nproc", str(n), "--output", str(run),
           "accelerator=cpu", f"train.steps={args.steps}", "train.warmup_steps=0", "logging.interval=1",
           "logging.console=false", *over]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"loongforge train --nproc {n} exited {proc.returncode}: {tail[0]}")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line]
    rows = [r for r in rows if r.get("loss") is not None and "step_time" in r]
    enc = [[v for k, v in r.items() if k.startswith("encoder_time_r")] for r in rows]
    after = args.warmup if len(rows) > args.warmup else 0
    vit = max((max(e) if e else 0.0) for e in enc[after:])
    step = statistics.median(r["step_time"] for r in rows[after:])
    imb = [r.get("dp_imbalance_after") for r in rows if r.get("dp_imbalance_after") is not None]
    return {"losses": [r["loss"] for r in rows], "times": [r["step_time"] for r in rows],
            "items": TINY_GLOBAL_BATCH, "kind": f"measured, CPU gloo x{n}", "runs": True,
            "vit_s": vit, "lm_s": max(step - vit, 0.0), "dp_imbalance": imb[-1] if imb else None}


# ---------------------------------------------------------------------------------------------- the benchmark


class HeteroBench(harness.Bench):
    def _cells(self, r: dict) -> list[str]:
        if "error" in r or r.get("losses"):
            return super()._cells(r)
        return [f"{r['rate']:,.1f}", "", "", "modelled", *(fmt(r) for fmt in self.columns.values())]


def _num(key: str, fmt: str) -> callable:
    return lambda r: format(r[key], fmt) if r.get(key) is not None else ""


BENCH = HeteroBench(
    name="hetero_vlm", script=__file__, unit="samples/s",
    variants={**{k: run_measured for k in MEASURED}, **{k: model_layout for k in MODELLED}},
    pairs=[("cpu_tp2_vtp1", "cpu_tp2"), ("cpu_pp2_inline", "cpu_one"), ("cpu_pp2_decoupled", "cpu_pp2_inline"),
           ("cpu_dp2", "cpu_one"),
           ("model_tp2_vtp1_dp4", "model_tp2_dp4"), ("model_tp2_vtp1_dp4_balanced", "model_tp2_vtp1_dp4"),
           ("model_tp2_pp2_decoupled", "model_tp2_pp2_inline"),
           ("model_tp2_pp2_decoupled_shared", "model_tp2_pp2_inline"), ("model_disjoint_v2_lm6", "model_tp2_dp4")],
    columns={"kind": lambda r: r.get("kind", ""), "runs here": lambda r: "yes" if r.get("runs") else "no",
             "ViT s (slowest rank)": _num("vit_s", ".4g"), "LM s (slowest rank)": _num("lm_s", ".4g"),
             "step s": lambda r: f"{r['step_s']:.4g}" if "step_s" in r else "",
             "idle %": lambda r: f"{100 * r['idle']:.1f}" if r.get("idle") is not None else "",
             "DP imbalance": _num("dp_imbalance", ".3f")})


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vit-tflops", type=float, default=0.30 * harness.PEAK_BF16 / 1e12,
                   help="achieved ViT training TFLOP/s per GPU (one GPU's measurement of the real shapes)")
    p.add_argument("--lm-tflops", type=float, default=0.45 * harness.PEAK_BF16 / 1e12,
                   help="achieved language-model training TFLOP/s per GPU")
    p.add_argument("--tp-overhead", type=float, default=0.10, help="extra time of a tp-2 split (communication)")
    p.add_argument("--samples", type=int, default=48, help="samples per global batch (modelled)")
    p.add_argument("--mbs", type=int, default=2, help="micro-batch size (modelled)")
    p.add_argument("--seed", type=int, default=0)
    harness.add_args(p, variants=BENCH.variants, default=",".join([*MEASURED, *MODELLED]))
    args = harness.parse(p, argv, steps=6, warmup=2,
                         smoke={"variants": ",".join(["cpu_one", "cpu_pp2_decoupled", *MODELLED])})
    args.in_process = True  # NOTE: the measured rows launch their own processes; the modelled ones are arithmetic
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    setup = (f"Qwen2.5-VL-7B shape on 8 GPUs (modelled: ViT {args.vit_tflops:.0f} / LM {args.lm_tflops:.0f} "
             f"TFLOP/s per GPU, tp overhead {args.tp_overhead:.0%}, {args.samples} samples, micro-batch "
             f"{args.mbs}); qwen2.5-vl-tiny on CPU gloo, {os.cpu_count()} cores, load average {load} at the start "
             f"(measured)")
    return BENCH.main(args, setup=setup, device="cpu")


if __name__ == "__main__":
    main()
