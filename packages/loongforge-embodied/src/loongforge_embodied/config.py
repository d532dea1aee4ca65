"""The embodied backend's recipe sections: ``model`` and ``data``."""

from __future__ import annotations

from typing import Literal

from loongforge.recipe.schema import ParallelConfig, Section
from pydantic import Field, ValidationInfo, field_validator, model_validator

# NOTE: a VLA's components are vision / language / expert; a world-action model's video / action
COMPONENTS = ("vision", "language", "expert", "video", "action")
# torch.compile modes that replay CUDA graphs (torch._inductor.list_mode_options: "triton.cudagraphs": True)
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


class FP8AllGatherConfig(Section):
    """fsdp2/hsdp: gather parameters as blockwise-FP8 deltas against a persistent bf16 reconstruction
    (``loongforge_embodied.fp8_allgather``; CUDA with SM >= 8.9)."""

    enabled: bool = False
    reprime_every: int = Field(0, ge=0, description="optimizer steps between full bf16 re-primes (0: first only)")


class ModelConfig(Section):
    """The policy: a registered ``policy`` name, a size ``preset`` and per-field ``arch`` overrides.

    State / action sizes and the camera count come from the dataset."""

    policy: Literal["tiny_vla", "groot", "lerobot_pi05", "lerobot_smolvla",
                    "lerobot_xvla", "lerobot_groot", "lerobot_wall_x", "lerobot_fastwam",
                    "lerobot_lingbot_va"] = "tiny_vla"
    preset: str = Field("tiny", description="named size of the policy (tiny_vla: tiny | pi05; groot: tiny | n1.5; "
                        "lerobot_pi05: tiny | pi05; lerobot_smolvla: tiny | smolvla; "
                        "lerobot_xvla: tiny | xvla; lerobot_groot: tiny | n1_7; lerobot_wall_x: tiny | wall_oss; "
                        "lerobot_fastwam: tiny | fastwam; lerobot_lingbot_va: tiny | lingbot_va)")
    arch: dict[str, int | str | None] = Field(
        default_factory=dict, description="overrides of the preset's fields (sizes; lerobot_pi05 also its tokenizer "
        "and prompt padding; lerobot_smolvla and lerobot_groot their VLM directory; lerobot_wall_x its Wall-X "
        "directory; lerobot_xvla its Florence-2 and tokenizer directories; lerobot_fastwam its Wan2.2 and tokenizer "
        "directories; lerobot_lingbot_va its Wan directory), each checked against the field's type")
    freeze: list[Literal["vision", "language", "expert", "video", "action"]] = Field(
        default_factory=list, description="components kept frozen (and unsharded under fsdp2/hsdp); a VLA's are "
        "vision, language, expert, a world-action model's video, action")
    load: str | None = Field(None, description="exported policy dir (config.json + model.safetensors) to start from")
    comm_hook: Literal["none", "bf16"] = Field("none", description="ddp/zero1: compress gradient all-reduce to bf16")
    reshard_after_forward: bool = Field(True, description="fsdp2/hsdp: free gathered params after forward (ZeRO-3)")
    prefetch: int = Field(1, ge=0, description="fsdp2/hsdp: blocks all-gathered ahead in forward and backward")
    fp8_allgather: FP8AllGatherConfig = Field(default_factory=FP8AllGatherConfig)

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, value: str, info: ValidationInfo) -> str:
        from loongforge_embodied.policies import get_policy

        policy = info.data.get("policy")
        if policy is not None and value not in get_policy(policy).presets:
            raise ValueError(f"unknown preset '{value}' for policy {policy}; allowed: "
                             f"{', '.join(get_policy(policy).presets)}")
        return value

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        from loongforge_embodied.policies import get_policy, resolve_arch

        arch = resolve_arch(self)  # unknown arch fields raise here, at load time
        check = getattr(get_policy(self.policy).module(f"configuration_{self.policy}"), "check_recipe_arch", None)
        if check is not None:  # NOTE: a policy's file-system checks (e.g. lerobot_pi05's local tokenizer)
            check(arch)
        return self


class RecordConfig(Section):
    """What ``loongforge data prepare`` records: a scripted expert in a simulator from PyPI."""

    env: Literal["pusht"] = "pusht"
    episodes: int = Field(20, ge=1)
    max_steps: int = Field(100, ge=2, description="frames per episode at most")
    image_size: int = Field(64, ge=16)
    seed: int = Field(0, ge=0)
    workers: int = Field(1, ge=1, description="processes recording episodes in parallel (merged into one dataset)")
    noise: float = Field(0.0, ge=0.0, description="std (px) of Gaussian noise added to each action the expert "
                         "executes; the clean action is recorded as the label (DART: the data then shows recoveries)")


class DataConfig(Section):
    """``lerobot``: a local LeRobotDataset v3 at ``root``; ``synthetic``: deterministic random frames."""

    format: Literal["lerobot", "synthetic"] = "lerobot"
    root: str | None = Field(None, description="local LeRobotDataset root (relative paths: to the working dir)")
    repo_id: str = "local/pusht_scripted"
    cameras: list[str] | None = Field(None, description="camera keys to use (default: all in the dataset)")
    state_key: str = Field("observation.state", description="the dataset's feature the policy reads as its state "
                           "(e.g. observation.environment_state: a simulator's privileged state); the served policy "
                           "asks for the same key")
    in_memory: bool = Field(False, description="decode every frame into memory once at start (small datasets: "
                            "sampling then costs an index, not a parquet query and an image decode)")
    record: RecordConfig | None = None
    synthetic_samples: int = Field(1024, ge=1)
    task: str = "Push the T-shaped block onto the target."
    num_workers: int = Field(0, ge=0, description="DataLoader worker processes (decode + collate off the main thread)")
    image_shift: int = Field(0, ge=0, description="random-shift augmentation in pixels (0: off)")
    eval_env: str | None = Field(None, description="simulator of train.eval_interval's closed-loop episodes "
                                 "(train.eval_steps of them; default: data.record.env)")
    eval_max_steps: int | None = Field(None, ge=1, description="episode length of those episodes (default: the env's)")
    eval_workers: int = Field(1, ge=1, description="environment worker processes for those episodes")
    eval_seed: int = Field(100_000, ge=0, description="episode i of every evaluation uses seed eval_seed + i "
                           "(away from data.record.seed's episodes)")
    eval_request_timeout: float = Field(120.0, gt=0, le=86_400, allow_inf_nan=False, description="seconds an "
                                        "evaluation worker waits for each reply of the policy server")

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if self.format == "lerobot" and not self.root:
            raise ValueError("data.format 'lerobot' needs data.root (a local LeRobotDataset directory)")
        if not self.state_key.startswith("observation."):
            raise ValueError(f"data.state_key '{self.state_key}' is not an observation feature (observation.*)")
        return self


class EmbodiedParallelConfig(ParallelConfig):
    """The recipe's ``parallel`` section with the embodied backend's own keys."""

    strategy: Literal["auto", "ddp", "zero1", "fsdp2", "hsdp"] = Field(
        "auto", description="data-parallel strategy (auto: ddp)"
    )
    shard_size: int | None = Field(None, ge=1, description="hsdp: ranks per shard group (replicas = dp / shard_size)")
