"""Where a training step synchronises the host with the GPU: runs the tiny pi05 recipe (eager, then with CUDA
graphs) under CUDA's sync debug mode and prints the Python stack of every synchronising call of an unreported
step.

    python benchmarks/tools/find_syncs.py [--graphs]
"""

from __future__ import annotations

import argparse
import tempfile
import traceback
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    from loongforge.api import build_job, load_recipe

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--graphs", action="store_true", help="train.compile with reduce-overhead (CUDA graphs)")
    ap.add_argument("--recipe", default="recipes/embodied/lerobot_pi05_tiny.yaml")
    args = ap.parse_args()
    over = ["train.steps=8", "train.global_batch_size=4", "train.micro_batch_size=4", "accelerator=cuda",
            "train.precision=bf16", "checkpoint.resume=never", "checkpoint.save_at_end=false",
            "logging.console=false", "logging.tensorboard=false"]
    if args.graphs:
        over += ["train.compile=true", "train.compile_mode=reduce-overhead"]
    seen: dict[str, int] = {}

    def show(message, category, filename, lineno, file=None, line=None):
        # NOTE: only the sync debug mode's own warnings ("called a synchronizing CUDA operation"), not the mode's
        # prototype notice or a ResourceWarning
        if "synchroniz" not in str(message) or "prototype" in str(message):
            return
        stack = "".join(traceback.format_stack()[:-2][-14:])
        key = stack[-600:]
        seen[key] = seen.get(key, 0) + 1
        if seen[key] == 1:
            print(f"--- sync: {message}\n{stack}", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        job, _ = build_job(load_recipe(ROOT / args.recipe, over), output_dir=tmp)
        try:
            for _ in range(4):
                job.step(report=False)
            torch.cuda.synchronize()
            warnings.showwarning = show
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            for _ in range(2):
                job.step(report=False)
            torch.cuda.set_sync_debug_mode("default")
        finally:
            job.close()
    print(f"{sum(seen.values())} synchronising calls in 2 unreported steps ({len(seen)} places)", flush=True)


if __name__ == "__main__":
    main()
