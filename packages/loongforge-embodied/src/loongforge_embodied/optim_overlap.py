"""The AdamW step of step t run during step t+1's forward (``train.overlap_optimizer``).

A single-device or DDP step ends with a memory-bound optimizer pass over every parameter (pi05: ~50 GB moved,
~17 ms on an H200) while the compute units sit idle, and the next forward then waits for all of it. Here the step
is cut into chunks of parameters in the order the next forward uses them (the policy's ``wrap_units()``; what is
in no unit goes first) and queued on a side CUDA stream; each unit waits, just before it runs, for the event of
its own chunk only. So unit k's forward overlaps the update of the units after it. The math is the optimizer's
own (``torch.optim.adam.adam``, fused or foreach as the optimizer was built, decoupled weight decay, the clip as
the fused kernel's ``grad_scale``): parameters after a step are bitwise those of ``optimizer.step()``.

Where the waits happen: a unit called as a module waits in a forward pre-hook, or, when the job compiled it
(``nn.Module.compile``), in a wrapper around its compiled call (a hook would be traced into the graph). A policy
that calls a unit's submodules itself (LeRobot pi05's joint step) calls :func:`before_use` first. Parameters in no
unit are waited for before the forward starts, and :meth:`OverlappedStep.drain` (after the forward) waits for
whatever was not used, before backward writes new gradients.

Gradients: the step's gradients stay referenced here until ``drain`` (the side stream may still read them);
resident gradients (CUDA graphs + accumulation) are zeroed on the side stream after their chunk's update.
On CPU there is no side stream: the chunks run inline, in the same order (same results; no overlap).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable

import torch
from torch import nn

BEFORE_USE = "_loongforge_before_use"  # on a unit: call before reading its parameters (set by OverlappedStep)
MIN_CHUNK = 16 * 2**20  # consecutive units are merged into one chunk until it holds this many elements


def before_use(module: nn.Module) -> None:
    """Wait until ``module``'s parameters hold this step's update (no-op when nothing overlaps)."""
    wait = module.__dict__.get(BEFORE_USE)
    if wait is not None:
        wait()


def plan_chunks(units: Iterable[nn.Module], params: list[nn.Parameter], *,
                min_chunk: int = MIN_CHUNK) -> tuple[list[list[nn.Parameter]], list[int]]:
    """Chunks of ``params`` in forward order and the chunk of each unit: chunk 0 holds the parameters of no unit
    (embeddings, projections, norms: waited for before the forward), then consecutive units' parameters, merged
    until a chunk holds ``min_chunk`` elements (so a chunk is worth one kernel launch). A parameter shared by
    several units belongs to the first."""
    wanted = {id(p): p for p in params}
    seen: set[int] = set()
    per_unit: list[list[nn.Parameter]] = []
    for unit in units:
        own = []
        for p in unit.parameters():
            if id(p) in wanted and id(p) not in seen:
                seen.add(id(p))
                own.append(p)
        per_unit.append(own)
    chunks: list[list[nn.Parameter]] = [[p for p in params if id(p) not in seen]]
    unit_chunk: list[int] = []
    size = min_chunk  # NOTE: start a new chunk at the first unit
    for own in per_unit:
        if size >= min_chunk:
            chunks.append([])
            size = 0
        chunks[-1].extend(own)
        size += sum(p.numel() for p in own)
        unit_chunk.append(len(chunks) - 1)
    return chunks, unit_chunk


class OverlappedStep:
    """Runs ``optimizer`` (a ``torch.optim.Adam`` / ``AdamW``) chunk by chunk on a side stream.

    Two ways in. ``launch()``: after backward and the clip on the current stream (several micro-batches, DDP).
    ``stage_gradients()`` then ``after_backward()`` (one process, one micro-batch a step): as backward finishes a
    chunk's gradients, the side stream copies them into resident buffers and takes their norms, under the
    backward of the earlier units; the clip scale and the update follow there too. The current stream then only
    waits for the last copies (graph memory holding gradients may be reused by the next forward's replays)."""

    def __init__(self, optimizer: torch.optim.Optimizer, units: list[nn.Module], *, device: torch.device,
                 ema: dict[nn.Parameter, torch.Tensor] | None = None, ema_decay: float | None = None,
                 min_chunk: int | None = None):
        if not isinstance(optimizer, torch.optim.Adam):
            raise TypeError(f"overlap_optimizer runs Adam / AdamW, not {type(optimizer).__name__}")
        self.optimizer = optimizer
        group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        chunks, unit_chunk = plan_chunks(units, self.params, min_chunk=MIN_CHUNK if min_chunk is None else min_chunk)
        # NOTE: per chunk, its parameters split by optimizer group (each group has its own lr / weight decay).
        self.chunks = [[(gi, [p for p in chunk if group_of[id(p)] == gi]) for gi in range(len(optimizer.param_groups))]
                       for chunk in chunks]
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.events: list[torch.cuda.Event | None] = [None] * len(chunks)
        self.ema, self.ema_decay = ema, ema_decay
        self._held: list[object] = []  # what the side stream may still read: gradients, the clip scale
        self._staged: dict[nn.Parameter, torch.Tensor] | None = None  # param -> resident gradient buffer
        self.units = units
        for unit, c in zip(units, unit_chunk, strict=True):
            _install_wait(unit, functools.partial(self.wait, c))

    def __len__(self) -> int:
        return len(self.chunks)

    def _side(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def wait(self, chunk: int) -> None:
        """The current stream waits for ``chunk``'s update (once per step)."""
        event = self.events[chunk]
        if event is not None:
            torch.cuda.current_stream().wait_event(event)
            self.events[chunk] = None

    def drain(self) -> None:
        """Wait for every chunk, then drop the gradients the side stream read: after this, new allocations on the
        current stream may reuse their memory."""
        for c in range(len(self.events)):
            self.wait(c)
        self._held.clear()

    # ----------------------------------------------------------------- after backward
    @torch.no_grad()
    def launch(self, *, grad_scale: torch.Tensor | None, zero_grads: bool) -> None:
        """Queue this step's update (after the gradients and the clip scale are ready on the current stream).
        The first step (no optimizer state yet) runs ``optimizer.step()`` in place, on the current stream."""
        if self._first_step(grad_scale, zero_grads):
            return
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())
        with self._side():
            self._update({p: p.grad for p in self.params if p.grad is not None}, grad_scale, zero_grads)
        if self.stream is not None:
            self._held.extend(p.grad for p in self.params)
            self._held.append(grad_scale)

    def _first_step(self, grad_scale: torch.Tensor | None, zero_grads: bool) -> bool:
        opt = self.optimizer
        if all(p in opt.state for p in self.params if p.grad is not None):
            return False
        opt.grad_scale = grad_scale  # NOTE: torch's fused Adam reads it as an attribute
        opt.step()
        opt.grad_scale = None
        self._after_chunk([p for p in self.params if p.grad is not None], zero_grads)
        return True

    def _update(self, grads: dict[nn.Parameter, torch.Tensor], grad_scale: torch.Tensor | None,
                zero_grads: bool) -> None:
        """Every chunk's update, in order, on the current stream (the side stream, under ``_side()``)."""
        opt = self.optimizer
        for c, chunk in enumerate(self.chunks):
            for gi, ps in chunk:
                ps = [p for p in ps if p in grads]
                if ps:
                    self._adam(opt.param_groups[gi], ps, [grads[p] for p in ps], grad_scale)
            self._after_chunk([p for _, ps in chunk for p in ps if p in grads], zero_grads)
            if self.stream is not None:
                self.events[c] = self.stream.record_event()

    # ----------------------------------------------------------------- during backward
    def stage_gradients(self, *, max_norm: float, scale_in_kernel: bool, norm_order: list[nn.Parameter]) -> None:
        """Copy each chunk's gradients into resident buffers (and take their norms) on the side stream as soon as
        backward has written them (``register_post_accumulate_grad_hook``). One micro-batch a step, one process:
        with accumulation or DDP a hook fires before the gradient is final. ``scale_in_kernel``: the clip is the
        fused kernel's ``grad_scale`` (else the buffers are multiplied by torch's clip coefficient). ``norm_order``:
        the parameters in the order the plain step's ``clip_grad_norm`` gets them (the same float sum)."""
        self.max_norm, self.scale_in_kernel = max_norm, scale_in_kernel
        mine = set(self.params)
        self._norm_order = [p for p in norm_order if p in mine]
        self._staged = {p: torch.empty_like(p, memory_format=torch.preserve_format) for p in self.params}
        self._chunk_of = {p: c for c, chunk in enumerate(self.chunks) for _, ps in chunk for p in ps}
        self._need = [sum(len(ps) for _, ps in chunk) for chunk in self.chunks]
        self._landed: list[list[nn.Parameter]] = [[] for _ in self.chunks]
        self._done = [False] * len(self.chunks)
        self._norms: dict[nn.Parameter, torch.Tensor] = {}
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    def _on_grad(self, p: nn.Parameter) -> None:
        c = self._chunk_of[p]
        self._landed[c].append(p)
        if len(self._landed[c]) == self._need[c]:
            self._stage(c)

    @torch.no_grad()
    def _stage(self, c: int) -> None:
        self._done[c] = True
        params = self._landed[c]
        if not params:
            return
        grads = [p.grad for p in params]
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())
        with self._side():
            torch._foreach_copy_([self._staged[p] for p in params], grads)
            self._norms.update(zip(params, torch._foreach_norm(grads, 2.0), strict=True))

    @torch.no_grad()
    def after_backward(self) -> torch.Tensor:
        """Stage what backward did not (parameters without a gradient this step leave their chunk short), make the
        current stream wait for the copies, and queue the clip and the update; returns the pre-clip global
        gradient norm (computed on the side stream: read it after :meth:`finish`)."""
        for c in range(len(self.chunks)):
            if not self._done[c]:
                self._stage(c)
        landed = {p for ps in self._landed for p in ps}
        self._landed, self._done = [[] for _ in self.chunks], [False] * len(self.chunks)
        if self.stream is not None:
            torch.cuda.current_stream().wait_stream(self.stream)  # NOTE: gradients may now be freed or reused
        ordered = [p for p in self._norm_order if p in landed]
        if not ordered:
            self._norms.clear()
            return torch.zeros(())
        if not self.scale_in_kernel or not all(p in self.optimizer.state for p in ordered):
            # NOTE: the first step (no optimizer state) and foreach optimizers: the plain path on the current stream
            return self._plain_after_backward(ordered)
        # NOTE: torch's get_total_norm: per-tensor norms grouped by (device, dtype) in first-seen order, stacked.
        groups: dict[tuple, list[nn.Parameter]] = {}
        for p in ordered:
            groups.setdefault((p.device, p.dtype), []).append(p)
        with self._side():
            norm = torch.linalg.vector_norm(torch.stack([self._norms[p] for ps in groups.values() for p in ps]), 2.0)
            scale = ((norm.float() + 1e-6) / self.max_norm).clamp(min=1.0) if self.max_norm > 0 else None
            self._update({p: self._staged[p] for p in ordered}, scale, zero_grads=False)
        self._norms.clear()
        return norm

    def _plain_after_backward(self, ordered: list[nn.Parameter]) -> torch.Tensor:
        from loongforge_embodied.parallel import clip_grad_norm

        self._norms.clear()
        target = self.optimizer if self.scale_in_kernel else None
        norm = clip_grad_norm(ordered, self.max_norm, into=target)
        scale = getattr(target, "grad_scale", None)
        if target is not None:
            target.grad_scale = None
        if not self._first_step(scale, zero_grads=False):
            with self._side():
                self._update({p: p.grad for p in ordered}, scale, zero_grads=False)
            if self.stream is not None:
                self._held.extend(p.grad for p in ordered)
        return norm

    # ----------------------------------------------------------------- the update
    def _adam(self, group: dict, params: list[nn.Parameter], grads: list[torch.Tensor],
              grad_scale: torch.Tensor | None) -> None:
        """``Adam.step``'s update of ``params`` (one group's hyperparameters; state already initialised)."""
        from torch.optim.adam import adam

        state = self.optimizer.state
        beta1, beta2 = group["betas"]
        adam(list(params), grads, [state[p]["exp_avg"] for p in params],
             [state[p]["exp_avg_sq"] for p in params],
             [state[p]["max_exp_avg_sq"] for p in params] if group["amsgrad"] else [],
             [state[p]["step"] for p in params],
             foreach=group["foreach"], fused=group["fused"], capturable=group["capturable"],
             differentiable=False, grad_scale=grad_scale, found_inf=None, has_complex=False,
             decoupled_weight_decay=group.get("decoupled_weight_decay", isinstance(self.optimizer, torch.optim.AdamW)),
             amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
             eps=group["eps"], maximize=group["maximize"])

    @torch.no_grad()
    def _after_chunk(self, params: list[nn.Parameter], zero_grads: bool) -> None:
        if self.ema is not None:
            pairs = [(self.ema[p], p) for p in params if p in self.ema]
            if pairs:
                torch._foreach_lerp_([e for e, _ in pairs], [p.detach() for _, p in pairs], 1.0 - self.ema_decay)
        if zero_grads:
            grads = [p.grad for p in params if p.grad is not None]
            if grads:
                torch._foreach_zero_(grads)

    def finish(self) -> None:
        """Everything queued is done before the current stream's next work (before reading weights, optimizer
        state, EMA or the returned norm: checkpoints, export, logging)."""
        if self.stream is not None:
            torch.cuda.current_stream().wait_stream(self.stream)
        self.events = [None] * len(self.events)
        self._held.clear()


def _install_wait(unit: nn.Module, wait: Callable[[], None]) -> None:
    """``unit`` waits for its chunk whenever it runs: the attribute :func:`before_use` reads, plus a forward
    pre-hook, or (compiled unit) a wrapper around the compiled call, outside the traced graph."""
    unit.__dict__[BEFORE_USE] = wait
    compiled = unit.__dict__.get("_compiled_call_impl")
    if compiled is not None:
        # NOTE: ``nn.Module.compile`` stores ``torch.compile(self._call_impl)`` in ``_compiled_call_impl`` (private,
        # read by ``nn.Module.__call__``); a forward pre-hook would run inside the compiled call, i.e. be traced.
        @functools.wraps(compiled)
        def call(*args, **kwargs):
            wait()
            return compiled(*args, **kwargs)

        call._loongforge_compiled = compiled
        unit._compiled_call_impl = call
    else:
        unit.register_forward_pre_hook(lambda module, args: wait())
