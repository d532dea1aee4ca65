"""Optimizer (AdamW / SGD, optionally ZeRO-1 sharded over data-parallel ranks) and the LR schedule."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from loongforge.recipe.schema import TrainConfig
from torch import nn
from torch.distributed.tensor import DTensor


def lr_at(step: int, t: TrainConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warmup, then constant/linear/cosine/wsd."""
    if t.warmup_steps and step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    if t.lr_schedule == "constant":
        return t.lr
    total = t.decay_steps or t.steps
    if t.lr_schedule == "wsd":
        decay = t.wsd_decay_steps or max(1, total // 10)
        start = total - decay
        frac = 0.0 if step < start else min(1.0, (step - start) / decay)
    else:
        frac = min(1.0, (step - t.warmup_steps) / max(1, total - t.warmup_steps))
    if t.lr_schedule == "cosine":
        return t.min_lr + (t.lr - t.min_lr) * 0.5 * (1 + math.cos(math.pi * frac))
    return t.lr - (t.lr - t.min_lr) * frac


def param_groups(named: Iterable[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
    """Decay matrices; keep norms, biases and other 1-D parameters undecayed."""
    decay, keep = [], []
    for _, p in named:
        if p.requires_grad:
            (decay if p.ndim >= 2 else keep).append(p)
    return [g for g in ({"params": decay, "weight_decay": weight_decay}, {"params": keep, "weight_decay": 0.0})
            if g["params"]]


def make_optimizer(groups: list[dict], t: TrainConfig, *, device_type: str,
                   row_sparse: Iterable[nn.Parameter] = (), kernels: str = "auto",
                   accelerator: Any = None) -> torch.optim.Optimizer:
    """``row_sparse``: embedding tables for ``KernelAdamW``; the job marks their looked-up rows. ``kernels``: the
    recipe's ``kernels.provider``, which picks AdamW's step through the core's registry (``kernels.choose``)."""
    if t.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=t.lr, momentum=t.adam_beta1)
    from loongforge_embodied.kernels import choose

    # NOTE: fused AdamW on accelerators (where the triton provider serves ``adamw`` its step is our kernel:
    # ``KernelAdamW``); foreach on CPU, where fused is slower.
    fused = device_type != "cpu"
    kw = dict(lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, fused=fused or None,
              foreach=None if fused else True)
    if choose("adamw", provider=kernels, device_type=device_type, accelerator=accelerator).provider == "triton":
        return KernelAdamW(groups, row_sparse=row_sparse, kernels="triton", accelerator=accelerator, **kw)
    return torch.optim.AdamW(groups, **kw)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class KernelAdamW(torch.optim.AdamW):
    """torch's fused AdamW — same arguments, same state (``step`` as an fp32 device scalar, moments in the
    parameter's dtype), same checkpoints, same ``grad_scale`` hook — whose step is the kernel registry's
    ``adamw_plan`` op (the ``triton`` provider's fused AdamW, chosen by ``kernels`` under the registry's rule):
    one Triton launch per dtype that reads each gradient once and does not write it back (torch's fused kernel
    writes the unscaled gradient back when given a ``grad_scale``, and moves pi05's optimizer bytes at ~2.8 of
    the H200's 4.8 TB/s; ours at ~3.7).

    ``row_sparse``: parameters whose gradient is zero outside the rows the job passes to ``mark_rows`` each step
    (embedding tables): blocks never touched only decay (exact for a finite clip and ``eps > 0``: AdamW on zero
    gradient and zero moments), and ``grad_norm`` skips them. pi05's 257k-row token table sees a few dozen rows.

    ``grad_norm(params)`` is the clip's global L2 norm from the same gradient table the step then uses (one
    kernel over all gradients; None when it cannot serve, e.g. another parameter set or a fallback step).

    Falls back to torch's step for what the kernel does not cover: amsgrad, maximize, capturable,
    differentiable, ``found_inf``, tensor learning rates, a closure, sparse / non-contiguous / misaligned
    tensors, other dtypes, an unusable ``grad_scale``, and (``kernels="auto"``) no provider serving ``adamw_plan``
    for the parameters' device (an explicit provider that cannot serve it raises). Sharded (DTensor)
    parameters update their local shards. The per-group ``AdamWPlan`` (offsets of parameters, moments and steps)
    is kept while the group's parameters with gradients, and the addresses of them and of their state, stay the
    same; a fallback step drops plans with row-sparse tables (torch's step moved rows the plan had not marked)."""

    def __init__(self, *args, row_sparse=(), kernels: str = "auto", accelerator: Any = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._row_sparse = {id(p) for p in row_sparse}
        # NOTE: the backend passes the provider that serves its "adamw" op; "auto" (a direct use) takes any
        self._kernels, self._accelerator = kernels, accelerator
        self._planners: dict[str, Any] = {}
        self._reset()

    def _planner(self, device_type: str):
        """The registry's ``adamw_plan`` for ``device_type`` tensors, or None (``auto``: no provider serves it)."""
        if device_type not in self.__dict__.setdefault("_planners", {}):
            from loongforge.errors import PluginError
            from loongforge.kernels import select_op

            kernels = self.__dict__.get("_kernels", "auto")
            try:
                self._planners[device_type] = select_op("adamw_plan", provider=kernels, device_type=device_type,
                                                        accelerator=self.__dict__.get("_accelerator"))
            except PluginError:
                if kernels != "auto":
                    raise
                self._planners[device_type] = None
        return self._planners[device_type]

    def _reset(self) -> None:
        self.__dict__.setdefault("_row_sparse", set())
        self._plans: dict[int, tuple[tuple, object]] = {}
        self._marks: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._prepared: tuple[tuple, list] | None = None

    def __setstate__(self, state) -> None:
        # NOTE: a copy (deepcopy / pickle) keeps torch's state only: new plans; its parameters are new objects, so
        # no table of the copy is row-sparse
        super().__setstate__(state)
        self.__dict__["_row_sparse"] = set()
        self._reset()

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self._plans = {}  # NOTE: the moments and steps are new tensors
        self._prepared = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self._prepared = None

    def mark_rows(self, param: torch.Tensor, rows: torch.Tensor) -> None:
        """Rows of a ``row_sparse`` parameter that may get a gradient this step (device indices; no sync)."""
        if id(param) not in self._row_sparse:
            raise ValueError("KernelAdamW.mark_rows: the parameter was not declared row_sparse")
        self._marks.append((param, rows))

    def _plan(self, gi: int, group: dict, params: list[torch.Tensor], planner):
        from loongforge.errors import PluginError

        states = [self.state[p] for p in params]
        for p, state in zip(params, states, strict=True):
            if not state:  # NOTE: as torch's fused AdamW initialises it
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        local = _local if any(isinstance(p, DTensor) for p in params) else (lambda t: t)
        locals_ = [(local(p), local(st["exp_avg"]), local(st["exp_avg_sq"]), st["step"])
                   for p, st in zip(params, states, strict=True)]
        # NOTE: the kernel writes through these addresses: a parameter or state tensor that moved (``p.data = …``,
        # ``model.to()``, state replaced) must rebuild the plan, never reuse it
        key = tuple([id(p) for p in params] + [t.data_ptr() for ts in locals_ for t in ts])
        cached = self._plans.get(gi)
        if cached is not None and cached[0] == key:
            if cached[1] is None:  # NOTE: these tensors cannot take the kernel; torch's step, without re-checking
                raise PluginError("adamw: these tensors cannot take the kernel (cached)")
            return cached[1]
        try:
            # NOTE: the kernels' KernelUnavailableError is a PluginError: the kernel cannot take these tensors
            plan = planner([t[0] for t in locals_], [t[1] for t in locals_], [t[2] for t in locals_],
                             [t[3] for t in locals_],
                             row_sparse=[id(p) in self._row_sparse and not isinstance(p, DTensor) for p in params])
        except PluginError:
            self._plans[gi] = (key, None)
            raise
        self._plans[gi] = (key, plan)
        return plan

    def _prepare(self) -> list | None:
        """(plan, checked gradients, group, params) per group with gradients, or None for torch's step."""
        from loongforge.errors import PluginError

        if getattr(self, "found_inf", None) is not None:
            return None
        grads_key = tuple((id(p.grad), p.grad.data_ptr()) if p.grad is not None else None
                          for g in self.param_groups for p in g["params"])
        if self._prepared is not None and self._prepared[0] == grads_key:
            return self._prepared[1]
        work = []
        for gi, group in enumerate(self.param_groups):
            if group["amsgrad"] or group["maximize"] or group["capturable"] or group["differentiable"] \
                    or isinstance(group["lr"], torch.Tensor):
                return None
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                work.append((gi, group, params))
        planner = self._planner(_local(work[0][2][0]).device.type) if work else None
        if planner is None:
            return None
        try:
            scale = getattr(self, "grad_scale", None)
            prepared = []
            for gi, group, params in work:
                plan = self._plan(gi, group, params, planner)
                plan.check_scale(scale)
                prepared.append((plan, plan.check([_local(p.grad) for p in params]), group, params))
        except PluginError:
            return None
        index = {id(p): (plan, i) for plan, _, _, params in prepared for i, p in enumerate(params)}
        for param, rows in self._marks:  # NOTE: mark_rows took only row_sparse parameters
            plan, i = index.get(id(param), (None, None))
            if plan is not None and plan.is_row_sparse(i):  # NOTE: not a DTensor's, nor a step without its grad
                plan.mark_rows(i, rows)
        self._marks = []
        self._prepared = (grads_key, prepared)
        return prepared

    def discard_prepared(self) -> None:
        """Forget the gradient table prepared for a step that is not taken (a skipped non-finite step)."""
        self._prepared = None
        self._marks = []

    def grad_norm(self, params: list[torch.Tensor]) -> torch.Tensor | None:
        """The L2 norm of ``params``' gradients when they are exactly the gradients this optimizer steps (and the
        kernel path serves them), else None."""
        prepared = self._prepare()
        if prepared is None:
            return None
        mine = {id(p) for *_, ps in prepared for p in ps}
        theirs = {id(p) for p in params if p.grad is not None}
        if mine != theirs or any(isinstance(p.grad, DTensor) for *_, ps in prepared for p in ps):
            return None
        return sum(plan.grad_sumsq(checked) for plan, checked, _, _ in prepared).sqrt()

    @torch.no_grad()
    def step(self, closure=None):
        from loongforge.errors import PluginError

        prepared = None if closure is not None else self._prepare()
        self._prepared = None
        scale = getattr(self, "grad_scale", None)
        try:
            for plan, *_ in prepared or ():
                plan.check_scale(scale)  # NOTE: the clip sets it after the norm, i.e. after _prepare
        except PluginError:
            prepared = None
        if prepared is None:
            # NOTE: torch's step updates rows a row-sparse plan may hold inactive: drop those plans (a rebuilt plan
            # finds the rows from the moments)
            self._plans = {gi: c for gi, c in self._plans.items()
                           if c[1] is None or not any(launch.sparse for launch in c[1].launches)}
            self._marks = []
            return super().step(closure)
        for plan, checked, group, params in prepared:
            torch._foreach_add_([self.state[p]["step"] for p in params], 1)
            beta1, beta2 = group["betas"]
            plan.launch(checked, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                        weight_decay=group["weight_decay"], grad_scale=scale)
        return None


EMA_UPCAST_CHUNK = 1 << 27  # elements of lower-precision weights upcast at a time (bounds the temporary memory)


def update_ema(pairs: list[tuple[torch.Tensor, torch.Tensor]], decay: float) -> None:
    """``ema = decay * ema + (1 - decay) * weight`` for (fp32 average, weight) pairs, as foreach lerps over chunks
    that upcast at most ``EMA_UPCAST_CHUNK`` lower-precision elements (pi05's 2.8B bf16 weights would need 11 GB
    at once)."""
    chunk: list[tuple[torch.Tensor, torch.Tensor]] = []
    upcast = 0
    for i, (e, p) in enumerate(pairs):
        chunk.append((e, p))
        upcast += p.numel() if p.dtype != e.dtype else 0
        if upcast >= EMA_UPCAST_CHUNK or i == len(pairs) - 1:
            # NOTE: .to() of an fp32 weight is the weight itself: only the lower-precision ones are copied
            torch._foreach_lerp_([e for e, _ in chunk], [p.to(e.dtype) for _, p in chunk], 1.0 - decay)
            chunk, upcast = [], 0


def fused_scale_target(optimizer) -> torch.optim.Optimizer | None:
    """The optimizer (ours, or a ``ZeroOneOptimizer``'s own partition) whose ``step()`` divides gradients by its
    ``grad_scale`` inside the fused kernel: a fused ``torch.optim.Adam`` / ``AdamW``; else None."""
    inner = getattr(optimizer, "inner", optimizer)
    if isinstance(inner, torch.optim.Adam | torch.optim.AdamW) and inner.defaults.get("fused"):
        return inner
    return None


class ZeroOneOptimizer:
    """ZeRO-1: each data-parallel rank keeps optimizer state for (and updates) only its partition of the
    parameters; gradients are all-reduced in full (by DDP) and updated parameters are broadcast from owners.

    NOTE: our own rather than ``ZeroRedundancyOptimizer`` so optimizer state is keyed by parameter name on the
    owning rank and saves through DCP without gathering onto one rank."""

    def __init__(self, groups: list[dict], t: TrainConfig, *, device_type: str, group: dist.ProcessGroup | None = None,
                 kernels: str = "auto", accelerator: Any = None):
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        params = [p for g in groups for p in g["params"]]
        load = [0] * self.world
        self.owner: dict[nn.Parameter, int] = {}
        # Greedy: largest parameters first onto the least-loaded rank (deterministic on every rank).
        order = sorted(range(len(params)), key=lambda i: (-params[i].numel(), i))
        for p in (params[i] for i in order):
            r = min(range(self.world), key=lambda i: (load[i], i))
            self.owner[p], load[r] = r, load[r] + p.numel()
        mine = [{**g, "params": [p for p in g["params"] if self.owner[p] == self.rank]} for g in groups]
        mine = [g for g in mine if g["params"]]
        self.inner = make_optimizer(mine, t, device_type=device_type, kernels=kernels,
                                    accelerator=accelerator) if mine else None
        self.params = params
        self._src = {r: dist.get_global_rank(group, r) if group is not None else r for r in range(self.world)}

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups if self.inner is not None else []

    @property
    def state(self):
        return self.inner.state if self.inner is not None else {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        if self.inner is not None:
            self.inner.step()
        for p in self.params:
            # NOTE: one broadcast per parameter; bucketing them per owner would cut launch overhead at scale.
            dist.broadcast(p.data, src=self._src[self.owner[p]], group=self.group)
