"""VLA training throughput on one GPU: LoongForge's embodied trainer vs LeRobot 0.6.1's own loop (named peer).

Both train a pi05-shaped, randomly initialised policy in bf16 with AdamW + grad clip at the same batch size.
Peer: ``PI05Policy`` stepped the way ``lerobot-train`` does (forward → backward → clip → step) on a synthetic
batch already on the GPU. Ours: the ``embodied`` backend's job on the ``pi05`` preset, data loading included
(DataLoader workers, pinned memory). Prints samples/s, GPU busy % (if pynvml is present) and the ratio last;
appends a JSON line to ``benchmarks/results/vla_throughput_<date>_<gpu>.jsonl``.

    uv run python benchmarks/vla_throughput.py --batch 16 --steps 30     # both
    uv run python benchmarks/vla_throughput.py --only ours --batch 32    # our side alone (memory check)
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


class BusySampler:
    """Samples ``torch.cuda.utilization()`` every 100 ms (None when NVML is unavailable)."""

    def __init__(self):
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            try:
                self.samples.append(torch.cuda.utilization())
            except Exception:
                return
            time.sleep(0.1)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @property
    def busy(self) -> float | None:
        return sum(self.samples) / len(self.samples) if self.samples else None


def bench_peer(*, batch: int, steps: int, warmup: int) -> dict:
    """LeRobot's PI05Policy, random init, bf16, synthetic batch on the GPU."""
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.pi05.configuration_pi05 import PI05Config
    from lerobot.policies.pi05.modeling_pi05 import PI05Policy

    cams = ["observation.images.base_0_rgb", "observation.images.left_wrist_0_rgb"]
    feats = {k: PolicyFeature(type=FeatureType.VISUAL, shape=(3, 224, 224)) for k in cams}
    feats["observation.state"] = PolicyFeature(type=FeatureType.STATE, shape=(32,))
    cfg = PI05Config(device="cuda", dtype="bfloat16", input_features=feats,
                     output_features={"action": PolicyFeature(type=FeatureType.ACTION, shape=(32,))})
    policy = PI05Policy(cfg).cuda().train()
    opt = torch.optim.AdamW(policy.parameters(), lr=2.5e-5, weight_decay=0.01)
    dev = torch.device("cuda")
    b = {k: torch.rand(batch, 3, 224, 224, device=dev) for k in cams}
    b.update({"observation.state": torch.randn(batch, 32, device=dev), "action": torch.randn(batch, 50, 32, device=dev),
              "observation.language.tokens": torch.randint(0, 257152, (batch, 200), device=dev),
              "observation.language.attention_mask": torch.ones(batch, 200, dtype=torch.bool, device=dev)})

    def step():
        loss, _ = policy.forward(b)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _time(step, batch=batch, steps=steps, warmup=warmup,
                 params=sum(p.numel() for p in policy.parameters()))


def bench_ours(*, batch: int, steps: int, warmup: int, compile: bool, workers: int, data_root: str | None) -> dict:
    from loongforge.api import build_job, load_recipe

    over = [f"train.steps={steps + warmup}", f"train.global_batch_size={batch}", f"train.micro_batch_size={batch}",
            "train.precision=bf16", "model.preset=pi05", f"train.compile={str(compile).lower()}",
            f"data.num_workers={workers}", "checkpoint.resume=never", "checkpoint.save_at_end=false",
            "logging.console=false", "logging.tensorboard=false", f"data.synthetic_samples={batch * 64}"]
    if data_root:
        over += ["data.format=lerobot", f"data.root={data_root}"]
    recipe = load_recipe(ROOT / "recipes" / "embodied" / "tiny_vla_synthetic.yaml", over)
    with tempfile.TemporaryDirectory() as tmp:
        job, _ = build_job(recipe, output_dir=tmp)
        try:
            return _time(job.step, batch=batch, steps=steps, warmup=warmup,
                         params=sum(p.numel() for p in job.model.raw.parameters()))
        finally:
            job.close()


def _time(step, *, batch: int, steps: int, warmup: int, params: int) -> dict:
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with BusySampler() as busy:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    return {"samples_per_s": batch * steps / dt, "s_per_step": dt / steps, "gpu_busy_pct": busy.busy,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30, "params_m": params / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--only", choices=["ours", "peer"], default=None)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--data-root", default=None, help="a recorded LeRobotDataset instead of synthetic frames")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("vla_throughput needs a CUDA GPU")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    res: dict = {"batch": args.batch, "gpu": torch.cuda.get_device_name(), "compile": args.compile}
    if args.only != "peer":
        res["ours"] = bench_ours(batch=args.batch, steps=args.steps, warmup=args.warmup, compile=args.compile,
                                 workers=args.workers, data_root=args.data_root)
        print("ours:", json.dumps(res["ours"]), flush=True)
        torch.cuda.empty_cache()
    if args.only != "ours":
        res["lerobot"] = bench_peer(batch=args.batch, steps=args.steps, warmup=args.warmup)
        print("lerobot:", json.dumps(res["lerobot"]), flush=True)
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    gpu = res["gpu"].replace(" ", "-").lower()
    with open(out / f"vla_throughput_{time.strftime('%Y%m%d')}_{gpu}.jsonl", "a") as f:
        f.write(json.dumps(res) + "\n")
    if "ours" in res and "lerobot" in res:
        print(f"ratio ours/lerobot: {res['ours']['samples_per_s'] / res['lerobot']['samples_per_s']:.2f}x")


if __name__ == "__main__":
    main()
