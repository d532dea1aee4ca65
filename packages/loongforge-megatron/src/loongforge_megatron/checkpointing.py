"""Resumable checkpoints of a megatron job: model, optimizer, scheduler, RNG and data position, per rank.

Layout: ``RUN/checkpoints/step_XXXXXXXX/{meta.json, rank_XXXXX.pt}`` published atomically (staging dir,
completion marker, rename, ``latest`` pointer — ``loongforge.checkpoint.atomic``), so a crash mid-save leaves
the previous checkpoint as ``latest``. Files are read back with ``torch.load(weights_only=True)``: tensors and
plain containers only, no unpickling of code. ``meta.json`` records the layout and every rank's parallel
coordinates.

Resume: the same layout loads each rank's own file (bitwise-exact continuation). A different data-parallel
size (same tp / pp / vpp / cp / ep / etp, no distributed optimizer) is resharded: model and optimizer state are
replicas across data-parallel ranks, so each new rank reads the file of the old rank with its model-parallel
coordinates. Anything else is refused with a message (reshard through an HF export and ``checkpoint.load``).

NOTE: megatron-core's ``dist_checkpointing`` (0.19.2) was tried first: its torch_dist save path assumes CUDA
(``torch.cuda.synchronize`` in the writer's preload, ``rank:N/cuda`` shard placements, CUDA tensors for the
failure broadcast) and spawns a multiprocessing manager per process, so it does not run on CPU / gloo.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from loongforge.checkpoint.atomic import atomic_checkpoint, disk_full, disk_full_error, latest_checkpoint
from loongforge.errors import CheckpointError, ParallelPlanError
from loongforge.parallel.layers import chunk_layer_counts

from loongforge_megatron.engine.model import unwrap

# Layout keys that must match for a data-parallel reshard (everything that changes what a rank holds).
_MODEL_PARALLEL = ("tp", "pp", "vpp", "cp", "ep", "etp")
SPLIT = "layers_per_chunk"  # decoder layers of every (vpp, pp) chunk; saves before uneven splits lack it (even)


def layout_record(plan: Any, *, num_layers: int, whole: tuple[str, ...] = (), sets: Any = None) -> dict[str, Any]:
    """What a checkpoint records of the layout it was saved with (``meta.json``'s ``layout``); ``sets``: an
    encoder on ranks of its own (``engine/encoder_ranks.py``; ``plan`` is then the language model's), recorded as
    ``encoder_ranks``."""
    p = plan
    extra = {} if sets is None else {"encoder_ranks": sets.encoder.world_size}
    return {**extra, "world_size": p.world_size, "tp": p.tp, "pp": p.pp, "vpp": p.vpp, "cp": p.cp, "ep": p.ep, "etp": p.etp,
            "dp": p.dp, "distributed_optimizer": int(p.distributed_optimizer), "whole": [w if isinstance(w, str) else list(w) for w in whole],
            SPLIT: chunk_layer_counts(num_layers, pp=p.pp, vpp=p.vpp, first=p.first_stage_layers,
                                      last=p.last_stage_layers)}


def _split_of(saved: dict[str, Any], num_layers: int) -> list[list[int]] | None:
    """The saved run's layers per chunk (a save without the record used megatron's even split)."""
    if SPLIT in saved:
        return saved[SPLIT]
    try:
        return chunk_layer_counts(num_layers, pp=saved["pp"], vpp=saved["vpp"])
    except ParallelPlanError:
        return None


def _optimizer_shards(optimizer: Any) -> list[dict[str, Any]]:
    """The distributed optimizer's own shards on this rank: each inner torch optimizer's state (Adam moments,
    step) and its fp32 main weights. ``DistributedOptimizer.state_dict()`` leaves them out (megatron expects a
    separate parameter-state save, whose loader cannot take torch AdamW's per-parameter ``step``); the resume
    layout equals the saved one (``source_rank``), so every rank's shards are its own again."""
    from loongforge_megatron.engine.optimizer import inner_optimizers

    return [{"state": opt.state_dict(), "main": [p.detach().clone() for g in opt.param_groups for p in g["params"]]}
            for opt in inner_optimizers(optimizer)]


def _load_optimizer_shards(optimizer: Any, shards: list[dict[str, Any]] | None, path: Path) -> None:
    from loongforge_megatron.engine.optimizer import inner_optimizers

    inners = inner_optimizers(optimizer)
    if shards is None or len(shards) != len(inners):
        raise CheckpointError(f"{path} was saved without the distributed optimizer's fp32 weights and Adam state (an "
                              "older LoongForge), so it cannot resume exactly; use another --output, or "
                              "checkpoint.resume=never with checkpoint.load of an HF export")
    with torch.no_grad():
        for opt, saved in zip(inners, shards, strict=True):
            params = [p for g in opt.param_groups for p in g["params"]]
            for p, value in zip(params, saved["main"], strict=True):
                p.copy_(value)  # NOTE: in bf16 the model's weights are their rounding; these are the real ones
            opt.load_state_dict(saved["state"])


def _coords() -> dict[str, int]:
    """This rank's place in every parallel group (what it holds is a function of all but ``dp``)."""
    from megatron.core import parallel_state as mpu

    return {"tp": mpu.get_tensor_model_parallel_rank(), "pp": mpu.get_pipeline_model_parallel_rank(),
            "cp": mpu.get_context_parallel_rank(), "ep": mpu.get_expert_model_parallel_rank(),
            "etp": mpu.get_expert_tensor_parallel_rank(), "dp": mpu.get_data_parallel_rank()}


def _rng_state(accelerator: Any) -> dict[str, Any]:
    from megatron.core import tensor_parallel

    state = {"torch": torch.get_rng_state(), "accelerator": accelerator.get_rng_state()}
    state["tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(accelerator: Any, state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["torch"])
    accelerator.set_rng_state(state["accelerator"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def source_rank(meta: dict[str, Any], *, layout: dict[str, int], coords: dict[str, int], rank: int) -> int:
    """The rank of the saved run whose file this rank (``coords`` in ``layout``) resumes from.

    Same layout: the rank itself. Different data-parallel size only: the lowest saved rank with the same
    model-parallel coordinates (its model and optimizer state are what every data-parallel replica holds).
    """
    old = dict(meta["layout"])
    old[SPLIT] = _split_of(old, sum(map(sum, layout[SPLIT])))
    # NOTE: saves before per-component layouts split every component by TP
    old.setdefault("whole", [])
    layout = {"whole": [], **layout}
    if old == layout:
        return rank
    differs = [k for k in (*_MODEL_PARALLEL, SPLIT, "whole", "encoder_ranks") if old.get(k) != layout.get(k)]
    if differs:
        raise CheckpointError(
            f"the checkpoint was saved with {', '.join(f'{k}={old.get(k)}' for k in differs)} but this run uses "
            f"{', '.join(f'{k}={layout.get(k)}' for k in differs)}; only the data-parallel size may change on resume "
            "(export to HF and continue with checkpoint.load to change the model-parallel layout)"
        )
    if old["distributed_optimizer"] or layout["distributed_optimizer"]:
        raise CheckpointError(
            f"the checkpoint was saved with dp={old['dp']} and this run uses dp={layout['dp']}: resharding the "
            "distributed optimizer's state across data-parallel ranks is not supported; resume with the same dp "
            "or set parallel.distributed_optimizer=false on both runs"
        )
    key = tuple(coords[k] for k in _MODEL_PARALLEL if k != "vpp")
    for old_rank, c in enumerate(meta.get("ranks", [])):
        if tuple(c[k] for k in _MODEL_PARALLEL if k != "vpp") == key:
            return old_rank
    raise CheckpointError(f"no rank of the checkpoint holds model-parallel coordinates {coords}")


def _prune_exports(root: Path, prefix: str, *, keep_last: int) -> None:
    """Keep the newest ``keep_last`` interval exports ``<prefix><step>`` (``checkpoint.keep_last`` applies to them
    as to the resumable checkpoints); the final export (``OUTPUT/hf``) is never touched."""
    import shutil

    done = sorted(p for p in root.glob(f"{prefix}*") if p.is_dir() and p.name[len(prefix):].isdigit())
    for old in done[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


@dataclass
class Checkpointer:
    """Save / resume of one run's training state (all ranks call every method): the model chunks, optimizer,
    scheduler, RNG, EMA and router counts, under ``root``; ``exports`` writes the HF / PEFT directories a
    ``save_format`` asks for (``{"hf": fn(out_dir), "peft": fn(out_dir)}``) into ``final_dirs`` at the end."""

    root: Path
    chunks: list[torch.nn.Module]
    optimizer: Any
    scheduler: Any
    accelerator: Any
    layout: dict[str, Any]  # :func:`layout_record`
    save_format: tuple[str, ...] = ("dist",)
    save_interval: int = 0
    keep_last: int = 1
    ema: Any = None
    router_load: Any = None
    exports: dict[str, Callable[[Path], Any]] = field(default_factory=dict)
    final_dirs: dict[str, Path] = field(default_factory=dict)
    log: Any = None

    def __post_init__(self) -> None:
        self.rank = dist.get_rank()

    def _state(self, step: int) -> dict[str, Any]:
        load = self.router_load
        return {
            "step": step,
            "model": [unwrap(m).state_dict() for m in self.chunks],
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": _rng_state(self.accelerator),
            **({"ema": self.ema.state_dict()} if self.ema is not None else {}),
            **({"optimizer_shards": _optimizer_shards(self.optimizer)} if self.layout["distributed_optimizer"] else {}),
            **({"router_load": {"tokens_per_expert": load.total.clone(), "first_step": load.first_step}}
               if load is not None else {}),
        }

    def save(self, step: int, *, final: bool = False) -> Path | None:
        """Write the checkpoint of ``step`` (and the HF / PEFT exports the save format asks for); weights that are
        not finite are never written."""
        from loongforge.failures import check_weights_finite

        check_weights_finite((p for m in self.chunks for p in unwrap(m).parameters()), step=step,
                             what="checkpoint or export", checkpoint_dir=self.root)
        path = None
        if "dist" in self.save_format:
            path = self._save_dist(step)
        for kind in ("hf", "peft"):
            if kind in self.save_format and (final or self.save_interval):
                self.exports[kind](self.final_dirs[kind] if final else self.root / f"{kind}_step_{step:08d}")
                if not final and self.rank == 0:
                    _prune_exports(self.root, f"{kind}_step_", keep_last=self.keep_last)
        return path

    def _save_dist(self, step: int) -> Path:
        name = f"step_{step:08d}"
        state = self._state(step)
        ranks: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, _coords())
        ctx = atomic_checkpoint(self.root, name, keep_last=self.keep_last) if self.rank == 0 else nullcontext(None)
        with ctx as staging:
            box = [str(staging) if staging is not None else None]
            dist.broadcast_object_list(box, src=0)
            staging_dir = Path(box[0])
            if self.rank == 0:
                meta = {"step": step, "layout": self.layout, "ranks": ranks}
                (staging_dir / "meta.json").write_text(json.dumps(meta, indent=1))
            try:
                torch.save(state, staging_dir / f"rank_{self.rank:05d}.pt")
            except (OSError, RuntimeError) as exc:
                if disk_full(exc):
                    raise disk_full_error(staging_dir / f"rank_{self.rank:05d}.pt", exc) from None
                raise
            # NOTE: rank 0 publishes (marker + rename + latest) only after every rank's file is written.
            dist.barrier()
        dist.barrier()
        if self.log:
            self.log.info(f"[checkpoint] saved step {step} -> {self.root / name}")
        return self.root / name

    def resume(self) -> int:
        """Load ``checkpoints/latest`` if there is one; return the step to continue from (0 if none). A checkpoint
        with a truncated or unreadable file (on any rank) is skipped, with a warning, for the previous one."""
        from loongforge_megatron.checkpoint_files import UnreadableCheckpointError, read_meta, read_rank_file

        skipped: list[str] = []
        bad: list[Path] = []
        while True:
            box: list = [None]
            if self.rank == 0:
                try:
                    path = latest_checkpoint(self.root, verify=True, exclude=tuple(bad), skipped=skipped) \
                        if self.root.is_dir() else None
                    box = [("ok", str(path)) if path else ("none", skipped)]
                except CheckpointError as exc:
                    box = [("error", str(exc))]
            dist.broadcast_object_list(box, src=0)
            if box[0][0] == "error":
                raise CheckpointError(box[0][1])
            if box[0][0] == "none":
                skipped = box[0][1]  # NOTE: rank 0's list (it also holds what its size checks skipped)
                if skipped:
                    raise CheckpointError(f"no readable checkpoint in {self.root}: " + "; ".join(skipped)
                                          + "; delete the broken ones or use another --output")
                return 0
            path = Path(box[0][1])
            layout = self.layout
            problem, state, meta = None, None, None
            try:
                meta = read_meta(path / "meta.json")
                src = source_rank(meta, layout=layout, coords=_coords(), rank=self.rank)
                state = read_rank_file(path / f"rank_{src:05d}.pt")
            except UnreadableCheckpointError as exc:
                problem = ("unreadable", str(exc))
            except CheckpointError as exc:
                problem = ("mismatch", str(exc))
            problems: list = [None] * dist.get_world_size()
            dist.all_gather_object(problems, problem)
            found = [q for q in problems if q is not None]
            if not found:
                break
            fatal = next((msg for kind, msg in found if kind == "mismatch"), None)
            if fatal is not None:
                raise CheckpointError(fatal)  # NOTE: a layout / model mismatch: an older step would not fit either
            found = found[0][1]
            if self.rank == 0:
                sys.stderr.write(f"[checkpoint] warning: skipping {path.name}: {found}\n")
            skipped.append(f"{path.name}: {found}")
            bad.append(path)

        for module, sd in zip((unwrap(m) for m in self.chunks), state["model"], strict=True):
            try:
                module.load_state_dict(sd)
            except RuntimeError as exc:  # NOTE: shapes or names differ: the recipe changed the model
                lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
                detail = lines[1] if len(lines) > 1 else lines[0] if lines else type(exc).__name__
                raise CheckpointError(f"{path} does not match this recipe's model ({detail[:300]}); use another "
                                      "--output, or checkpoint.resume=never") from None
        self.optimizer.load_state_dict(state["optimizer"])
        if layout["distributed_optimizer"]:
            _load_optimizer_shards(self.optimizer, state.get("optimizer_shards"), path)
        self.scheduler.load_state_dict(state["scheduler"])
        _set_rng_state(self.accelerator, state["rng"])
        if self.ema is not None:
            if "ema" not in state:  # NOTE: EMA switched on for a run saved without it: it starts here
                self.ema.reset()  # the averages were taken of the initial weights, before the load
                if self.log:
                    self.log.info(f"[checkpoint] {path} has no EMA weights: the average starts from step "
                                  f"{state['step']}'s weights")
            else:
                try:
                    self.ema.load_state_dict(state["ema"])
                except ValueError as exc:
                    raise CheckpointError(f"{path}: {exc}; use another --output, or checkpoint.resume=never") from None
        saved_load = state.get("router_load")
        load = self.router_load
        # NOTE: the counts are global sums (all ranks hold the same), so they carry over any resharding; older
        # checkpoints have none, and then moe_imbalance.json covers the steps from the resume on (its first_step).
        if load is not None:
            if saved_load is not None and saved_load["tokens_per_expert"].shape == load.total.shape:
                load.total.copy_(saved_load["tokens_per_expert"])
                load.first_step = int(saved_load["first_step"])
            else:
                load.first_step = int(state["step"]) + 1
        if self.log:
            resharded = "" if meta["layout"] == layout else f" (data-parallel size {meta['layout']['dp']} -> {layout['dp']})"
            self.log.info(f"[checkpoint] resumed from {path}{resharded}")
        return int(state["step"])
