"""Data-parallel scaling of LLM training on one host: LoongForge's megatron backend launched the way a user launches
it (``loongforge train RECIPE --nproc N``) vs the plain PyTorch peer (HF transformers + ``DistributedDataParallel``
under ``torchrun``), at N = 1, 2, 4, 8 processes with the same per-rank micro-batch (weak scaling).

    python benchmarks/scaling.py --preset llama3.2-1b --seq 4096 --gpus 1,2,4,8 --steps 20
    python benchmarks/scaling.py --smoke          # CPU, gloo, llama-tiny, 2 processes, 2 steps: checks the script

Both sides start from the same random-init HF checkpoint and train on the same synthetic tokens: step ``i`` uses the
global batch of samples ``i*G .. i*G+G-1`` (G = N x micro-batch) split over the ranks, so the logged loss (the mean
over the global batch) agrees between ours and the peer at the same N. Rows report global tokens/s, MFU and the
scaling efficiency against the same side's N = 1 row (rate_N / (N * rate_1)) when it ran; the ours / peer ratio at
each N prints last. Rows go to ``benchmarks/results/scaling.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import harness

SIDES = ("loongforge", "torch_ddp")


def _n(args) -> int:
    return int(args.variant_name.rsplit("_dp", 1)[1])


def _hf(args) -> Path:
    return Path(args.work) / "hf"


def make_hf(args, out: Path) -> None:
    import torch
    import transformers as tf
    from loongforge_megatron.models.registry import hf_config, presets

    spec, fields = presets()[args.preset]
    cfg = hf_config(spec.arch(fields), torch_dtype="bfloat16")
    config = tf.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k not in ("architectures",)})
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model.save_pretrained(out)


def _items(args, res: dict) -> dict:
    from loongforge_megatron.models.hf_arch import arch_from_hf

    res["items"] = _n(args) * args.mbs * args.seq
    res["flops_per_item"] = arch_from_hf(_hf(args)).flops_per_token(args.seq)
    res["procs"] = _n(args)
    return res


def _env() -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    env.setdefault("NCCL_NVLS_ENABLE", "0")  # NOTE: NVLink multicast off (the lent machines do not allow it)
    return env


def run_ours(args) -> dict:
    """``loongforge train --nproc N`` of a recipe; the losses and step times come from the run's metrics.jsonl."""
    import yaml

    n = _n(args)
    recipe = {
        "backend": "megatron",
        "model": {"hf": str(_hf(args))},
        "data": {"format": "synthetic", "seq_length": args.seq},
        "train": {"stage": "cpt", "steps": args.steps, "global_batch_size": n * args.mbs,
                  "micro_batch_size": args.mbs, "lr": 1e-4, "lr_schedule": "constant", "weight_decay": 0.0,
                  "grad_clip": 1.0, "precision": "bf16" if args.device == "cuda" else "fp32", "seed": 1},
        "checkpoint": {"load": str(_hf(args)), "save_at_end": False},
        "accelerator": args.device,
        "logging": {"tensorboard": False, "interval": 1},
    }
    tmp = Path(tempfile.mkdtemp(prefix="scaling-ours-"))
    (tmp / "r.yaml").write_text(yaml.safe_dump(recipe))
    cmd = [sys.executable, "-m", "loongforge", "train", str(tmp / "r.yaml"), "--nproc", str(n), "--output",
           str(tmp / "run")]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"loongforge train --nproc {n} exited {proc.returncode}: {tail[0]}")
    records = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines() if line]
    records = [r for r in records if "step_time" in r and r.get("loss") is not None]
    return _items(args, {"losses": [r["loss"] for r in records], "times": [r["step_time"] for r in records]})


def run_peer(args) -> dict:
    """torchrun of this script's DDP worker: HF model + DistributedDataParallel, rank 0 writes the result."""
    n = _n(args)
    js = Path(tempfile.mkdtemp(prefix="scaling-ddp-")) / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n), __file__,
           "--ddp-worker", "--work", args.work, "--json", str(js), "--seq", str(args.seq), "--mbs", str(args.mbs),
           "--steps", str(args.steps), "--device", args.device]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True)
    if proc.returncode != 0 or not js.is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"torchrun --nproc_per_node {n} exited {proc.returncode}: {tail[0]}")
    return _items(args, json.loads(js.read_text()))


def ddp_worker(args) -> None:
    """One rank of the peer: the global batch of step i is samples i*G .. i*G+G-1, this rank's share contiguous."""
    import time

    import torch
    import torch.distributed as dist
    import transformers as tf
    from loongforge_megatron.data.datasets import SyntheticDataset

    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    model = tf.AutoModelForCausalLM.from_pretrained(_hf(args), torch_dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    model = model.to(device)
    vocab = model.config.vocab_size
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, fused=cuda)
    data = SyntheticDataset(vocab_size=vocab, seq_length=args.seq, seed=1)
    losses, times = [], []
    for i in range(args.steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        first = i * world * args.mbs + rank * args.mbs
        samples = [data[first + j] for j in range(args.mbs)]
        tokens = torch.stack([s["tokens"] for s in samples]).to(device)
        labels = torch.stack([s["labels"] for s in samples]).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            logits = ddp(input_ids=tokens).logits
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, vocab), labels.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(mean.item() / world)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    if rank == 0:
        Path(args.json).write_text(json.dumps({"losses": losses, "times": times, "peak_gib": peak}))
    dist.destroy_process_group()


def _variants(counts: list[int]) -> dict:
    return {f"{side}_dp{n}": (run_ours if side == "loongforge" else run_peer) for n in counts for side in SIDES}


ALL_COUNTS = [1, 2, 4, 8]
VARIANTS = _variants(ALL_COUNTS)


def _add_efficiency(rows: dict[str, dict]) -> list[str]:
    """Scaling efficiency of each row against its side's one-process row (filled in the rows; a note if absent)."""
    missing = []
    for side in SIDES:
        one = rows.get(f"{side}_dp1", {})
        for name, r in rows.items():
            if name.startswith(side + "_dp") and "rate" in r:
                if "rate" in one:
                    r["efficiency"] = r["rate"] / (r["procs"] * one["rate"])
                elif side not in missing:
                    missing.append(side)
    return [f"No {side}_dp1 row: its efficiency is not shown." for side in missing]


class ScalingBench(harness.Bench):
    def report(self, rows: dict[str, dict], **kw) -> str:
        self.missing = _add_efficiency(rows)  # NOTE: before the table, whose column reads it
        return super().report(rows, **kw)


BENCH = ScalingBench(
    name="scaling", script=__file__, variants=VARIANTS, unit="tokens/s",
    pairs=[(f"loongforge_dp{n}", f"torch_ddp_dp{n}") for n in ALL_COUNTS],
    columns={"processes": lambda r: str(r.get("procs", "")),
             "efficiency vs 1 process": lambda r: f"{100 * r['efficiency']:.0f}%" if "efficiency" in r else ""},
    notes=lambda rows: _add_efficiency(rows))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama3.2-1b")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--mbs", type=int, default=2, help="micro-batch per rank (weak scaling: the same at every N)")
    p.add_argument("--gpus", default=None, help="comma-separated process counts (default: 1, 2, 4, 8 up to the "
                   "GPUs present); picks the variants unless --variants is given")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--ddp-worker", action="store_true", help=argparse.SUPPRESS)
    harness.add_args(p, variants=VARIANTS, default="")
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--ddp-worker" in argv:
        args, _ = p.parse_known_args(argv)
        return ddp_worker(args) or {}
    args = harness.parse(p, argv, steps=20, warmup=5, smoke={
        "preset": "llama-tiny", "seq": 32, "device": "cpu", "gpus": "2", "mbs": 1})
    if not args.variants:
        if args.gpus:
            counts = [int(n) for n in args.gpus.split(",")]
        else:
            import torch

            have = torch.cuda.device_count() if args.device == "cuda" else 1
            counts = [n for n in ALL_COUNTS if n <= max(have, 1)]
        args.variants = ",".join(f"{side}_dp{n}" for n in counts for side in SIDES)
    setup = f"{args.preset}, seq {args.seq}, micro-batch {args.mbs} per rank, " \
            f"{'bf16' if args.device == 'cuda' else 'fp32 (gloo)'}"
    return BENCH.main(args, setup=setup, device=args.device, prepare=lambda a, work: make_hf(a, work / "hf"))


if __name__ == "__main__":
    main()
