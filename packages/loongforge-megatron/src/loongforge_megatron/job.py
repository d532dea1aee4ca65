"""The megatron training job: builds model, data and optimizer for this rank and runs the step loop.

The loop itself is megatron-core's (``engine.train_step`` wraps ``get_forward_backward_func``); this module only
wires the recipe to it through the model's spec: device adaptations, data, model, initial weights (an HF
directory), LoRA, FP8, DDP, resume, metrics, checkpoints and the HF export, and makes a failure every rank's
(non-finite steps, a rank that cannot resume). It names no model.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from loongforge.backend import Job
from loongforge.errors import RecipeError
from loongforge.failures import raised_on_every_rank

if TYPE_CHECKING:
    from loongforge.recipe.schema import Recipe
    from loongforge.runtime import Runtime


class MegatronJob(Job):
    """One rank's job. Create inside a process group-capable runtime (``Runtime.create``).

    Linear, and the same for every model: recipe -> spec (``models.registry``) -> data -> model chunks (seeded,
    layout-invariant init) -> HF weights -> LoRA -> FP8 -> DDP -> optimizer / scheduler -> resume.
    """

    def __init__(self, recipe: Recipe, runtime: Runtime):
        from loongforge_megatron import engine
        from loongforge_megatron.device_adapters import adapted
        from loongforge_megatron.engine.encoder_ranks import rank_sets

        self.recipe, self.runtime = recipe, runtime
        # NOTE: with an encoder on ranks of its own (engine/encoder_ranks.py) the job's plan is the language
        # model's (its batches, micro-batches and checkpoint layout), on the encoder ranks too
        self.acc, self.sets = runtime.accelerator, rank_sets(runtime.plan)
        self.plan = runtime.plan if self.sets is None else self.sets.language
        self.spec, self.arch = recipe.model.resolve()
        self.log = runtime.logger
        self.step_index = 0  # optimizer steps done
        self._adaptations = adapted(self.acc, grad_accum_fusion=recipe.kernels.grad_accum_fusion,
                                    model=self.spec.adaptations(arch=self.arch, accelerator=self.acc))
        self._adaptations.__enter__()
        self._failed = False  # a failed job tears down without waiting for its peers (close)
        try:
            runtime.init_distributed()
            engine.initialize(runtime.plan, accelerator=self.acc, seed=recipe.train.seed)
            self._build()
            self._resume()
        except BaseException as exc:
            self._failed = not raised_on_every_rank(exc)
            self.close()
            raise

    # ------------------------------------------------------------------ building
    def _build(self) -> None:
        from megatron.core import parallel_state as mpu

        from loongforge_megatron import engine
        from loongforge_megatron.data.datasets import BatchSchedule

        recipe, plan, arch, spec, t = self.recipe, self.plan, self.arch, self.spec, self.recipe.train
        self.device = self.acc.device()
        self.precision = self.acc.resolve_precision(t.precision)
        self.fp8_kernels = self._fp8_kernels() if t.fp8 is not None else None
        # the data first: a bad data path or image encoder fails before the model is built
        self.data = spec.data(recipe=recipe, arch=arch, runtime=self.runtime, device=self.device)
        self.seq_length = self.data.seq_length
        encoder_side = self.sets is not None and self.sets.on_encoder(dist.get_rank())
        built = spec.model(recipe=recipe, arch=arch, plan=self.runtime.plan, accelerator=self.acc, device=self.device,
                           precision=self.precision, data=self.data)
        self.config, self.chunks, self.whole_components = built.config, built.chunks, built.whole
        self.forward_step_fn, self.loss_key, self.kernels = built.forward_step, built.loss_key, built.kernels
        self.before_step, self.step_metrics = built.before_step, built.step_metrics
        self.timed_encoder = built.timed_encoder
        if recipe.checkpoint.load:
            from loongforge_megatron.hf_io import load_hf_into

            load_hf_into(self.chunks, recipe.checkpoint.load, plan=plan, whole=self.whole_components, log=self.log,
                         part=self.sets is not None)
        self.lora = None
        if t.stage == "lora":
            from loongforge_megatron.lora import apply_lora

            self.lora = apply_lora(self.chunks, t.lora, seed=t.seed, targets=built.lora_targets)
        if t.freeze:
            from loongforge_megatron.freeze import freeze

            n = freeze(self.chunks, t.freeze, groups=built.groups, may_freeze_all=encoder_side)
            if self.runtime.is_main:
                self.log.info(f"[megatron] train.freeze {t.freeze}: {n} parameters frozen")
        if t.fp8 is not None:
            from loongforge_megatron.layers.fp8 import apply_fp8

            tokens = t.micro_batch_size * self.seq_length // plan.cp
            notes: list[str] = []
            n8, n = apply_fp8(self.chunks, t.fp8, kernels=self.fp8_kernels, tokens=tokens, notes=notes)
            if self.runtime.is_main:
                self.log.info(f"[megatron] train.fp8 {t.fp8.recipe} (grads {t.fp8.grad_dtype}): {n8} of {n} GEMMs run "
                              "in FP8" + (f" (policy {t.fp8.policy})" if t.fp8.policy else "")
                              + "".join(f"; {note}" for note in notes))
        self._fp8_cache = None
        tower = True  # the encoder's tower has something to train (an encoder on ranks of its own)
        if self.sets is not None:
            from loongforge_megatron.engine.encoder_ranks import tower_trains

            tower = tower_trains(self.chunks, self.sets)  # NOTE: collective
        # NOTE: a frozen encoder's ranks build an (empty) DDP and optimizer too: megatron aligns the optimizer's
        # parameter groups over the world
        self.model = engine.wrap_ddp(self.chunks, self.config, use_distributed_optimizer=plan.distributed_optimizer)
        self.optimizer = engine.build_optimizer(
            self.model, lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay, betas=(t.adam_beta1, t.adam_beta2),
            eps=t.adam_eps, clip_grad=t.grad_clip, bf16=self.precision == "bf16", fp16=self.precision == "fp16",
            use_distributed_optimizer=plan.distributed_optimizer, optimizer="adam" if t.optimizer == "adamw" else "sgd",
        )
        if self.sets is not None:  # NOTE: each rank set steps its own optimizer, clipped by the norm of both
            from loongforge_megatron.engine.encoder_ranks import global_norm_optimizer

            self.optimizer = global_norm_optimizer(self.optimizer, self.sets)
        decay_steps = t.decay_steps or t.steps
        self.scheduler = engine.build_scheduler(
            self.optimizer, lr=t.lr, min_lr=t.min_lr, warmup_steps=t.warmup_steps, decay_steps=decay_steps,
            # NOTE: megatron spells it "WSD"; the final decay defaults to a tenth of the schedule (as embodied's)
            decay_style="WSD" if t.lr_schedule == "wsd" else t.lr_schedule, global_batch_size=t.global_batch_size,
            weight_decay=t.weight_decay, wsd_decay_steps=t.wsd_decay_steps or max(1, decay_steps // 10),
        )
        self.num_microbatches = plan.grad_accumulation(global_batch_size=t.global_batch_size, micro_batch_size=t.micro_batch_size)
        if self.fp8_kernels is not None and self.num_microbatches > 1:
            # NOTE: every micro-batch of a step sees the same weights: quantize each once per step (the cache is
            # this job's FP8 op's own; an op without one quantizes every micro-batch)
            self._fp8_cache = getattr(self.fp8_kernels.linear, "weight_cache", None)
            if self._fp8_cache is not None:
                self._fp8_cache.enabled = True
        dp = dict(dp_size=mpu.get_data_parallel_world_size(), dp_rank=mpu.get_data_parallel_rank())
        if encoder_side:  # NOTE: the language model's data-parallel ranks this encoder rank serves
            dp = dict(dp_size=plan.dp, dp_rank=self.sets.dp_ranks_of(dist.get_rank())[0])
        self.balancer, self.cost_fit = None, None  # data.balance: the fit is made on the first steps this run takes
        if recipe.data.balance:
            from loongforge.parallel.balance import LoadBalancer

            self.balancer = LoadBalancer()
        self.schedule = BatchSchedule(self.data.train, global_batch_size=t.global_batch_size,
                                      micro_batch_size=t.micro_batch_size, workers=recipe.data.num_workers,
                                      steps=t.steps, balancer=self.balancer, **dp)
        self.encoder_client = self.encoder_server = None
        if encoder_side:
            from loongforge_megatron.engine.encoder_ranks import EncoderServer

            schedules = {r: BatchSchedule(self.data.train, global_batch_size=t.global_batch_size,
                                          micro_batch_size=t.micro_batch_size, workers=recipe.data.num_workers,
                                          steps=t.steps, dp_size=plan.dp, dp_rank=r)
                         for r in self.sets.dp_ranks_of(dist.get_rank())[1:]}
            self.encoder_server = EncoderServer(self.model, self.sets, {dp["dp_rank"]: self.schedule, **schedules},
                                                trains=tower)
        elif self.sets is not None:
            from loongforge_megatron.engine.encoder_ranks import EncoderClient

            self.encoder_client = EncoderClient(self.model, self.sets, trains=tower)
        self.valid_schedule = (BatchSchedule(self.data.valid, global_batch_size=t.global_batch_size,
                                             micro_batch_size=t.micro_batch_size, **dp)
                               if self.data.valid is not None else None)
        self.flops_per_token = arch.flops_per_token(self.seq_length)
        self.router_load = None
        if arch.is_moe:
            from loongforge_megatron.engine.router_load import RouterLoad

            # NOTE: tokens are seen again by every TP rank without SP, and by the recompute of full recompute.
            repeat = (plan.tp if plan.tp > 1 and not plan.sp else 1) * (2 if plan.recompute == "full" else 1)
            self.router_load = RouterLoad(self.chunks, num_layers=arch.num_layers, num_experts=arch.num_experts,
                                          ep=plan.ep, device=self.device, repeat=repeat)
        self.replicas = None
        if arch.is_moe and recipe.model.moe.replica_slots_per_rank:
            from loongforge_megatron.moe.replicas import ReplicaSchedule

            self.replicas = ReplicaSchedule(
                self.chunks, num_layers=arch.num_layers, num_experts=arch.num_experts, ep=plan.ep,
                slots_per_rank=arch.num_experts // plan.ep + recipe.model.moe.replica_slots_per_rank,
                interval=recipe.model.moe.replica_interval)
        self.moe_trace = None
        if self.router_load is not None and recipe.logging.moe_trace and self.runtime.is_main:
            from loongforge_megatron.moe.trace import TraceWriter

            self.moe_trace = TraceWriter(self.runtime.output_dir, ep_size=plan.ep)
        self.peak_flops = self.acc.peak_flops(self.config.params_dtype)
        self.ema = None
        if t.ema_decay:
            from loongforge_megatron.engine.ema import ModelEMA

            self.ema = ModelEMA(self.chunks, t.ema_decay)  # NOTE: from the initial (or loaded) weights
        self.checkpointer = self._checkpointer()
        from loongforge.failures import NonFiniteGuard

        self.nonfinite = NonFiniteGuard(skip=recipe.train.skip_nonfinite, checkpoint_dir=self.runtime.checkpoint_dir,
                                        log=self.log)

    def _resume(self) -> None:
        """Resume from the run's latest checkpoint, then agree that every rank is ready (a rank that failed joins
        the check, so its peers stop too instead of waiting for it in their first collective)."""
        from loongforge.failures import agree

        recipe, plan, arch, spec = self.recipe, self.plan, self.arch, self.spec
        error = None
        try:
            if recipe.checkpoint.resume == "auto":
                self.step_index = self.checkpointer.resume()
        except Exception as exc:  # noqa: BLE001 - re-raised by agree() on this rank
            error = exc
        agree(error, phase="resume")
        if self.log:
            n = arch.num_params()
            split = "" if plan.first_stage_layers is None and plan.last_stage_layers is None else (
                f" (first {plan.first_stage_layers or '-'} / last {plan.last_stage_layers or '-'} layers)")
            self.log.info(f"[megatron] {spec.name} {n / 1e6:.1f}M params | spec {self.kernels} | tp {plan.tp} pp {plan.pp}"
                          f"{split} vpp {plan.vpp} cp {plan.cp} ep {plan.ep} dp {plan.dp} | {self.num_microbatches} micro-batches/step"
                          f" | {self.acc.describe()}" + (f" | resumed at step {self.step_index}" if self.step_index else ""))

    def _fp8_kernels(self):
        """``train.fp8``'s ops from the kernel registry, refused before anything is built where they cannot run
        (the registry's FP8 GEMMs: CUDA, compute capability >= 8.9, blockwise on Hopper). The recipe conflicts
        (``kernels.layers te``, ``train.compile``) are refused at validate."""
        from loongforge_megatron.layers.fp8 import Fp8Kernels

        fp8 = self.recipe.train.fp8
        kernels = Fp8Kernels.select(fp8, provider=self.recipe.kernels.provider, device_type=self.acc.device_type,
                                    accelerator=self.acc)
        reason = kernels.linear.unavailable_reason(self.acc.device())
        if reason:
            raise RecipeError(f"train.fp8 recipe {fp8.recipe}: {reason}", key="train.fp8")
        return kernels

    def _checkpointer(self):
        """Resumable checkpoints of this run, with the HF / PEFT exports its save format asks for."""
        import functools

        from loongforge_megatron.checkpointing import Checkpointer, layout_record
        from loongforge_megatron.hf_io import export_hf, export_peft

        c, runtime = self.recipe.checkpoint, self.runtime
        model = dict(spec=self.spec, arch=self.arch, plan=self.plan, whole=self.whole_components, ema=self.ema,
                     log=self.log)
        exports = {"hf": functools.partial(export_hf, self.chunks, assets=self.data.assets, **model),
                   "peft": functools.partial(export_peft, self.chunks, lora=self.recipe.train.lora if self.lora else None,
                                             base_model=self.recipe.model.hf, **model)}
        return Checkpointer(
            root=runtime.checkpoint_dir, chunks=self.chunks, optimizer=self.optimizer, scheduler=self.scheduler,
            accelerator=self.acc, layout=layout_record(self.plan, num_layers=self.arch.num_layers,
                                                       whole=self.whole_components, sets=self.sets),
            save_format=tuple(c.save_format), save_interval=c.save_interval, keep_last=c.keep_last, ema=self.ema,
            router_load=self.router_load, exports=exports,
            final_dirs={"hf": runtime.hf_dir, "peft": runtime.output_dir / "peft"}, log=self.log)

    def export(self, kind: str, out_dir: str | Path) -> Path | None:
        """Write the model now as ``kind`` (``hf``: HF / diffusers weights, LoRA merged; ``peft``: the LoRA
        adapters) into ``out_dir`` (all ranks call it; rank 0 writes)."""
        return self.checkpointer.exports[kind](Path(out_dir))

    # ------------------------------------------------------------------ running
    def step(self) -> dict[str, float]:
        try:
            return self._step()
        except BaseException as exc:
            self._failed = not raised_on_every_rank(exc)
            raise

    def _step(self) -> dict[str, float]:
        from loongforge_megatron import engine

        t0 = time.perf_counter()
        if self.encoder_server is not None:
            return self._finish_step(t0, [], self.encoder_server.train_step(
                self.step_index, optimizer=self.optimizer, scheduler=self.scheduler,
                global_batch_size=self.recipe.train.global_batch_size, device=self.device))
        batches = self.schedule.microbatches(self.step_index, device=self.device)
        forward_step_fn = self.forward_step_fn
        if self.before_step is not None:
            self.before_step(self.step_index, self.optimizer)
        if self.balancer is not None:
            if self.cost_fit is None:
                from loongforge_megatron.engine.cost_fit import WarmupCostFit

                self.cost_fit = WarmupCostFit(self.balancer, synchronize=self.acc.synchronize,
                                              first_step=self.step_index)
            forward_step_fn = self.cost_fit.forward_step(forward_step_fn or engine.forward_step, step=self.step_index)
        out = engine.train_step(
            model_chunks=self.model, optimizer=self.optimizer, scheduler=self.scheduler, data_iterator=iter(batches),
            num_microbatches=self.num_microbatches, seq_length=self.seq_length,
            micro_batch_size=self.recipe.train.micro_batch_size, forward_step_fn=forward_step_fn,
            loss_key=self.loss_key,
            before_grad_reduce=self.replicas.reduce_grads if self.replicas is not None else None,
            remote_encoder=self.encoder_client,
        )
        return self._finish_step(t0, batches, out)

    def _finish_step(self, t0: float, batches: list, out: dict[str, Any]) -> dict[str, float]:
        """The step's metrics after ``engine.train_step`` (``batches``: this rank's micro-batches)."""
        if self._fp8_cache is not None:
            self._fp8_cache.invalidate()  # the optimizer changed the weights
        if self.ema is not None and not out.get("skipped"):
            self.ema.update()
        self.acc.synchronize()
        dt = time.perf_counter() - t0
        self.step_index += 1
        self.nonfinite.check(self.step_index, loss=out["loss"], grad_norm=out.get("grad_norm"),
                             nonfinite=bool(out.get("nonfinite")))
        tokens = self.recipe.train.global_batch_size * self.seq_length
        metrics: dict[str, Any] = {"loss": out["loss"], "lr": out["lr"], "step_time": dt, "tokens_per_s": tokens / dt}
        real = [b["real_tokens"] for b in batches if isinstance(b, dict) and "real_tokens" in b]
        if real:  # SFT: this rank's sample tokens / the capacity of its micro-batches (the rest is padding)
            capacity = len(batches) * self.recipe.train.micro_batch_size * self.seq_length
            metrics["packing_efficiency"] = sum(real) / capacity
        if batches and isinstance(batches[0], dict) and "dp_imbalance" in batches[0]:
            metrics["dp_imbalance_before"], metrics["dp_imbalance_after"] = batches[0]["dp_imbalance"]
        if self.cost_fit is not None and self.cost_fit.after_step(self.step_index):
            self.schedule.close()  # NOTE: workers made the coming steps with the old model: make them again
            metrics.update({f"balance_cost_{k}": getattr(self.cost_fit.fitted, k) for k in "abcv"})
        if self.timed_encoder:  # NOTE: collective: every rank, towers or not (later pipeline stages hold none)
            from loongforge_megatron.engine.encoder_split import encoder_times

            for r, (seconds, _) in encoder_times(self.chunks, device=self.device).items():
                metrics[f"encoder_time_r{r}"] = seconds
        if self.data.sample_unit:  # e.g. an image model's images (its tokens are latent patches)
            metrics[f"{self.data.sample_unit}_per_s"] = self.recipe.train.global_batch_size / dt
        if out.get("grad_norm") is not None:
            metrics["grad_norm"] = out["grad_norm"]
        if self.step_metrics is not None:
            metrics.update(self.step_metrics())
        metrics.update(self.nonfinite.metrics())
        if getattr(self.config, "mtp_num_layers", None):
            from loongforge_megatron.engine.mtp import collect_mtp_loss

            depths = collect_mtp_loss(num_microbatches=self.num_microbatches)
            if depths:
                metrics["mtp_loss"] = sum(depths) / len(depths)
        if self.router_load is not None:
            load = self.router_load.collect()
            metrics["moe_expert_imbalance"] = load["max_expert"]
            if self.plan.ep > 1:
                metrics["moe_ep_imbalance"] = load["max_ep"]
            if self.moe_trace is not None:
                self.moe_trace.write(self.step_index, self.router_load.last.tolist())
            if self.replicas is not None:
                metrics.update(self.replicas.metrics())
                self.replicas.after_step(self.step_index, self.router_load.last)
        every = self.recipe.train.eval_interval
        if every and self.valid_schedule is not None and (self.step_index % every == 0 or self.step_index == self.recipe.train.steps):
            metrics["val_loss"] = self.evaluate()
        if self.peak_flops:
            metrics["mfu"] = self.flops_per_token * tokens / dt / (self.peak_flops * self.runtime.plan.world_size)
        mem = self.acc.memory_stats().get("peak_allocated")
        if mem:
            metrics["peak_mem_gib"] = mem / 2**30
        if self.log:
            self.log.log(self.step_index, metrics)
        return metrics

    def evaluate(self) -> float:
        """Validation loss over ``train.eval_steps`` global batches of the validation split (forward only)."""
        from loongforge_megatron import engine

        t = self.recipe.train
        index = self.step_index // (t.eval_interval or 1)  # a function of the step, so resume sees the same batches
        batches = []
        for k in range(t.eval_steps):
            batches += self.valid_schedule.microbatches(index * t.eval_steps + k, device=self.device)
        return engine.evaluate(model_chunks=self.model, data_iterator=iter(batches), num_microbatches=len(batches),
                               seq_length=self.seq_length, micro_batch_size=t.micro_batch_size,
                               forward_step_fn=self.forward_step_fn)

    def run(self) -> dict[str, Any]:
        try:
            return self._run()
        except BaseException as exc:
            self._failed = not raised_on_every_rank(exc)
            raise

    def _run(self) -> dict[str, Any]:
        c = self.recipe.checkpoint
        last: dict[str, Any] = {}
        while self.step_index < self.recipe.train.steps:
            last = self.step()
            if c.save_interval and self.step_index % c.save_interval == 0 and self.step_index < self.recipe.train.steps:
                self.checkpointer.save(self.step_index)
        if c.save_at_end:
            self.checkpointer.save(self.step_index, final=True)
        if self.router_load is not None and self.runtime.is_main:
            self._write_router_load()
        return {"step": self.step_index, **last}

    def _write_router_load(self) -> None:
        """``moe_imbalance.json`` in the run directory: per-layer imbalance and tokens per expert over the run."""
        import json

        from loongforge.checkpoint.atomic import write_atomic

        # NOTE: a resume restores the counts saved with the checkpoint; first_step says where they start.
        steps = {"first_step": self.router_load.first_step, "last_step": self.step_index}
        write_atomic(self.runtime.output_dir / "moe_imbalance.json",
                     json.dumps({"ep_size": self.plan.ep, **steps, **self.router_load.summary()}))

    def close(self) -> None:
        from loongforge_megatron import engine

        try:
            if dist.is_initialized():
                if getattr(self, "checkpointer", None) is not None and not getattr(self, "_failed", False):
                    # NOTE: a built job tears down only when every rank is done: a rank destroying its gloo group
                    # while a peer still talks to it aborts the peer at exit ("terminate called without an
                    # active exception"). A job that failed skips this: its peers may be in another collective
                    # (they stop when its connections close, or at the launcher's signal).
                    dist.barrier()
                engine.destroy(process_group=True)
        finally:
            if getattr(self, "schedule", None) is not None:
                self.schedule.close()
            if getattr(self, "encoder_server", None) is not None:
                for schedule in self.encoder_server.schedules.values():
                    schedule.close()
            if getattr(self, "_fp8_cache", None) is not None:
                self._fp8_cache.invalidate()  # NOTE: frees the FP8 weight copies now, not when the job is collected
            if self._adaptations is not None:
                self._adaptations.__exit__(None, None, None)
                self._adaptations = None
