"""The embodied training job: policy + data + optimizer for this rank, the step loop, checkpoints, export."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from loongforge.backend import Job
from loongforge.errors import RecipeError

if TYPE_CHECKING:
    from loongforge.recipe.schema import Recipe
    from loongforge.runtime import Runtime


class EmbodiedJob(Job):
    """One rank's job. ``step()`` runs one optimizer step over this rank's share of the global batch."""

    def __init__(self, recipe: Recipe, runtime: Runtime):
        from loongforge.accelerator.adaptation import AdaptationSet

        from loongforge_embodied.policies import get_policy

        self.recipe, self.runtime = recipe, runtime
        self._owns_pg = not dist.is_initialized()
        self._ready = False
        # NOTE: the policy's library adaptations hold for this run only (undone in close)
        self._adaptations: AdaptationSet | None = AdaptationSet(get_policy(recipe.model.policy).adaptations())
        self._adaptations.__enter__()
        try:
            runtime.init_distributed()
        except BaseException:
            self.close()
            raise
        self._clock: tuple[float, int] | None = None  # (time, step index) since which step_time is measured
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        self._ready = True

    def _apply_fp8(self, raw: torch.nn.Module) -> None:
        """``train.fp8``: the policy's ``nn.Linear`` layers run their GEMMs in FP8 (torchao-style module swap; the
        parameters and checkpoints are unchanged); output heads named ``lm_head`` stay bf16 unless asked."""
        fp8 = self.recipe.train.fp8
        skip = (lambda name, mod: False) if fp8.output_layer else (lambda name, mod: name.endswith("lm_head"))
        swapped = self._fp8_ops.convert(raw, skip=skip)
        n = sum(1 for m in raw.modules() if isinstance(m, torch.nn.Linear))
        self.log.info(f"[embodied] train.fp8 {fp8.recipe} (grads {fp8.grad_dtype}): {3 * len(swapped)} of {3 * n} "
                      "GEMMs run in FP8")

    def _check_fp8(self) -> None:
        """``train.fp8``'s op from the kernel registry (``fp8_linear``), refused before anything is built where it
        cannot run (the registry's FP8 GEMMs need FP8 tensor cores)."""
        from loongforge_embodied.kernels import fp8_linear

        fp8 = self.recipe.train.fp8
        self._fp8_ops = fp8_linear(fp8, provider=self.recipe.kernels.provider, device_type=self.device.type,
                                   accelerator=self.acc)
        reason = self._fp8_ops.unavailable_reason(self.device)
        if reason:
            raise RecipeError(f"train.fp8 recipe {fp8.recipe}: {reason}", key="train.fp8")

    def _build(self) -> None:
        from loongforge.failures import NonFiniteGuard

        from loongforge_embodied import checkpoint
        from loongforge_embodied.data.dataset import build_loader
        from loongforge_embodied.data.sampler import GlobalBatchSampler
        from loongforge_embodied.optim import ZeroOneOptimizer, make_optimizer, param_groups
        from loongforge_embodied.parallel import parallelize
        from loongforge_embodied.policies import get_policy, resolve_arch

        r, rt, t = self.recipe, self.runtime, self.recipe.train
        self.acc, self.device = rt.accelerator, rt.accelerator.device()
        self.precision = self.acc.resolve_precision(t.precision)
        self.log = rt.logger
        self.nonfinite = NonFiniteGuard(skip=t.skip_nonfinite, checkpoint_dir=rt.checkpoint_dir, log=self.log)
        if t.fp8 is not None:
            self._check_fp8()
        source = self._source()
        self.arch = resolve_arch(r.model, r.data)
        cams = getattr(source, "cameras", None) or [f"observation.images.cam{i}" for i in range(self.arch.num_cameras)]
        self.features = {"cameras": cams, "state": r.data.state_key}
        # NOTE: the same seed on every rank gives identical initial weights (and the same as one process).
        rt.seed(t.seed)
        from loongforge_embodied import kernels

        # NOTE: an explicit kernels.provider that cannot serve AdamW / the FP8 codec here is one clear error now
        kernels.check(provider=r.kernels.provider, device_type=self.device.type, accelerator=self.acc,
                      ops=kernels.OPS if r.model.fp8_allgather.enabled else ("adamw",))
        policy = get_policy(r.model.policy)
        # NOTE: e.g. the tokenizer loads and the statistics are checked here, not first in a DataLoader worker
        stats = source.stats()
        policy.check_data_pipeline(self.arch, stats)
        raw = policy.model_cls()(self.arch)
        if r.model.load:
            self._load_initial(raw, policy, r.model.load)
        raw.set_stats(stats)
        components = raw.components()
        unknown = [n for n in r.model.freeze if n not in components]
        if unknown:
            raise RecipeError(f"{r.model.policy} has no component {', '.join(unknown)}; allowed: "
                              f"{', '.join(components)}", key="model.freeze")
        if set(r.model.freeze) >= set(components):
            raise RecipeError("every component is frozen: nothing to train", key="model.freeze")
        for name in r.model.freeze:
            for m in components[name]:
                m.requires_grad_(False)
        raw.to(self.device)
        if t.fp8 is not None:
            self._apply_fp8(raw)
        if rt.plan.recompute == "full":
            raw.enable_activation_checkpointing()
        from loongforge_embodied.config import CUDA_GRAPH_MODES

        self._graphs = t.compile and t.compile_mode in CUDA_GRAPH_MODES and self.device.type == "cuda"
        if t.compile:
            mode = None if t.compile_mode == "default" else t.compile_mode
            for unit in raw.wrap_units():
                unit.compile(mode=mode)
                unit._loongforge_compile_mode = mode  # NOTE: read by bodies compiled outside the unit's forward
        self.model = parallelize(
            raw, strategy=r.parallel.strategy, world_size=rt.world_size, device=self.device, precision=self.precision,
            comm_hook=r.model.comm_hook, shard_size=r.parallel.shard_size,
            reshard_after_forward=r.model.reshard_after_forward, prefetch=r.model.prefetch,
            fp8_allgather=r.model.fp8_allgather.enabled, reprime_every=r.model.fp8_allgather.reprime_every,
            kernels=r.kernels.provider, accelerator=self.acc,
        )
        self.trainable = [p for p in raw.parameters() if p.requires_grad]
        groups = param_groups(raw.named_parameters(), t.weight_decay)
        # NOTE: one rank only: with data parallelism a table's reduced gradient also has the other ranks' rows
        row_sparse = raw.row_sparse_params() if hasattr(raw, "row_sparse_params") and rt.world_size == 1 else []
        kernels = dict(kernels=r.kernels.provider, accelerator=self.acc)
        if self.model.strategy == "zero1" and rt.world_size > 1:
            self.optimizer = ZeroOneOptimizer(groups, t, device_type=self.device.type, **kernels)
        else:
            self.optimizer = make_optimizer(groups, t, device_type=self.device.type, row_sparse=row_sparse, **kernels)
        self._mark_rows = bool(row_sparse) and hasattr(self.optimizer, "mark_rows")
        # NOTE: fp32 averages whatever the weights' dtype: a bf16 average would round most (1 - decay) steps away.
        self.ema = ({n: p.detach().float().clone() for n, p in raw.named_parameters() if p.requires_grad}
                    if t.ema_decay else None)
        self.step_index, failure = 0, None
        try:
            if r.checkpoint.resume == "auto":
                self.step_index = checkpoint.resume(model=self.model.raw, optimizer=self.optimizer, ema=self.ema,
                                                    recipe=r, checkpoint_dir=rt.checkpoint_dir)
        except Exception as exc:  # NOTE: re-raised by agree(), on this rank; its peers raise PeerFailedError
            failure = exc
        from loongforge.failures import agree

        agree(failure, phase="resume", device=self.device if self.device.type != "cpu" else None)
        self.accum = rt.plan.grad_accumulation(global_batch_size=t.global_batch_size, micro_batch_size=t.micro_batch_size)
        # NOTE: under CUDA graphs a parameter's first gradient is a graph output that AccumulateGrad steals as
        # ``.grad``; the next micro-batch's replay overwrites it (pytorch/pytorch#169545: an error, or silently a
        # wrong sum). Keeping ``.grad`` allocated makes every backward add into it in place, out of graph memory.
        self._resident_grads = self._graphs and self.accum > 1
        sampler = GlobalBatchSampler(
            num_samples=len(source), global_batch=t.global_batch_size, micro_batch=t.micro_batch_size,
            dp_rank=rt.rank, dp_size=rt.world_size, seed=t.seed, start_step=self.step_index,
        )
        data = build_loader(source, arch=self.arch, prepare=policy.prepare_batch, sampler=sampler, seed=t.seed,
                            num_workers=r.data.num_workers, pin_memory=self.device.type == "cuda",
                            image_shift=r.data.image_shift)
        self._batches = iter(data.loader)
        if self.log:
            for note in self.model.notes:
                self.log.info(f"[embodied] {note}")
            n = sum(p.numel() for p in raw.parameters())
            self.log.info(
                f"[embodied] {r.model.policy}/{r.model.preset} {n / 1e6:.2f}M params | {self.model.strategy} on "
                f"{rt.world_size} rank(s) | {self.accum} micro-batch(es)/step | {self.precision} | {len(source)} samples"
                f" | {self.acc.describe()}" + (f" | resumed at step {self.step_index}" if self.step_index else ""))

    @staticmethod
    def _load_initial(raw: torch.nn.Module, policy, path: str) -> None:
        """``model.load``: an exported policy whose shapes must be this recipe's (arch, dataset dims)."""
        from loongforge.errors import RecipeError

        try:
            raw.load_state_dict(policy.export.load_model(path).state_dict())
        except RuntimeError as exc:
            lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
            detail = "; ".join(lines[1:4]) if len(lines) > 1 else lines[0] if lines else type(exc).__name__
            raise RecipeError(f"'{path}' does not fit this recipe's model ({detail}); export and recipe must agree on "
                              "the policy's sizes and the dataset's state / action dims", key="model.load") from None

    def _source(self):
        from loongforge_embodied.data.dataset import InMemorySource, LeRobotSource, SyntheticSource
        from loongforge_embodied.policies import resolve_arch

        d = self.recipe.data
        if d.format == "synthetic":
            return SyntheticSource(arch=resolve_arch(self.recipe.model), num_samples=d.synthetic_samples, task=d.task)
        if not (Path(d.root) / "meta" / "info.json").is_file() and d.record is not None:
            if self.runtime.is_main:
                from loongforge_embodied.data.prepare import prepare

                prepare(self.recipe)
            dist.barrier()
        source = LeRobotSource(root=d.root, repo_id=d.repo_id, arch=resolve_arch(self.recipe.model, d),
                               cameras=d.cameras, state_key=d.state_key)
        return InMemorySource(source) if d.in_memory else source

    def _autocast(self):
        if self.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def step(self, *, report: bool = True) -> dict[str, float]:
        """One optimizer step; returns its metrics. With ``report=False`` nothing waits for the device (the loss
        and grad norm are not read) and it returns ``{}``, so the host queues the next step while this one runs;
        the next reported step's ``step_time`` is the mean over the steps since the last report (like Megatron's
        per-interval timing). ``run()`` reports the steps that ``logging.interval`` records and those before saves."""
        from loongforge_embodied.optim import fused_scale_target, lr_at
        from loongforge_embodied.parallel import all_reduce_sum, clip_grad_norm

        t = self.recipe.train
        if self._clock is None:
            self._clock = (time.perf_counter(), self.step_index)
        lr = lr_at(self.step_index, t)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        local = t.global_batch_size // self.runtime.world_size
        loss_sum = torch.zeros((), device=self.device)
        if self._resident_grads:
            for p in self.trainable:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        for m in range(self.accum):
            batch = {k: v.to(self.device, non_blocking=True) for k, v in next(self._batches).items()}
            if self._mark_rows:  # NOTE: every micro-batch's looked-up rows, before the optimizer step reads them
                for param, rows in self.model.raw.row_sparse_rows(batch):
                    self.optimizer.mark_rows(param, rows)
            if self._graphs:
                # NOTE: a new forward: the CUDA graphs' outputs of the last one are dead (loss_sum holds a copy), so
                # cudagraph trees may replay on their fast path (without it they warn of "pending backwards").
                torch.compiler.cudagraph_mark_step_begin()
            with self.model.no_sync(skip=m < self.accum - 1):
                with self._autocast():
                    per_sample = self.model.module(batch)
                # NOTE: sum / local batch on each rank, averaged over ranks by the gradient reduction = the mean
                # over the global batch, however it is split into ranks and micro-batches.
                (per_sample.sum() / local).backward()
            loss_sum += per_sample.detach().sum()
        scale_target = fused_scale_target(self.optimizer)
        gnorm = clip_grad_norm(self.trainable, t.grad_clip, into=scale_target)
        # NOTE: the loss is summed over ranks (the grad norm is global already), so every rank sees the same verdict.
        loss_sum = all_reduce_sum(loss_sum)
        finite = True
        if t.skip_nonfinite:
            # NOTE: skipping needs the verdict on the host before the update: one sync per step
            if not bool(torch.isfinite(loss_sum) & torch.isfinite(gnorm)):
                finite = self.nonfinite.check(self.step_index + 1, loss=float(loss_sum) / t.global_batch_size,
                                              grad_norm=float(gnorm), nonfinite=True)
                self._discard_prepared()
        else:
            # NOTE: no host sync: the first non-finite step is kept on the device and read at the reported steps and
            # before every save or export (check_finite), so its weights are never written
            self.nonfinite.defer(self.step_index + 1, loss=loss_sum / t.global_batch_size, grad_norm=gnorm)
        if finite:
            self.optimizer.step()
        if scale_target is not None:
            scale_target.grad_scale = None  # NOTE: no later step() may reuse this step's clip
        self.optimizer.zero_grad(set_to_none=not self._resident_grads)
        if finite and self.model.allgather is not None:
            self.model.allgather.step()
        if finite and self.ema is not None:
            self._update_ema(t.ema_decay)
        self.step_index += 1
        if not report:
            return {}
        self.check_finite()
        loss = float(loss_sum / t.global_batch_size)
        self.acc.synchronize()
        start, start_step = self._clock
        self._clock = None
        dt = (time.perf_counter() - start) / (self.step_index - start_step)
        metrics: dict[str, Any] = {"loss": loss, "lr": lr, "grad_norm": float(gnorm), "step_time": dt,
                                   "samples_per_s": t.global_batch_size / dt}
        metrics.update(self.nonfinite.metrics())
        if self.model.allgather is not None:
            metrics["allgather_bytes_ratio"] = self.model.allgather.stats.ratio
        mem = self.acc.memory_stats().get("peak_allocated")
        if mem:
            metrics["peak_mem_gib"] = mem / 2**30
        if self.log:
            self.log.log(self.step_index, metrics)
        return metrics

    def check_finite(self) -> None:
        """Raise ``NonFiniteError`` naming the first step since this process started whose loss or grad norm was NaN /
        inf (``train.skip_nonfinite`` false); reads one small tensor from the device."""
        self.nonfinite.raise_deferred()

    def _discard_prepared(self) -> None:
        """A skipped step's gradients are dropped (no update of weights, optimizer state or EMA)."""
        discard = getattr(getattr(self.optimizer, "inner", self.optimizer), "discard_prepared", None)
        if discard is not None:
            discard()  # NOTE: our fused AdamW prepared this step's gradient table while computing the norm

    @torch.no_grad()
    def _update_ema(self, decay: float) -> None:
        from loongforge_embodied.optim import update_ema

        update_ema([(self.ema[n], p.detach()) for n, p in self.model.raw.named_parameters() if n in self.ema], decay)

    def evaluate(self) -> dict[str, float]:
        """Closed-loop episodes of the current weights (``train.eval_interval``; collective): exported (the EMA
        where kept, as the final export) and served like ``loongforge eval`` does."""
        from loongforge_embodied.eval.during_training import evaluate_export

        out = self.runtime.output_dir / "eval" / f"step_{self.step_index:06d}"
        self.export(out / "policy")  # NOTE: collective (the full weights are gathered under fsdp2 / hsdp)
        return evaluate_export(out / "policy", recipe=self.recipe, step=self.step_index, out_dir=out,
                               device=self.device)

    def save(self) -> Path:
        from loongforge_embodied import checkpoint

        self.check_finite()
        return checkpoint.save(model=self.model.raw, optimizer=self.optimizer, ema=self.ema, recipe=self.recipe,
                               step=self.step_index, checkpoint_dir=self.runtime.checkpoint_dir,
                               strategy=self.model.strategy)

    def export(self, out_dir: Path | None = None) -> Path:
        from loongforge_embodied import checkpoint

        self.check_finite()
        rt = self.runtime
        return checkpoint.export(model=self.model.raw, ema=self.ema, policy=self.recipe.model.policy, arch=self.arch,
                                 features=self.features, step=self.step_index, out_dir=Path(out_dir or rt.hf_dir),
                                 checkpoint_dir=rt.checkpoint_dir)

    def run(self) -> dict[str, Any]:
        from loongforge.metrics import is_logged_step

        c, steps = self.recipe.checkpoint, self.recipe.train.steps
        resumable = "dist" in c.save_format  # NOTE: save_format [hf] asks for the export only
        last: dict[str, Any] = {}
        while self.step_index < steps:
            nxt = self.step_index + 1
            saving = resumable and bool(c.save_interval) and nxt % c.save_interval == 0 and nxt < steps
            every = self.recipe.train.eval_interval
            evaluating = bool(every) and nxt % every == 0
            metrics = self.step(report=saving or evaluating or is_logged_step(nxt, self.recipe.logging.interval, steps))
            if evaluating:
                metrics = {**metrics, **self.evaluate()}
                if self.log and metrics:
                    self.log.log(self.step_index, metrics)
            last = metrics or last
            if saving:
                self.save()
        self.check_finite()
        if c.save_at_end and resumable:
            self.save()
        if "hf" in c.save_format:
            path = self.export()
            if self.log:
                self.log.info(f"[embodied] exported policy to {path}")
                from loongforge_embodied.policies import get_policy

                note = getattr(get_policy(self.recipe.model.policy).export, "serving_note", lambda arch: "")(self.arch)
                if note:
                    self.log.info(f"[embodied] note: {note}")
        return {"step": self.step_index, **last}

    def close(self) -> None:
        try:
            if self._owns_pg and dist.is_initialized():
                # NOTE: tear down only when every rank is done; a rank destroying its gloo group while a peer still
                # talks to it aborts the peer at exit ("terminate called without an active exception").
                try:
                    if self._ready:
                        dist.barrier()
                finally:
                    dist.destroy_process_group()
        finally:
            if self._adaptations is not None:
                self._adaptations.__exit__(None, None, None)
                self._adaptations = None
