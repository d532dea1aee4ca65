"""megatron-core's optimizer and learning-rate schedule, built from plain keyword arguments.

The scheduler counts *samples* (megatron-LM's convention): steps given here are multiplied by the global
batch size, and :func:`loongforge_megatron.engine.step.train_step` advances it by one global batch per step.
"""

from __future__ import annotations

from typing import Any

import torch

DECAY_STYLES = ("cosine", "linear", "constant", "WSD", "inverse-square-root")


def build_optimizer(
    model_chunks: list[torch.nn.Module],
    *,
    lr: float,
    min_lr: float = 0.0,
    weight_decay: float = 0.01,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    clip_grad: float = 1.0,
    bf16: bool = False,
    fp16: bool = False,
    use_distributed_optimizer: bool = False,
    optimizer: str = "adam",
    **overrides: Any,
):
    """A megatron ``MegatronOptimizer`` (Adam by default) over every parameter of ``model_chunks``.

    ``overrides`` are passed to megatron's ``OptimizerConfig`` unchanged (e.g. ``initial_loss_scale``).
    """
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer=optimizer,
        lr=lr,
        min_lr=min_lr,
        weight_decay=weight_decay,
        adam_beta1=betas[0],
        adam_beta2=betas[1],
        adam_eps=eps,
        clip_grad=clip_grad,
        bf16=bf16,
        fp16=fp16,
        params_dtype=torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32,
        use_distributed_optimizer=use_distributed_optimizer,
        **overrides,
    )
    # NOTE: gloo groups are megatron's default for the distributed optimizer's checkpoint gathers.
    optimizer = get_megatron_optimizer(config, model_chunks)
    use_fused_torch_adam(optimizer)
    return optimizer


def inner_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a megatron (possibly chained) optimizer."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return [o for c in chained for o in inner_optimizers(c)]
    inner = getattr(optimizer, "optimizer", None)
    return [inner] if isinstance(inner, torch.optim.Optimizer) else []


def use_fused_torch_adam(optimizer: Any) -> int:
    """Switch megatron's torch.optim.Adam/AdamW fallback (no TE/Apex) to torch's fused CUDA kernel.

    megatron builds ``torch.optim.AdamW`` with torch's default ``foreach`` implementation, about a dozen passes
    over the fp32 state per step; ``fused=True`` is one. The flag is read per group at each step and the
    ``step`` state is created lazily on the parameter's device, so setting it before the first step is the
    documented constructor behaviour. Returns how many param groups were switched (0 on CPU or with TE/Apex).
    """
    switched = 0
    for opt in inner_optimizers(optimizer):
        if not isinstance(opt, torch.optim.Adam | torch.optim.AdamW) or opt.state:
            continue
        for group in opt.param_groups:
            params = group["params"]
            if params and all(p.is_cuda and p.is_floating_point() for p in params) and not group.get("differentiable"):
                group["fused"], group["foreach"] = True, False
                switched += 1
    return switched


def _megatron_parts(optimizer: Any) -> list[Any]:
    """The megatron optimizers a (possibly chained) one steps."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def folds_clip(optimizer: Any) -> bool:
    """Whether :func:`step_with_folded_clip` can step ``optimizer``: no loss scaling, every torch optimizer inside
    is fused Adam / AdamW (its kernel takes a gradient divisor), one ``clip_grad`` for all, and none of megatron's
    per-step extras that need the clipped gradients themselves (zero counting, a skip threshold, separate
    gradient-norm groups such as multi-token prediction's)."""
    import math

    from megatron.core.optimizer.optimizer import SEPARATE_GRAD_NORM_GROUPS

    inner = inner_optimizers(optimizer)
    if not inner or any(not isinstance(o, torch.optim.Adam | torch.optim.AdamW)
                        or not all(g.get("fused") for g in o.param_groups) for o in inner):
        return False
    parts = _megatron_parts(optimizer)
    if any(getattr(m, "grad_scaler", None) is not None for m in parts):
        return False
    configs = [m.config for m in parts]
    if len({c.clip_grad for c in configs}) != 1 or any(
            c.log_num_zeros_in_grad or math.isfinite(getattr(c, "grad_norm_skip_threshold", math.inf))
            for c in configs):
        return False
    has_group = getattr(optimizer, "has_grad_norm_group", None)
    return not (has_group is not None and any(has_group(g) for g in SEPARATE_GRAD_NORM_GROUPS))


def step_with_folded_clip(optimizer: Any, *, loss_finite: bool) -> tuple[bool, float, bool]:
    """megatron's optimizer step (gradients made ready, their norm, clipping, the update, the model weights
    refreshed) with the clipping folded into the fused Adam kernel, for an ``optimizer`` :func:`folds_clip` accepts.
    Returns (updated, grad norm, finite).

    megatron scales every gradient by ``clip / (norm + 1e-6)`` when that is below 1, a pass that reads and writes
    all fp32 gradients; here the kernel divides each gradient by the inverse as it reads it (torch's ``grad_scale``,
    the amp GradScaler's hook). The step's non-finite check is the norm's (a NaN / inf gradient makes it non-finite;
    agreed across ranks with the loss's), so no other pass over the gradients is made: a non-finite step changes
    nothing and returns (False, norm, False)."""
    import math

    from loongforge.failures import all_ranks_finite

    if optimizer.prepare_grads():  # NOTE: a found inf / NaN: loss scaling only, which folds_clip refuses
        return False, float("nan"), False
    norm = float(optimizer.get_grad_norm())
    if not all_ranks_finite(loss_finite and math.isfinite(norm)):
        return False, norm, False
    clip = _megatron_parts(optimizer)[0].config.clip_grad  # NOTE: one for all (folds_clip)
    divisor = (norm + 1.0e-6) / clip if clip > 0 else 1.0
    inner = inner_optimizers(optimizer)
    if divisor > 1.0:
        for opt in inner:
            device = opt.param_groups[0]["params"][0].device
            opt.grad_scale = torch.tensor(divisor, dtype=torch.float32, device=device)
    try:
        updated = optimizer.step_with_ready_grads()
    finally:
        for opt in inner:
            opt.__dict__.pop("grad_scale", None)
    return updated, norm, True


def build_scheduler(
    optimizer: Any,
    *,
    lr: float,
    min_lr: float = 0.0,
    warmup_steps: int = 0,
    decay_steps: int,
    decay_style: str = "cosine",
    global_batch_size: int,
    init_lr: float = 0.0,
    weight_decay: float = 0.01,
    end_weight_decay: float | None = None,
    weight_decay_style: str = "constant",
    wsd_decay_steps: int | None = None,
    wsd_decay_style: str = "linear",
):
    """megatron's ``OptimizerParamScheduler``: warmup then ``decay_style`` down to ``min_lr``.

    ``warmup_steps``, ``decay_steps`` and ``wsd_decay_steps`` are optimizer steps (converted to samples).
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if decay_style not in DECAY_STYLES:
        raise ValueError(f"decay_style {decay_style!r}; allowed: {', '.join(DECAY_STYLES)}")
    if decay_style == "WSD" and wsd_decay_steps is None:
        raise ValueError("decay_style 'WSD' needs wsd_decay_steps (the length of the final decay)")
    gbs = global_batch_size
    return OptimizerParamScheduler(
        optimizer,
        init_lr=init_lr,
        max_lr=lr,
        min_lr=min_lr,
        lr_warmup_steps=warmup_steps * gbs,
        lr_decay_steps=max(decay_steps, 1) * gbs,
        lr_decay_style=decay_style,
        start_wd=weight_decay,
        end_wd=weight_decay if end_weight_decay is None else end_weight_decay,
        wd_incr_steps=max(decay_steps, 1) * gbs,
        wd_incr_style=weight_decay_style,
        wsd_decay_steps=None if wsd_decay_steps is None else wsd_decay_steps * gbs,
        lr_wsd_decay_style=wsd_decay_style if decay_style == "WSD" else None,
        # NOTE: on resume the recipe's schedule wins and only the progress (samples seen) comes from the
        # checkpoint, so a run extended with more train.steps (or a new lr) follows the recipe, as the embodied
        # backend does. megatron's default keeps the checkpoint's values silently.
        override_opt_param_scheduler=True,
        use_checkpoint_opt_param_scheduler=False,
    )
