"""What the megatron backend asks of a model family: the :class:`ModelSpec` protocol.

A spec is one object per family (registered under the ``loongforge.megatron.models`` entry-point group, the
backend's own families included). It owns everything model-specific: presets, the architecture and its HF config
both ways, the HF name map, the recipe checks, the data, and the model chunks with their forward step. The job
reads only the spec: recipe -> spec -> data + model -> HF weights -> LoRA -> DDP -> optimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch
    from loongforge.accelerator.adaptation import Adaptation
    from loongforge.checkpoint import NameMap
    from loongforge.parallel.plan import ParallelPlan
    from loongforge.recipe.schema import Recipe
    from loongforge.runtime import Runtime

HFConfig = dict[str, Any]


@dataclass
class Data:
    """What a spec's data step gives the job: the datasets (index -> sample dict), what one sample is made of
    (``seq_length``: tokens, or an image model's latent patches) and what an HF export writes beside the weights."""

    train: Any
    valid: Any = None
    seq_length: int = 0
    tokenizer: Any = None
    sample_unit: str | None = None  # what one sample is (an image model's "images"): <unit>_per_s is reported besides tokens
    assets: Callable[[Path], None] | None = None  # writes tokenizer / label files into an export's directory
    encoder: Any = None  # what turns a batch's raw inputs into the model's (an image model's autoencoder), for the forward step


@dataclass
class Model:
    """This rank's model chunks before DDP (one per virtual pipeline stage) and how to train them."""

    chunks: list[torch.nn.Module]
    config: Any  # the megatron TransformerConfig the chunks were built with
    kernels: str  # the layer spec used (te / loongforge / local), for the log
    forward_step: Callable | None = None  # megatron forward_step_func (None: the engine's GPT step)
    loss_key: str = "lm loss"
    # components not split like the language model (parallel.components.*.tp): a megatron-name prefix every TP rank
    # holds whole, or (prefix, tp) split over a tp group of its own (conversion/layout.py)
    whole: tuple = ()
    groups: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # train.freeze's groups -> name prefixes
    before_step: Callable[[int, Any], None] | None = None  # (0-based step index, the optimizer) before each step
    step_metrics: Callable[[], Mapping[str, float]] | None = None  # the model's own metrics of the step just run
    lora_targets: Mapping[str, tuple[str, ...]] | None = None  # train.lora.targets -> module names (None: megatron's)
    timed_encoder: bool = False  # an encoder whose per-rank forward time the job logs (engine/encoder_split.py)


PARALLEL_DIMS = {"tp": "tensor", "sp": "sequence", "cp": "context", "pp": "pipeline", "vpp": "interleaved pipeline",
                 "ep": "expert", "etp": "expert tensor", "components": "per-component"}


@dataclass(frozen=True)
class Supports:
    """What a model kind trains, checked once by the backend's ``validate`` before the kind's own checks: train
    stages, ``data.format`` values (those of SFT among them), the parallel dimensions it may set (above 1, or on;
    data parallelism always), and the ``kernels.layers`` sets it builds on. ``models`` names the kind in messages
    ("language models train with ...")."""

    models: str = "language models"
    stages: tuple[str, ...] = ("pretrain", "cpt", "sft", "lora")
    data_formats: tuple[str, ...] = ("pretrain", "sft", "synthetic")
    sft_formats: tuple[str, ...] = ("sft",)
    parallel: tuple[str, ...] = ("tp", "sp", "cp", "pp", "vpp", "ep", "etp")
    layers: tuple[str, ...] = ("auto", "loongforge", "local", "te")


@runtime_checkable
class Architecture(Protocol):
    """What the backend reads of a spec's typed architecture (the rest is the spec's own)."""

    family: str
    spec_name: str  # the registry key of the spec that trains it (its family, or the model kind holding it)
    num_layers: int
    num_attention_heads: int
    kv_heads: int
    num_experts: int | None
    is_moe: bool


@runtime_checkable
class ModelSpec(Protocol):
    """One model family. ``models.base.HFCheckpoint`` gives the HF-checkpoint hooks their usual defaults."""

    name: str  # the family: recipe ``model.family``, the registry key
    kind: str  # what it is, for messages ("a language model")
    model_types: tuple[str, ...]  # HF ``model_type`` (diffusers ``_class_name``) values this family reads
    presets: Mapping[str, Mapping[str, Any]]  # named sizes (recipe ``model.preset``)
    hf_weights: str  # weight files' stem an export writes (model / diffusion_pytorch_model)
    arch_type: type  # the typed architecture (:class:`Architecture`) a recipe's ``model`` keys resolve into
    # NOTE: the recipe sections are subclasses of ``config.ModelConfig`` / ``config.DataConfig`` with the kind's own
    # keys; the backend validates ``model`` / ``data`` with the recipe's family's
    model_section: type
    data_section: type
    supports: Supports
    mtp: bool  # has an HF layout for multi-token-prediction layers
    peft_module_paths: bool  # PEFT target_modules are module paths, not last names (a VLM's tower has the same names)

    peft_prefix: str  # what the LoRA export's tensor names start with (PEFT's base_model.model., a pipeline's part)
    peft_weights: str  # the LoRA export's weight file name

    def peft_name(self, name: str) -> str:
        """A checkpoint's tensor name -> the module path of transformers' model, which PEFT adapters name."""

    def peft_metadata(self, config: Mapping[str, Any]) -> dict[str, str]:
        """safetensors metadata of the LoRA export beyond ``format`` (``config``: the adapter_config.json written
        beside it), for loaders that read the adapter's rank and alpha from the weight file."""

    # architecture
    def arch(self, fields: Mapping[str, Any]) -> Any:
        """The typed architecture from preset / HF / recipe fields (raises ValueError naming a bad field)."""

    def arch_from_hf(self, cfg: HFConfig, *, path: Path) -> Any:
        """The architecture an HF ``config.json`` describes (RecipeError naming model.hf when unsupported)."""

    def hf_config(self, arch: Any, *, torch_dtype: str) -> HFConfig:
        """The ``config.json`` an HF export of ``arch`` writes."""

    # HF checkpoint (offline converter, online load, export)
    def complete_hf_config(self, cfg: HFConfig) -> HFConfig: ...
    def name_map(self, cfg: HFConfig, *, divisible_by: int) -> NameMap: ...
    def num_experts(self, cfg: HFConfig) -> int: ...
    def text_config(self, cfg: HFConfig) -> HFConfig: ...
    def ignore_hf(self, cfg: HFConfig, name: str) -> bool: ...
    def mtp_layers_in(self, cfg: HFConfig, names: list[str]) -> int: ...
    def hf_alias(self, name: str) -> str: ...
    def hf_extra(self, cfg: HFConfig) -> dict[str, torch.Tensor]: ...
    def export_config(self, cfg: HFConfig) -> HFConfig: ...

    # training
    def check(self, recipe: Recipe, plan: ParallelPlan, arch: Any) -> None:
        """Refuse (RecipeError naming the key) what this family cannot train, before any process starts."""

    def adaptations(self, *, arch: Any, accelerator: Any) -> Sequence[Adaptation]:
        """Patches of megatron-core this family's model needs, applied by the job for the run (through the
        accelerator adaptation door, with the device's own)."""

    def data(self, *, recipe: Recipe, arch: Any, runtime: Runtime, device: torch.device) -> Data: ...

    def prepare_data(self, recipe: Recipe, *, force: bool = False) -> Path | None:
        """``loongforge data prepare`` of this family's own data format (its prepared directory), or None: the
        backend's tokenized pretrain / sft preparation."""

    def model(self, *, recipe: Recipe, arch: Any, plan: ParallelPlan, accelerator: Any, device: torch.device,
              precision: str, data: Data) -> Model:
        """This rank's chunks with a seeded, layout-invariant random init (the job loads HF weights over it)."""
