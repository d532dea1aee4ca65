"""Resumable checkpoints of a megatron job: model, optimizer, scheduler, RNG and data position, per rank.

Layout: ``RUN/checkpoints/step_XXXXXXXX/{meta.json, rank_XXXXX.pt}`` published atomically (staging dir,
completion marker, rename, ``latest`` pointer — ``loongforge.checkpoint.atomic``), so a crash mid-save leaves
the previous checkpoint as ``latest``. Files are read back with ``torch.load(weights_only=True)``: tensors and
plain containers only, no unpickling of code.

NOTE: per-rank files resume exactly on the same layout; a different layout is refused with a clear message
(reshard through ``loongforge convert`` or an HF export instead).
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from loongforge.checkpoint.atomic import atomic_checkpoint, latest_checkpoint, require_complete
from loongforge.errors import CheckpointError

if TYPE_CHECKING:
    from loongforge_megatron.job import MegatronJob


def _layout(job: MegatronJob) -> dict[str, int]:
    p = job.plan
    return {"world_size": p.world_size, "tp": p.tp, "pp": p.pp, "vpp": p.vpp, "cp": p.cp, "ep": p.ep, "etp": p.etp,
            "dp": p.dp, "distributed_optimizer": int(p.distributed_optimizer)}


def _rng_state(job: MegatronJob) -> dict[str, Any]:
    from megatron.core import tensor_parallel

    state = {"torch": torch.get_rng_state(), "accelerator": job.acc.get_rng_state()}
    state["tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(job: MegatronJob, state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["torch"])
    job.acc.set_rng_state(state["accelerator"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


class Checkpointer:
    """Save / resume for one :class:`MegatronJob` (all ranks call every method)."""

    def __init__(self, job: MegatronJob):
        self.job = job
        self.root = job.runtime.checkpoint_dir
        self.rank = dist.get_rank()

    def _state(self) -> dict[str, Any]:
        from loongforge_megatron.job import unwrapped

        job = self.job
        return {
            "step": job.step_index,
            "model": [m.state_dict() for m in unwrapped(job)],
            "optimizer": job.optimizer.state_dict(),
            "scheduler": job.scheduler.state_dict(),
            "rng": _rng_state(job),
        }

    def save(self, step: int, *, final: bool = False) -> Path | None:
        """Write the checkpoint of ``step`` (and the HF export when the recipe asks for one)."""
        job, c = self.job, self.job.recipe.checkpoint
        path = None
        if "dist" in c.save_format:
            path = self._save_dist(step)
        if "hf" in c.save_format and (final or c.save_interval):
            from loongforge_megatron.hf_io import export_hf

            export_hf(job, job.runtime.hf_dir if final else self.root / f"hf_step_{step:08d}")
        return path

    def _save_dist(self, step: int) -> Path:
        name = f"step_{step:08d}"
        state = self._state()
        ctx = atomic_checkpoint(self.root, name, keep_last=self.job.recipe.checkpoint.keep_last) if self.rank == 0 else nullcontext(None)
        with ctx as staging:
            box = [str(staging) if staging is not None else None]
            dist.broadcast_object_list(box, src=0)
            staging_dir = Path(box[0])
            if self.rank == 0:
                (staging_dir / "meta.json").write_text(json.dumps({"step": step, "layout": _layout(self.job)}, indent=1))
            torch.save(state, staging_dir / f"rank_{self.rank:05d}.pt")
            dist.barrier()
        dist.barrier()
        if self.job.log:
            self.job.log.info(f"[checkpoint] saved step {step} -> {self.root / name}")
        return self.root / name

    def resume(self) -> int:
        """Load ``checkpoints/latest`` if there is one; return the step to continue from (0 if none)."""
        path = latest_checkpoint(self.root) if self.root.is_dir() else None
        box = [str(path) if path else None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            return 0
        path = require_complete(box[0])
        meta = json.loads((path / "meta.json").read_text())
        if meta["layout"] != _layout(self.job):
            raise CheckpointError(
                f"{path} was saved with layout {meta['layout']} but this run uses {_layout(self.job)}; "
                "resume with the same parallel layout (or export to HF and continue with checkpoint.load)"
            )
        state = torch.load(path / f"rank_{self.rank:05d}.pt", map_location="cpu", weights_only=True)
        from loongforge_megatron.job import unwrapped

        for module, sd in zip(unwrapped(self.job), state["model"], strict=True):
            module.load_state_dict(sd)
        self.job.optimizer.load_state_dict(state["optimizer"])
        self.job.scheduler.load_state_dict(state["scheduler"])
        _set_rng_state(self.job, state["rng"])
        return int(state["step"])
