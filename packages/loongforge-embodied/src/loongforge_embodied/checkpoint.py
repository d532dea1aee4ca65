"""Resume checkpoints (torch.distributed.checkpoint in atomic directories) and the policy export.

State is keyed by parameter name: ``model`` (plain or DTensor shards), ``optim.<name>.<slot>`` (each ZeRO-1
rank writes only what it owns), ``ema`` and per-rank RNG. DCP writes every rank's shards in parallel into the
staging directory of rank 0's ``atomic_checkpoint``, which is published only after every rank finished.
"""

from __future__ import annotations

import errno
import json
import pickle
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from loongforge.checkpoint.atomic import atomic_checkpoint, latest_checkpoint
from loongforge.errors import CheckpointError, NonFiniteError
from torch.distributed.checkpoint.api import CheckpointException

from loongforge_embodied import safe_dcp

if TYPE_CHECKING:
    from loongforge_embodied.job import EmbodiedJob

META = "trainer.json"


def _optim_state(job: EmbodiedJob, *, allocate: bool) -> dict[str, torch.Tensor]:
    """Optimizer slots by parameter name; ``allocate`` creates zero slots first (DCP loads in place)."""
    names = {p: n for n, p in job.model.raw.named_parameters()}
    out = {}
    for group in job.optimizer.param_groups:
        for p in group["params"]:
            st = job.optimizer.state[p]
            if allocate and not st and job.recipe.train.optimizer == "adamw":
                fused = bool(group.get("fused"))
                st["step"] = torch.zeros((), dtype=torch.float32, device=p.device if fused else "cpu")
                st["exp_avg"] = torch.zeros_like(p)
                st["exp_avg_sq"] = torch.zeros_like(p)
            elif allocate and not st and group.get("momentum", 0):  # NOTE: SGD without momentum keeps no state
                st["momentum_buffer"] = torch.zeros_like(p)
            for slot, value in st.items():
                if torch.is_tensor(value):
                    out[f"{names[p]}.{slot}"] = value
    return out


def _state(job: EmbodiedJob, *, allocate: bool) -> dict[str, Any]:
    rank = dist.get_rank()
    state: dict[str, Any] = {"model": job.model.raw.state_dict(), "optim": _optim_state(job, allocate=allocate),
                             f"rng_rank{rank}": torch.get_rng_state()}
    if job.ema is not None:
        state["ema"] = job.ema
    return state


def save(job: EmbodiedJob, step: int) -> Path:
    """Save the resume state of optimizer step ``step`` into ``checkpoints/step_<step>`` (collective)."""
    rt = job.runtime
    name = f"step_{step:08d}"
    check_finite_weights(job, step=step, what="checkpoint")
    meta = {"step": step, "world_size": rt.world_size, "strategy": job.model.strategy, "model": _model_id(job)}
    try:
        if rt.is_main:
            with atomic_checkpoint(rt.checkpoint_dir, name, keep_last=job.recipe.checkpoint.keep_last) as staging:
                dist.broadcast_object_list([str(staging)], src=0)
                dcp.save(_state(job, allocate=False), checkpoint_id=staging)
                (staging / META).write_text(json.dumps(meta))
                from loongforge.recipe import dump_recipe

                (staging / "recipe.yaml").write_text(dump_recipe(job.recipe))
        else:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            dcp.save(_state(job, allocate=False), checkpoint_id=box[0])
    except (CheckpointException, OSError) as exc:  # NOTE: CheckpointException is a BaseException
        raise _save_error(exc, rt.checkpoint_dir / name) from None
    # NOTE: nobody runs ahead (or dies on purpose) before the checkpoint is published.
    dist.barrier()
    return rt.checkpoint_dir / name


def resume(job: EmbodiedJob) -> int:
    """Load the latest complete checkpoint if any; returns the optimizer steps already done (0 if none)."""
    path = latest_checkpoint(job.runtime.checkpoint_dir)
    if path is None:
        return 0
    meta = read_trainer_meta(path)
    saved, mine = meta.get("model"), _model_id(job)
    if saved is not None and saved != mine:
        raise CheckpointError(f"{path} holds a '{saved['policy']}' policy, this recipe builds '{mine['policy']}': "
                              "use another --output, or checkpoint.resume=never")
    state = _state(job, allocate=True)
    same_world = meta["world_size"] == job.runtime.world_size
    if not same_world:
        # NOTE: a different world size reshards model/optimizer (DCP does); RNG streams are per rank, so reseed.
        state = {k: v for k, v in state.items() if not k.startswith("rng_rank")}
    try:
        safe_dcp.load(state, path)
        job.model.raw.load_state_dict(state["model"])
    except (CheckpointException, RuntimeError) as exc:  # NOTE: CheckpointException is a BaseException
        if isinstance(exc, torch.OutOfMemoryError | getattr(dist, "DistBackendError", torch.OutOfMemoryError)):
            raise  # NOTE: not a mismatch: resume=never would throw progress away
        first = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        inner = [f[0] if isinstance(f, tuple) else f for f in getattr(exc, "failures", {}).values()]
        unreadable = next((e for e in inner if isinstance(e, pickle.UnpicklingError | EOFError | UnicodeDecodeError)), None)
        if unreadable is not None:  # NOTE: a data file's bytes are garbled (its size was checked before)
            raise CheckpointError(f"{path}: a .distcp data file is corrupt ({type(unreadable).__name__}: "
                                  f"{str(unreadable)[:200]}); resume from another checkpoint or another --output") from None
        raise CheckpointError(f"{path} does not match this recipe's model ({first[:300]}); use another --output, "
                              "or checkpoint.resume=never") from None
    if same_world:
        torch.set_rng_state(state[f"rng_rank{dist.get_rank()}"])
    return int(meta["step"])


def read_trainer_meta(path: Path) -> dict[str, Any]:
    """``trainer.json`` of checkpoint ``path``; garbled or incomplete is a one-line ``CheckpointError`` naming it."""
    file = path / META
    try:
        meta = json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{file} is missing: the checkpoint is incomplete") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{file} is not valid JSON ({exc}); the checkpoint is corrupt") from None
    bad = [k for k, kind in (("step", int), ("world_size", int)) if not isinstance(meta, dict)
           or not isinstance(meta.get(k), kind) or isinstance(meta.get(k), bool) or meta[k] < (0 if k == "step" else 1)]
    if bad:
        raise CheckpointError(f"{file}: '{bad[0]}' is missing or not a valid count; the checkpoint is corrupt")
    if meta.get("model") is not None and not (isinstance(meta["model"], dict) and "policy" in meta["model"]):
        raise CheckpointError(f"{file}: 'model' is not a policy record; the checkpoint is corrupt")
    return meta


def _save_error(exc: BaseException, path: Path) -> BaseException:
    """A one-line error for a failed save: out of disk space says so; our own errors come out as themselves."""
    cause = safe_dcp.user_error(exc)
    if cause is not None:
        return cause
    inner = [exc] if isinstance(exc, OSError) else [f[0] if isinstance(f, tuple) else f
                                                    for f in getattr(exc, "failures", {}).values()]
    for e in inner:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return CheckpointError(f"out of disk space writing checkpoint {path} ({e.strerror}); the previous "
                                   "checkpoints are intact: free space and rerun to resume")
    for e in inner:
        if isinstance(e, OSError):
            return CheckpointError(f"cannot write checkpoint {path} ({e.strerror or e}); the previous checkpoints are "
                                   "intact")
    return exc


def check_finite_weights(job: EmbodiedJob, *, step: int, what: str) -> None:
    """Refuse to save or export weights with a NaN / inf value (agreed across ranks: a collective)."""
    from loongforge_embodied.parallel import all_reduce_sum

    params = [p.detach() for p in job.model.raw.parameters()]
    if job.ema is not None:
        params += list(job.ema.values())
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    bad = torch.zeros((), device=job.device)
    for p in local:
        if p.numel() and p.is_floating_point():
            bad += (~torch.isfinite(p)).sum()
    if float(all_reduce_sum(bad)) > 0:
        raise NonFiniteError(f"the weights after step {step} hold NaN / inf values: the {what} is not written (the "
                             "last finite checkpoint stays the latest); lower train.lr or raise train.grad_clip")


def _model_id(job: EmbodiedJob) -> dict[str, Any]:
    """What must match for a resume (shapes are checked by the load itself)."""
    return {"policy": job.recipe.model.policy}


def full_state_dict(job: EmbodiedJob, *, use_ema: bool) -> dict[str, torch.Tensor]:
    """Unsharded CPU copy of the weights (collective under fsdp2/hsdp: every rank must call it)."""
    src = job.model.raw.state_dict()
    if use_ema and job.ema is not None:
        src = {**src, **{k: v.to(src[k].dtype) for k, v in job.ema.items()}}  # NOTE: fp32 averages, weights' dtype
    out = {}
    for key, value in src.items():
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        out[key] = value.detach().to("cpu", copy=True).contiguous()
    return out


def export(job: EmbodiedJob, out_dir: Path) -> Path | None:
    """Write ``out_dir`` as a LeRobot policy directory (config.json + model.safetensors); collective."""
    check_finite_weights(job, step=job.step_index, what="policy export")
    weights = full_state_dict(job, use_ema=True)
    if job.runtime.is_main:
        from loongforge_embodied.policies import get_policy

        get_policy(job.recipe.model.policy).export.write_pretrained(out_dir, arch=job.arch, weights=weights,
                                                                    features=job.features)
    dist.barrier()
    return out_dir
