"""The ``embodied`` backend: VLA policies on LeRobot data with a torch-native DDP / ZeRO-1 / FSDP2 / HSDP trainer
(registered in ``loongforge.backends``; never imports megatron)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from loongforge.backend import Backend, Job
from loongforge.errors import RecipeError

from loongforge_embodied.config import (
    COMPONENTS,
    CUDA_GRAPH_MODES,
    DataConfig,
    EmbodiedParallelConfig,
    ModelConfig,
)

if TYPE_CHECKING:
    from loongforge.recipe.schema import Recipe
    from loongforge.runtime import Runtime


class EmbodiedBackend(Backend):
    """Vision-language-action policies trained by flow matching on action chunks."""

    name = "embodied"
    model_schema = ModelConfig
    data_schema = DataConfig
    parallel_schema = EmbodiedParallelConfig
    unused_keys = {
        "parallel.components": "it uses one data-parallel strategy for the whole policy",
        "parallel.etp": "it is data-parallel only (shard with parallel.strategy fsdp2 / hsdp)",
        "parallel.recompute_layers": "parallel.recompute full checkpoints each block the policy declares",
        "train.freeze": "a policy's components are frozen with model.freeze",
    }

    @classmethod
    def check_recipe(cls, recipe: Recipe) -> None:
        p, t = recipe.parallel, recipe.train
        if "peft" in recipe.checkpoint.save_format:
            raise RecipeError("the embodied backend has no LoRA adapters to export; allowed: dist, hf",
                              key="checkpoint.save_format")
        for key in ("tp", "pp", "cp", "ep"):
            if getattr(p, key) != 1:
                raise RecipeError(f"the embodied backend is data-parallel only (got {getattr(p, key)}); "
                                  "shard with parallel.strategy fsdp2 / hsdp instead", key=f"parallel.{key}")
        if p.distributed_optimizer:
            raise RecipeError("use parallel.strategy zero1 for a sharded optimizer in the embodied backend",
                              key="parallel.distributed_optimizer")
        if p.recompute == "selective":
            raise RecipeError("the embodied backend recomputes whole blocks: use none or full", key="parallel.recompute")
        if p.shard_size is not None and p.strategy != "hsdp":
            raise RecipeError(f"shard_size is only used with parallel.strategy hsdp (got '{p.strategy}')",
                              key="parallel.shard_size")
        if t.precision == "fp16":
            raise RecipeError("fp16 needs loss scaling, which the embodied backend does not do; use bf16 or fp32",
                              key="train.precision")
        if t.stage not in ("pretrain", "sft"):
            raise RecipeError(f"train.stage '{t.stage}' is not supported by the embodied backend (pretrain, sft)",
                              key="train.stage")
        if recipe.model.fp8_allgather.enabled and p.strategy not in ("fsdp2", "hsdp"):
            raise RecipeError(f"the delta-FP8 all-gather is an FSDP2 hook: needs parallel.strategy fsdp2 or hsdp "
                              f"(got '{p.strategy}')", key="model.fp8_allgather.enabled")
        if set(recipe.model.freeze) >= set(COMPONENTS):
            raise RecipeError("every component is frozen: nothing to train", key="model.freeze")
        if recipe.model.load and not (Path(recipe.model.load) / "model.safetensors").is_file():
            raise RecipeError(f"'{recipe.model.load}' has no model.safetensors (an exported policy dir)", key="model.load")
        d = recipe.data
        if d.state_key != "observation.state" and recipe.model.policy == "lerobot_pi05":
            raise RecipeError("lerobot_pi05 reads LeRobot's observation.state; data.state_key is for tiny_vla and "
                              "groot", key="data.state_key")
        if d.format == "lerobot" and d.record is None and not (Path(d.root or "") / "meta" / "info.json").is_file():
            what = "does not exist" if not Path(d.root or "").exists() else "is not a LeRobotDataset (no meta/info.json)"
            raise RecipeError(f"'{d.root}' {what}; record one with data.record (loongforge data prepare) or point "
                              "data.root at a local LeRobotDataset v3", key="data.root")
        if d.format == "lerobot":
            from loongforge_embodied.data.record import check_root
            from loongforge_embodied.policies import resolve_arch

            if d.record is not None:
                check_root(d.root)
            resolve_arch(recipe.model, d)  # NOTE: the recorded dataset's cameras and dims against the policy
        if t.eval_interval:
            env = d.eval_env or (d.record.env if d.record else None)
            if env is None:
                raise RecipeError("train.eval_interval runs closed-loop episodes in a simulator: set data.eval_env "
                                  "(e.g. pusht) or record the data with data.record", key="train.eval_interval")
            from loongforge_embodied.eval.envs import env_targets

            if env not in env_targets():
                raise RecipeError(f"unknown environment '{env}'; registered: {', '.join(sorted(env_targets()))}",
                                  key="data.eval_env")
        if recipe.checkpoint.load:
            raise RecipeError("the embodied backend starts from model.load (exported policy) or resumes from "
                              "OUTPUT/checkpoints; checkpoint.load is not used", key="checkpoint.load")

    def validate(self, recipe: Recipe, *, world_size: int) -> None:
        self.check_recipe(recipe)
        fp8 = recipe.train.fp8
        if fp8 is not None and fp8.policy:
            raise RecipeError("train.fp8.policy (per-GEMM-shape FP8) is a megatron-backend setting; the embodied "
                              "backend runs every eligible nn.Linear in FP8: remove train.fp8.policy", key="train.fp8.policy")
        if fp8 is not None and recipe.train.compile:
            raise RecipeError("train.fp8 cannot be used with train.compile yet (the FP8 linears launch Triton kernels "
                              "from an autograd function); use one of them", key="train.fp8")
        plan = recipe.parallel.plan(world_size)
        plan.grad_accumulation(global_batch_size=recipe.train.global_batch_size,
                               micro_batch_size=recipe.train.micro_batch_size)
        if recipe.parallel.strategy == "hsdp" and recipe.parallel.shard_size is None:
            raise RecipeError("hsdp needs parallel.shard_size (ranks per shard group; replicas = world / shard_size)",
                              key="parallel.shard_size")
        from loongforge_embodied.parallel import resolve_strategy

        strategy = resolve_strategy(recipe.parallel.strategy, world_size)
        if recipe.train.compile_mode in CUDA_GRAPH_MODES and world_size > 1 and strategy not in ("ddp", "zero1"):
            # NOTE: FSDP2 frees and re-gathers the unsharded parameters around every unit, while a CUDA graph
            # replays fixed addresses; graphs under ddp / zero1 on 2 GPUs train the one-process losses
            # (test_gpu_compile.py).
            raise RecipeError(
                f"compile_mode {recipe.train.compile_mode} (CUDA graphs) runs with parallel.strategy ddp or zero1; "
                f"'{strategy}' on {world_size} processes re-gathers parameters every step: use compile_mode default "
                "or max-autotune-no-cudagraphs", key="train.compile_mode")

    def build(self, recipe: Recipe, runtime: Runtime) -> Job:
        from loongforge_embodied.job import EmbodiedJob

        return EmbodiedJob(recipe, runtime)

    def prepare_data(self, recipe: Recipe, *, force: bool = False) -> Path:
        from loongforge_embodied.data.prepare import prepare

        return prepare(recipe, force=force)
