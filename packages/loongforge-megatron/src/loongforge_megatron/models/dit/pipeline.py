"""A DiT export is also a diffusers ``DiTPipeline`` folder, so ``DiTPipeline.from_pretrained(export)`` loads it.

The export's top level stays the ``DiTTransformer2DModel`` folder (``config.json`` + weights: what ``model.hf`` /
``checkpoint.load`` and ``DiTTransformer2DModel.from_pretrained`` read). Beside it:

- ``model_index.json``: the pipeline's components (and ``id2label`` when the run had class names);
- ``transformer/``: relative links to the top-level config and weights (one copy on disk);
- ``scheduler/``: the DDPM schedule the model was trained with;
- ``vae/``: a copy of ``model.vae``'s config and weights when the run had one; otherwise the index names no VAE and
  the user passes one: ``DiTPipeline.from_pretrained(export, vae=AutoencoderKL.from_pretrained(...))`` (diffusers
  refuses a pipeline whose index leaves a component out unless the call names it).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

PIPELINE_CLASS = "DiTPipeline"
WEIGHTS = "diffusion_pytorch_model"


def write_pipeline(staging: Path, *, vae: str | None, id2label: dict[str, str] | None) -> None:
    """Add the pipeline files to an export's staging folder, whose top level holds (or will hold, for
    ``config.json``) the transformer."""
    import diffusers

    from loongforge_megatron.models.dit.arch import DIFFUSERS_CLASS
    from loongforge_megatron.models.dit.model import noise_scheduler

    scheduler = noise_scheduler()
    scheduler.save_pretrained(staging / "scheduler")
    transformer = staging / "transformer"
    transformer.mkdir()
    # NOTE: config.json is written after the assets hook: its link dangles until then (staging is committed whole)
    for name in ["config.json", *sorted(p.name for p in staging.glob(f"{WEIGHTS}*.safetensors*"))]:
        os.symlink(Path("..") / name, transformer / name)
    index = {
        "_class_name": PIPELINE_CLASS,
        "_diffusers_version": diffusers.__version__,
        "transformer": ["diffusers", DIFFUSERS_CLASS],
        "scheduler": ["diffusers", type(scheduler).__name__],
        "vae": [None, None],
    }
    if vae:
        _copy_vae(Path(vae), staging / "vae")
        index["vae"] = ["diffusers", "AutoencoderKL"]
    if id2label:
        index["id2label"] = id2label
    (staging / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")


def _copy_vae(src: Path, dst: Path) -> None:
    """The VAE folder's config and weights (hard links where the file system allows: the same bytes either way)."""
    dst.mkdir()
    for f in sorted(src.iterdir()):
        if f.is_file() and (f.name == "config.json" or f.name.startswith(WEIGHTS)):
            try:
                os.link(f, dst / f.name)
            except OSError:
                shutil.copy2(f, dst / f.name)
