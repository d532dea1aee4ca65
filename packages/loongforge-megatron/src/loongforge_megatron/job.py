"""The megatron training job: builds model, data and optimizer for this rank and runs the step loop.

The loop itself is megatron-core's (``engine.train_step`` wraps ``get_forward_backward_func``); this module only
wires the recipe to it: device adaptations, initial weights (an HF directory), LoRA, resume,
metrics, checkpoints and the HF export.
"""

from __future__ import annotations

import functools
import importlib.util
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from loongforge.backend import Job
from loongforge.checkpoint import padded_vocab_size
from loongforge.errors import CheckpointError, RecipeError

if TYPE_CHECKING:
    from loongforge.recipe.schema import Recipe
    from loongforge.runtime import Runtime

# Vocabulary padding for TP: pad only to a multiple of tp, so logits over the real vocabulary equal an
# unpadded model's (padded rows would otherwise join the softmax).
VOCAB_DIVISIBLE_BY = 1


def class_labels_json(names: list[str]) -> str:
    """``{"id2label": {"0": name, ...}}``: the label ids a class-conditional model was trained with."""
    import json

    return json.dumps({"id2label": {str(i): n for i, n in enumerate(names)}}, indent=1)


class MegatronJob(Job):
    """One rank's job. Create inside a process group-capable runtime (``Runtime.create``)."""

    def __init__(self, recipe: Recipe, runtime: Runtime):
        from loongforge_megatron import engine
        from loongforge_megatron.device_adapters import adapted

        self.recipe, self.runtime = recipe, runtime
        self.acc, self.plan = runtime.accelerator, runtime.plan
        self.arch = recipe.model.arch()
        self.log = runtime.logger
        self.step_index = 0  # optimizer steps done
        # megatron-name prefixes of components every TP rank holds whole (parallel.components.<name>.tp: 1)
        self.whole_components: tuple[str, ...] = ()
        model_adaptations = []
        if self.arch.is_vlm:
            from loongforge_megatron.engine.llava_adaptation import clip_adaptations

            model_adaptations = clip_adaptations(cpu=self.acc.device_type == "cpu")
        self._adaptations = adapted(self.acc, grad_accum_fusion=recipe.kernels.grad_accum_fusion,
                                    model=model_adaptations)
        self._adaptations.__enter__()
        self._failed = False  # a failed job tears down without waiting for its peers (close)
        try:
            runtime.init_distributed()
            engine.initialize(self.plan, accelerator=self.acc, seed=recipe.train.seed)
            self._build()
            self._resume()
        except BaseException as exc:
            self._failed = not _agreed(exc)
            self.close()
            raise

    # ------------------------------------------------------------------ building
    def _build(self) -> None:
        from megatron.core import parallel_state as mpu

        from loongforge_megatron import engine
        from loongforge_megatron.data.datasets import BatchSchedule, build_dataset
        from loongforge_megatron.models.translate import transformer_config

        recipe, plan, arch = self.recipe, self.plan, self.arch
        if recipe.train.fp8 is not None:  # NOTE: before the data is prepared or the model built
            self._check_fp8()
        self.tokenizer = None if arch.is_dit else self._tokenizer()
        if self.tokenizer is not None and len(self.tokenizer) > arch.vocab_size:
            raise RecipeError(f"tokenizer has {len(self.tokenizer)} tokens but the model's vocab_size is {arch.vocab_size}",
                              key="model.vocab_size")
        self.device = self.acc.device()
        cpu = self.acc.device_type == "cpu"
        self.precision = self.acc.resolve_precision(recipe.train.precision)
        # what one sample is made of, for the schedules and the throughput metrics: tokens, or a DiT's latent patches
        self.seq_length = arch.num_patches if arch.is_dit else recipe.data.seq_length
        self.loss_key = "lm loss"
        if arch.is_dit:
            self._build_dit()
        else:
            self.config = transformer_config(arch, plan=plan, precision=self.precision,
                                             cpu_init=cpu or recipe.model.init_on_cpu,
                                             grad_accum_fusion=recipe.kernels.grad_accum_fusion)
            # NOTE: LLaVA has no TransformerEngine path here: auto (and te, refused by the backend) mean ours.
            self.spec_name = ("local" if recipe.kernels.spec == "local" else "loongforge") if arch.is_vlm \
                else self._spec_name()
            self.vocab_size = padded_vocab_size(arch.vocab_size, divisible_by=VOCAB_DIVISIBLE_BY, tp_size=plan.tp)
            if arch.is_vlm:
                self._build_vlm()
            else:
                self._build_lm()
        t = recipe.train
        self.optimizer = engine.build_optimizer(
            self.model, lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay, betas=(t.adam_beta1, t.adam_beta2),
            eps=t.adam_eps, clip_grad=t.grad_clip, bf16=self.precision == "bf16", fp16=self.precision == "fp16",
            use_distributed_optimizer=plan.distributed_optimizer, optimizer="adam" if t.optimizer == "adamw" else "sgd",
        )
        decay_steps = t.decay_steps or t.steps
        self.scheduler = engine.build_scheduler(
            self.optimizer, lr=t.lr, min_lr=t.min_lr, warmup_steps=t.warmup_steps, decay_steps=decay_steps,
            # NOTE: megatron spells it "WSD"; the final decay defaults to a tenth of the schedule (as embodied's)
            decay_style="WSD" if t.lr_schedule == "wsd" else t.lr_schedule, global_batch_size=t.global_batch_size,
            weight_decay=t.weight_decay, wsd_decay_steps=t.wsd_decay_steps or max(1, decay_steps // 10),
        )
        self.num_microbatches = plan.grad_accumulation(global_batch_size=t.global_batch_size, micro_batch_size=t.micro_batch_size)
        num_valid = (t.steps // t.eval_interval + 1) * t.eval_steps * t.global_batch_size if t.eval_interval else None
        if arch.is_dit:
            dataset, valid = self._latents, None
        elif arch.is_vlm and recipe.data.format == "llava":
            from loongforge_megatron.engine.llava import ImageTextConversations

            dataset, valid = ImageTextConversations(recipe.data.path, tokenizer=self.tokenizer, arch=arch,
                                                    seq_length=recipe.data.seq_length,
                                                    processor_dir=recipe.model.hf or recipe.checkpoint.load
                                                    or recipe.data.tokenizer, seed=t.seed), None
        elif arch.is_vlm:
            from loongforge_megatron.engine.llava import SyntheticImageText

            dataset, valid = SyntheticImageText(arch=arch, seq_length=recipe.data.seq_length, seed=t.seed), None
        else:
            dataset, valid = build_dataset(recipe, tokenizer=self.tokenizer, vocab_size=arch.vocab_size,
                                           num_samples=t.steps * t.global_batch_size, num_valid=num_valid)
        dp = dict(dp_size=mpu.get_data_parallel_world_size(), dp_rank=mpu.get_data_parallel_rank())
        self.schedule = BatchSchedule(dataset, global_batch_size=t.global_batch_size, micro_batch_size=t.micro_batch_size, **dp)
        self.valid_schedule = (BatchSchedule(valid, global_batch_size=t.global_batch_size,
                                             micro_batch_size=t.micro_batch_size, **dp) if valid is not None else None)

        self.forward_step_fn = None
        if arch.is_dit:
            from loongforge_megatron.engine import dit

            self.forward_step_fn = functools.partial(dit.forward_step, scheduler=dit.noise_scheduler(),
                                                     encoder=self.encoder)
            self.loss_key = dit.LOSS_KEY
        elif arch.is_vlm:
            from loongforge_megatron.engine.llava import forward_step

            self.forward_step_fn = forward_step
        elif self.spec_name == "loongforge":
            from loongforge_megatron.spec.output import forward_step_with_fused_loss

            self.forward_step_fn = forward_step_with_fused_loss(provider=recipe.kernels.provider, accelerator=self.acc)
        self.flops_per_token = arch.flops_per_token(self.seq_length)
        self.router_load = None
        if arch.is_moe:
            from loongforge_megatron.engine.router_load import RouterLoad

            # NOTE: tokens are seen again by every TP rank without SP, and by the recompute of full recompute.
            repeat = (plan.tp if plan.tp > 1 and not plan.sp else 1) * (2 if plan.recompute == "full" else 1)
            self.router_load = RouterLoad(unwrapped(self), num_layers=arch.num_layers, num_experts=arch.num_experts,
                                          ep=plan.ep, device=self.device, repeat=repeat)
        self.peak_flops = self.acc.peak_flops(self.config.params_dtype)
        self.ema = None
        if t.ema_decay:
            from loongforge_megatron.engine.ema import ModelEMA

            self.ema = ModelEMA(unwrapped(self), t.ema_decay)  # NOTE: from the initial (or loaded) weights
        from loongforge_megatron.checkpointing import Checkpointer
        from loongforge_megatron.nonfinite import NonFiniteGuard

        self.checkpointer = Checkpointer(self)
        self.nonfinite = NonFiniteGuard(recipe, checkpoint_dir=self.runtime.checkpoint_dir, log=self.log)
        self._router_first_step = 1  # the first step moe_imbalance.json covers (a resume restores it)

    def _resume(self) -> None:
        """Resume from the run's latest checkpoint, then agree that every rank is ready (a rank that failed joins
        the check, so its peers stop too instead of waiting for it in their first collective)."""
        from loongforge_megatron.rank_status import all_ranks_ok

        recipe, plan, arch = self.recipe, self.plan, self.arch
        error = None
        try:
            if recipe.checkpoint.resume == "auto":
                self.step_index = self.checkpointer.resume()
                if self.router_load is not None and self.router_load.total.sum() == 0:
                    self._router_first_step = self.step_index + 1  # a checkpoint without router counts
        except Exception as exc:  # noqa: BLE001 - re-raised by all_ranks_ok on this rank
            error = exc
        try:
            all_ranks_ok(error, what="resuming")
        except BaseException as exc:
            _mark_agreed(exc)
            raise
        if self.log:
            n = arch.num_params()
            split = "" if plan.first_stage_layers is None and plan.last_stage_layers is None else (
                f" (first {plan.first_stage_layers or '-'} / last {plan.last_stage_layers or '-'} layers)")
            self.log.info(f"[megatron] {'llava' if arch.is_vlm else arch.family} {n / 1e6:.1f}M params | spec {self.spec_name} | tp {plan.tp} pp {plan.pp}"
                          f"{split} vpp {plan.vpp} cp {plan.cp} ep {plan.ep} dp {plan.dp} | {self.num_microbatches} micro-batches/step"
                          f" | {self.acc.describe()}" + (f" | resumed at step {self.step_index}" if self.step_index else ""))

    def _build_lm(self) -> None:
        from loongforge_megatron import engine

        arch, plan = self.arch, self.plan
        self.model = engine.build_model(
            transformer_config=self.config,
            layer_spec=self._layer_spec(),
            vocab_size=self.vocab_size,
            max_sequence_length=max(arch.max_position_embeddings, self.recipe.data.seq_length),
            rotary_base=arch.rope_theta,
            share_embeddings_and_output_weights=arch.tie_embeddings,
            vpp=plan.vpp,
            use_distributed_optimizer=plan.distributed_optimizer,
            device=self.device,
            rope_scaling_factor=arch.rope_scaling_factor,
            position_embedding_type="yarn" if arch.rope_yarn and not arch.is_mla else "rope",
            pre_wrap=self._before_ddp,
        )

    def _build_dit(self) -> None:
        """DiT: megatron TransformerBlock of adaLN-Zero layers (``engine/dit.py``). The data comes first, so a bad
        image folder or VAE fails before the model is built."""
        from loongforge_megatron.data.latents import build_latents
        from loongforge_megatron.engine import dit

        self._latents, self.encoder = build_latents(self.recipe, arch=self.arch, device=self.device)
        # NOTE: an image folder's class names (sorted sub-folders = labels 0..n-1): written as OUTPUT/classes.json
        # and into every export, so samples can be asked for by name (DiTPipeline's id2label)
        self.class_names = getattr(self._latents, "classes", None)
        if self.class_names and self.runtime.is_main:
            from loongforge.checkpoint.atomic import write_atomic

            write_atomic(self.runtime.output_dir / "classes.json", class_labels_json(self.class_names))
        self.config = dit.transformer_config(self.arch, plan=self.plan, precision=self.precision,
                                             grad_accum_fusion=self.recipe.kernels.grad_accum_fusion)
        self.spec_name = "local" if self.recipe.kernels.spec == "local" else "loongforge"
        self.model = dit.build_dit(
            config=self.config, arch=self.arch, device=self.device, use_distributed_optimizer=self.plan.distributed_optimizer,
            attention="local" if self.spec_name == "local" else "sdpa", pre_wrap=self._before_ddp,
            compile_mode=self.recipe.train.compile_mode if self.recipe.train.compile else None)

    def _build_vlm(self) -> None:
        """LLaVA: megatron's LLaVAModel (``engine.llava.layer_specs``); initial HF weights are loaded before DDP
        wraps it."""
        from loongforge_megatron.engine.llava import VISION_PREFIXES, build_llava

        if self.plan.component("vision").tp == 1 and self.plan.tp > 1:
            self.whole_components = VISION_PREFIXES
        self.model = build_llava(
            language=self.config, arch=self.arch, vocab_size=self.vocab_size,
            # NOTE: under pipeline parallelism LLaVAModel pads every combined sequence to this length (fixed p2p
            # shapes); data.seq_length is already the length after the image tokens expand
            max_sequence_length=self.recipe.data.seq_length if self.plan.pp > 1 else max(
                self.arch.max_position_embeddings, self.recipe.data.seq_length),
            device=self.device, use_distributed_optimizer=self.plan.distributed_optimizer,
            pre_wrap=self._before_ddp, spec=self.spec_name, provider=self.recipe.kernels.provider, accelerator=self.acc,
            whole_vision=bool(self.whole_components))

    def _before_ddp(self, chunks: list[torch.nn.Module]) -> None:
        """Initial weights and LoRA adapters go in before megatron DDP builds its grad buffers."""
        recipe = self.recipe
        self._unwrapped = chunks
        if recipe.checkpoint.load:
            self._load_initial(recipe.checkpoint.load)
        self.lora = None
        if recipe.train.stage == "lora":
            from loongforge_megatron.lora import apply_lora

            self.lora = apply_lora(chunks, recipe.train.lora, seed=recipe.train.seed)
        if recipe.train.fp8 is not None:
            from loongforge_megatron.spec.fp8 import apply_fp8

            fp8 = recipe.train.fp8
            tokens = recipe.train.micro_batch_size * self.seq_length // self.plan.cp
            n8, n = apply_fp8(chunks, fp8, tokens=tokens)
            if self.runtime.is_main:
                self.log.info(f"[megatron] train.fp8 {fp8.recipe} (grads {fp8.grad_dtype}): {n8} of {n} GEMMs run in FP8"
                              + (f" (policy {fp8.policy})" if fp8.policy else ""))

    def _check_fp8(self) -> None:
        """``train.fp8`` needs FP8 tensor cores (CUDA, compute capability >= 8.9; blockwise: Hopper) and ours or
        megatron's local spec (TransformerEngine's layers have their own FP8, not wired here)."""
        fp8 = self.recipe.train.fp8
        if self.acc.device_type != "cuda":
            raise RecipeError(f"train.fp8 needs CUDA GPUs with FP8 tensor cores (compute capability 8.9+); this run is "
                              f"on {self.acc.device_type}", key="train.fp8")
        from loongforge_kernels.fp8_linear import fp8_unavailable_reason

        reason = fp8_unavailable_reason(fp8.recipe, self.acc.device())
        if reason:
            raise RecipeError(f"train.fp8 recipe {fp8.recipe}: {reason}", key="train.fp8")
        if getattr(self, "spec_name", None) == "te" or self.recipe.kernels.spec == "te":
            raise RecipeError("train.fp8 runs on the loongforge or local spec (kernels.spec te has TransformerEngine's "
                              "own FP8, not wired here)", key="train.fp8")
        if self.recipe.train.compile:
            raise RecipeError("train.fp8 cannot be used with train.compile yet (the FP8 linears launch Triton kernels "
                              "from an autograd function); use one of them", key="train.fp8")

    def _spec_name(self) -> str:
        """auto: TransformerEngine's spec when TE is installed and the recipe neither loads / exports HF weights nor
        packs SFT sequences (``backend.te_incompatible``), else ours (SDPA + fused kernels)."""
        from loongforge_megatron.backend import te_incompatible

        spec = self.recipe.kernels.spec
        if spec == "te" and importlib.util.find_spec("transformer_engine") is None:
            # NOTE: checked here, not at validate: a recipe for a TE machine still validates on a laptop
            raise RecipeError("kernels.spec te needs TransformerEngine, which is not installed here; use kernels.spec "
                              "loongforge (or auto)", key="kernels.spec")
        if spec != "auto":
            return spec
        if te_incompatible(self.recipe):
            return "loongforge"
        try:
            import transformer_engine  # noqa: F401

            return "te"
        except ImportError:
            return "loongforge"

    def _grouped_experts(self) -> bool:
        """``kernels.moe_grouped_gemm``; unset: grouped on the loongforge spec when grouped_mm runs the expert
        shapes in this precision on this device, and the stage is not LoRA (its adapters wrap per-expert linears)."""
        from loongforge_megatron.spec.grouped_experts import grouped_mm_supported

        arch, want = self.arch, self.recipe.kernels.moe_grouped_gemm
        if not arch.is_moe or want is False:
            return False
        ffn = (arch.moe_ffn_hidden_size or arch.ffn_hidden_size) // self.plan.etp
        ok = grouped_mm_supported(device_type=self.acc.device_type, dtype=self.config.params_dtype,
                                  hidden_size=arch.hidden_size, ffn_size=ffn)
        if want is None:
            return ok and self.spec_name == "loongforge" and self.recipe.train.stage != "lora"
        if not ok:
            raise RecipeError(f"kernels.moe_grouped_gemm: torch grouped_mm does not run experts of hidden "
                              f"{arch.hidden_size} / ffn {ffn} in {self.precision} on {self.acc.device_type} (it needs "
                              "bf16 on CUDA sm80+, or the CPU, and rows of a multiple of 16 bytes); set it false",
                              key="kernels.moe_grouped_gemm")
        return True

    def _permute_dispatch(self, *, grouped: bool) -> bool:
        """``model.moe_token_dispatcher`` permute (auto: where it applies): our fused, sync-free dispatch."""
        arch, plan = self.arch, self.plan
        want = arch.moe_token_dispatcher if arch.is_moe else "alltoall"
        if want not in ("auto", "permute"):
            return False
        why = ("ep > 1" if plan.ep > 1 else f"expert tp {plan.etp}" if plan.etp > 1 else
               "experts padded to capacity (moe_pad_to_capacity)" if arch.moe_pad_to_capacity else
               "SequentialMLP experts (it folds the probabilities into the combine; kernels.moe_grouped_gemm)"
               if not grouped else None)
        if want == "permute" and why:
            raise RecipeError(f"model.moe_token_dispatcher permute runs every expert on one rank, unpadded, with grouped "
                              f"experts; this run has {why}: use alltoall", key="model.moe_token_dispatcher")
        return why is None

    def _layer_spec(self):
        from loongforge_megatron import engine

        arch = self.arch
        kw = dict(num_experts=arch.num_experts, qk_layernorm=arch.qk_norm, multi_latent_attention=arch.is_mla)
        if self.spec_name == "local":
            kw["moe_grouped_gemm"] = self._grouped_experts()
        if self.spec_name != "loongforge":
            if arch.is_moe and arch.moe_token_dispatcher == "permute":
                raise RecipeError(f"model.moe_token_dispatcher permute is part of the loongforge spec, not "
                                  f"kernels.spec {self.spec_name}", key="model.moe_token_dispatcher")
            return engine.layer_spec(self.spec_name, **kw)
        kw["moe_grouped_gemm"] = self._grouped_experts()
        kw["moe_permute_dispatch"] = self._permute_dispatch(grouped=kw["moe_grouped_gemm"])
        kw["moe_router_fusion"] = arch.is_moe and self.recipe.kernels.moe_router_fusion
        from megatron.core.transformer.spec_utils import ModuleSpec
        from megatron.core.transformer.transformer_block import (
            TransformerBlockSubmodules,
            get_num_layers_to_build,
        )
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        from loongforge_megatron.spec import KernelRMSNorm, loongforge_layer_spec, prepare_config

        prepare_config(self.config)
        provider = self.recipe.kernels.provider
        moe = loongforge_layer_spec(provider=provider, accelerator=self.acc, **kw)
        dense = loongforge_layer_spec(provider=provider, accelerator=self.acc, **{**kw, "num_experts": None}) if arch.is_moe else moe
        freq = self.config.moe_layer_freq if arch.is_moe else None
        final_norm = ModuleSpec(module=KernelRMSNorm, params={"provider": provider, "accelerator": self.acc})

        def block(vp_stage: int | None):
            # NOTE: a full block spec so the final norm is ours too (megatron's default final norm refuses SP),
            # with dense layers where moe_layer_freq says so (DeepSeek's first_k_dense_replace).
            offset = get_transformer_layer_offset(self.config, vp_stage=vp_stage)
            n = get_num_layers_to_build(self.config, vp_stage=vp_stage)
            layers = [moe if not isinstance(freq, list) or freq[offset + i] else dense for i in range(n)]
            return TransformerBlockSubmodules(layer_specs=layers, layer_norm=final_norm)

        return block

    def _tokenizer(self):
        from loongforge_megatron.data.prepare import is_prepared, prepare, tokenizer_dir
        from loongforge_megatron.data.tokenizer import load_tokenizer

        data = self.recipe.data
        if data.format == "synthetic":
            return None
        if data.format != "llava" and data.path and not is_prepared(data.path):  # llava: a records file as is
            if self.runtime.is_main:
                prepare(self.recipe)
            dist.barrier()
        path = tokenizer_dir(self.recipe)
        if path is None:
            raise RecipeError("no tokenizer found: set data.tokenizer or model.hf", key="data.tokenizer")
        return load_tokenizer(path)

    def _load_initial(self, path: str) -> None:
        """Initial weights from an HF directory (each rank reads only its shards)."""
        from loongforge_megatron.hf_io import load_hf_into

        src = Path(path)
        if (src / "config.json").is_file():
            load_hf_into(self, src)
        else:
            raise CheckpointError(f"checkpoint.load '{path}' is not an HF model directory (no config.json); a run's "
                                  "own checkpoints resume with the same --output, other megatron checkpoints load "
                                  "after `loongforge convert SRC DST --to hf`")

    # ------------------------------------------------------------------ running
    def step(self) -> dict[str, float]:
        try:
            return self._step()
        except BaseException as exc:
            self._failed = not _agreed(exc)
            raise

    def _step(self) -> dict[str, float]:
        from loongforge_megatron import engine

        t0 = time.perf_counter()
        batches = self.schedule.microbatches(self.step_index, device=self.device)
        out = engine.train_step(
            model_chunks=self.model, optimizer=self.optimizer, scheduler=self.scheduler, data_iterator=iter(batches),
            num_microbatches=self.num_microbatches, seq_length=self.seq_length,
            micro_batch_size=self.recipe.train.micro_batch_size, forward_step_fn=self.forward_step_fn,
            loss_key=self.loss_key,
        )
        if self.ema is not None and not out.get("skipped"):
            self.ema.update()
        self.acc.synchronize()
        dt = time.perf_counter() - t0
        self.step_index += 1
        self.nonfinite.check(self.step_index, out)
        tokens = self.recipe.train.global_batch_size * self.seq_length
        metrics: dict[str, Any] = {"loss": out["loss"], "lr": out["lr"], "step_time": dt, "tokens_per_s": tokens / dt}
        if self.arch.is_dit:
            metrics["samples_per_s"] = self.recipe.train.global_batch_size / dt  # images (tokens: latent patches)
        if out.get("grad_norm") is not None:
            metrics["grad_norm"] = out["grad_norm"]
        if self.nonfinite.skipped:
            metrics["skipped_nonfinite"] = self.nonfinite.skipped
        if self.router_load is not None:
            load = self.router_load.collect()
            metrics["moe_expert_imbalance"] = load["max_expert"]
            if self.plan.ep > 1:
                metrics["moe_ep_imbalance"] = load["max_ep"]
        every = self.recipe.train.eval_interval
        if every and self.valid_schedule is not None and (self.step_index % every == 0 or self.step_index == self.recipe.train.steps):
            metrics["val_loss"] = self.evaluate()
        if self.peak_flops:
            metrics["mfu"] = self.flops_per_token * tokens / dt / (self.peak_flops * self.plan.world_size)
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
            self._failed = not _agreed(exc)
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
        steps = {"first_step": self._router_first_step, "last_step": self.step_index}
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
            if self._adaptations is not None:
                self._adaptations.__exit__(None, None, None)
                self._adaptations = None


def _mark_agreed(exc: BaseException) -> None:
    exc._loongforge_all_ranks = True  # NOTE: every rank raises it at the same point, so close() may still wait


def _agreed(exc: BaseException) -> bool:
    """Whether every rank fails with ``exc`` together (an all-ranks check, a non-finite step)."""
    from loongforge_megatron.nonfinite import NonFiniteError

    return isinstance(exc, NonFiniteError) or getattr(exc, "_loongforge_all_ranks", False)


def unwrapped(job: MegatronJob) -> list[torch.nn.Module]:
    """The model chunks (GPTModel, LLaVAModel, DiTModel) inside their DDP wrappers (also before they exist)."""
    if not hasattr(job, "model"):
        return job._unwrapped
    from loongforge_megatron.engine.model import unwrap

    return [unwrap(m) for m in job.model]
