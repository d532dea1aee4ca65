"""Resume checkpoints (torch.distributed.checkpoint in atomic directories) and the policy export.

State is keyed by parameter name: ``model`` (plain or DTensor shards), ``optim.<name>.<slot>`` (each ZeRO-1
rank writes only what it owns), ``ema`` and per-rank RNG. DCP writes every rank's shards in parallel into the
staging directory of rank 0's ``atomic_checkpoint``, which is published only after every rank finished.
Every function takes the values it reads (the unwrapped model, optimizer, EMA, recipe, paths), never the job.
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
from loongforge.errors import CheckpointError
from loongforge.failures import check_weights_finite
from torch.distributed.checkpoint.api import CheckpointException

from loongforge_embodied import safe_dcp

if TYPE_CHECKING:
    from loongforge.recipe.schema import Recipe

META = "trainer.json"


def _optim_state(model: torch.nn.Module, optimizer: Any, *, adamw: bool, allocate: bool) -> dict[str, torch.Tensor]:
    """Optimizer slots by parameter name; ``allocate`` creates zero slots first (DCP loads in place)."""
    names = {p: n for n, p in model.named_parameters()}
    out = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state[p]
            if allocate and not st and adamw:
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


def _state(model: torch.nn.Module, optimizer: Any, ema: dict[str, torch.Tensor] | None, *, recipe: Recipe,
           allocate: bool) -> dict[str, Any]:
    rank = dist.get_rank()
    optim = _optim_state(model, optimizer, adamw=recipe.train.optimizer == "adamw", allocate=allocate)
    state: dict[str, Any] = {"model": model.state_dict(), "optim": optim, f"rng_rank{rank}": torch.get_rng_state()}
    if ema is not None:
        state["ema"] = ema
    return state


def save(*, model: torch.nn.Module, optimizer: Any, ema: dict[str, torch.Tensor] | None, recipe: Recipe, step: int,
         checkpoint_dir: Path, strategy: str) -> Path:
    """Save the resume state of optimizer step ``step`` (``model``: the unwrapped model, plain or DTensor shards;
    ``strategy``: its data-parallel strategy, recorded) into ``checkpoint_dir/step_<step>`` (collective)."""
    name = f"step_{step:08d}"
    check_weights_finite([*model.parameters(), *(ema or {}).values()], step=step, what="checkpoint",
                         checkpoint_dir=checkpoint_dir)
    meta = {"step": step, "world_size": dist.get_world_size(), "strategy": strategy, "model": _model_id(recipe)}
    try:
        if dist.get_rank() == 0:
            with atomic_checkpoint(checkpoint_dir, name, keep_last=recipe.checkpoint.keep_last) as staging:
                dist.broadcast_object_list([str(staging)], src=0)
                dcp.save(_state(model, optimizer, ema, recipe=recipe, allocate=False), checkpoint_id=staging)
                (staging / META).write_text(json.dumps(meta))
                from loongforge.recipe import dump_recipe

                (staging / "recipe.yaml").write_text(dump_recipe(recipe))
        else:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            dcp.save(_state(model, optimizer, ema, recipe=recipe, allocate=False), checkpoint_id=box[0])
    except (CheckpointException, OSError) as exc:  # NOTE: CheckpointException is a BaseException
        raise _save_error(exc, checkpoint_dir / name) from None
    # NOTE: nobody runs ahead (or dies on purpose) before the checkpoint is published.
    dist.barrier()
    return checkpoint_dir / name


def resume(*, model: torch.nn.Module, optimizer: Any, ema: dict[str, torch.Tensor] | None, recipe: Recipe,
           checkpoint_dir: Path) -> int:
    """Load the latest complete checkpoint of ``checkpoint_dir`` if any into ``model`` (unwrapped), ``optimizer``
    and ``ema`` (in place); returns the optimizer steps already done (0 if none)."""
    path = latest_checkpoint(checkpoint_dir)
    if path is None:
        return 0
    meta = read_trainer_meta(path)
    saved, mine = meta.get("model"), _model_id(recipe)
    if saved is not None and saved != mine:
        raise CheckpointError(f"{path} holds a '{saved['policy']}' policy, this recipe builds '{mine['policy']}': "
                              "use another --output, or checkpoint.resume=never")
    state = _state(model, optimizer, ema, recipe=recipe, allocate=True)
    same_world = meta["world_size"] == dist.get_world_size()
    if not same_world:
        # NOTE: a different world size reshards model/optimizer (DCP does); RNG streams are per rank, so reseed.
        state = {k: v for k, v in state.items() if not k.startswith("rng_rank")}
    try:
        safe_dcp.load(state, path)
        model.load_state_dict(state["model"])
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


def _model_id(recipe: Recipe) -> dict[str, Any]:
    """What must match for a resume (shapes are checked by the load itself)."""
    return {"policy": recipe.model.policy}


def full_state_dict(model: torch.nn.Module, *, ema: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Unsharded CPU copy of ``model``'s weights, the ``ema`` averages in place of those it holds (collective under
    fsdp2/hsdp: every rank must call it)."""
    src = model.state_dict()
    if ema is not None:
        src = {**src, **{k: v.to(src[k].dtype) for k, v in ema.items()}}  # NOTE: fp32 averages, weights' dtype
    out = {}
    for key, value in src.items():
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        out[key] = value.detach().to("cpu", copy=True).contiguous()
    return out


def export(*, model: torch.nn.Module, ema: dict[str, torch.Tensor] | None, policy: str, arch: Any,
           features: dict[str, Any], step: int, out_dir: Path, checkpoint_dir: Path | None = None) -> Path:
    """Write ``out_dir`` as a LeRobot policy directory (config.json + model.safetensors) of ``model`` after step
    ``step``, with the ``ema`` averages where kept; collective."""
    check_weights_finite([*model.parameters(), *(ema or {}).values()], step=step, what="policy export",
                         checkpoint_dir=checkpoint_dir)
    weights = full_state_dict(model, ema=ema)
    if dist.get_rank() == 0:
        from loongforge_embodied.policies import get_policy

        get_policy(policy).export.write_pretrained(out_dir, arch=arch, weights=weights, features=features)
    dist.barrier()
    return out_dir
