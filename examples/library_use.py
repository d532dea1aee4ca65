"""Drive LoongForge from Python: load a recipe, override it, build the job, step it, read the run directory.

    uv run python examples/library_use.py
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import loongforge

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "llm" / "tiny" / "llama_tiny.yaml"


def main(output_dir: str | Path | None = None, steps: int = 3) -> list[float]:
    out = Path(output_dir or tempfile.mkdtemp()) / "run"
    recipe = loongforge.load_recipe(RECIPE, [f"train.steps={steps}", "accelerator=cpu"])
    print(f"backend={recipe.backend} model={recipe.model.preset} global batch={recipe.train.global_batch_size}")
    job, runtime = loongforge.build_job(recipe, output_dir=out)  # one process: the whole job lives here
    try:
        losses = [job.step()["loss"] for _ in range(steps)]
    finally:
        job.close()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    print(f"plan: tp={runtime.plan.tp} dp={runtime.plan.dp}; losses {losses}; {len(records)} records in {out}")
    return losses


if __name__ == "__main__":
    import sys

    main(sys.argv[1] if len(sys.argv) > 1 else None)
