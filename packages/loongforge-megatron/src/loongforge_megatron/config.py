"""The megatron backend's recipe sections: ``model`` and ``data``, with the keys every model kind shares. A kind
adds its own by subclassing them (its spec's ``model_section`` / ``data_section``); the recipe's family picks."""

from __future__ import annotations

import difflib
import json
import sys
from pathlib import Path
from typing import Any, ClassVar, Literal

from loongforge.errors import RecipeError
from loongforge.recipe.schema import KernelsConfig, Section
from pydantic import Field, ValidationInfo, field_validator, model_validator

from loongforge_megatron.models import registry

_NOT_ARCH = ("family", "preset", "hf", "tokenizer", "init_on_cpu", "moe")


def arch_keys(schema: type[ModelConfig] | None = None) -> list[str]:
    """The ``model`` keys that set the architecture (over the preset / HF config); ``schema``: a kind's section
    (default: the keys every kind shares)."""
    schema = schema or ModelConfig
    return [f for f in schema.model_fields if f not in _NOT_ARCH and f not in schema.not_arch]


def spec_for(model: dict[str, Any], *, explain: bool = False) -> Any:
    """The spec a raw ``model`` section names (its family, preset or HF directory; llama with explicit sizes), or
    None when it names none that loads (the section's own validation then says why; ``explain``: an HF directory
    that names no family is a RecipeError naming model.hf here)."""
    if explain and isinstance(model.get("hf"), str) and not model.get("family") and not model.get("preset"):
        try:
            registry.get_family(hf_config=registry.load_config_json(Path(model["hf"]) / "config.json"))
        except Exception:  # noqa: BLE001 - whatever it is, arch_from_hf says it naming model.hf
            from loongforge_megatron.models.hf_arch import arch_from_hf

            try:
                arch_from_hf(model["hf"])
            except ValueError as exc:
                raise RecipeError(f"{model['hf']}/config.json: not valid JSON ({str(exc)[:100]})",
                                  key="model.hf") from None
    try:
        if model.get("family"):
            return registry.get(model["family"])
        if model.get("preset"):
            return registry.presets()[model["preset"]][0]
        if model.get("hf"):
            cfg = json.loads((Path(model["hf"]) / "config.json").read_text())
            return registry.get_family(hf_config=cfg)
        return registry.get("llama")
    except Exception:  # NOTE: any failure here is reported by validating the section, naming the key
        return None


class MoeConfig(Section):
    """How a MoE model's experts run under expert parallelism (not the architecture: the math is the same)."""

    replica_slots_per_rank: int = Field(0, ge=0, description="extra expert slots on every EP rank for copies of "
                                        "hot experts, planned from the router's live loads (needs parallel.ep > 1, "
                                        "grouped experts, megatron's alltoall dispatcher); checkpoints never "
                                        "contain the copies")
    replica_interval: int = Field(1, ge=1, description="steps between two replica plans (each from the loads of "
                                  "the steps since the last)")
    overlap_a2a: bool = Field(False, description="dispatch / combine one half of a MoE layer's tokens while the "
                              "experts compute the other half (side stream on CUDA; needs parallel.ep > 1)")


class ModelConfig(Section):
    """The model: a named ``preset``, an HF directory (``hf``: architecture from its config.json, or a diffusers
    model folder), or explicit sizes. Any architecture field given here overrides the preset / HF value."""

    not_arch: ClassVar[tuple[str, ...]] = ()  # a kind's own keys that are not architecture fields

    family: str | None = Field(None, description="model family (default llama with explicit sizes); `loongforge "
                               "plugins` lists them under loongforge.megatron.models")
    preset: str | None = None
    hf: str | None = Field(None, description="HF model directory; its config.json gives the architecture")
    tokenizer: str | None = Field(None, description="HF tokenizer dir (default: data.tokenizer, then model.hf)")
    init_on_cpu: bool = Field(False, description="megatron's use_cpu_initialization for a random init on a GPU: each "
                              "tensor-parallel weight is drawn whole on the CPU and split, so the init does not "
                              "depend on the TP size (slower start; always on with accelerator cpu and for models "
                              "that draw every weight whole)")
    # architecture overrides (all optional)
    num_layers: int | None = Field(None, ge=1)
    hidden_size: int | None = Field(None, ge=1)
    ffn_hidden_size: int | None = Field(None, ge=1)
    num_attention_heads: int | None = Field(None, ge=1)
    num_query_groups: int | None = Field(None, ge=1)
    head_dim: int | None = Field(None, ge=1)
    vocab_size: int | None = Field(None, ge=2, description="at least 2 (with one token every prediction is certain)")
    max_position_embeddings: int | None = Field(None, ge=1)
    rope_theta: float | None = Field(None, gt=0)
    norm_eps: float | None = Field(None, gt=0)
    qkv_bias: bool | None = None
    qk_norm: bool | None = None
    tie_embeddings: bool | None = None
    init_std: float | None = Field(None, gt=0)
    num_experts: int | None = Field(None, ge=1)
    moe_topk: int | None = Field(None, ge=1)
    moe_ffn_hidden_size: int | None = Field(None, ge=1)
    moe_aux_loss_coeff: float | None = Field(None, ge=0)
    moe_aux_loss_type: Literal["aux_loss", "seq_aux_loss"] | None = None
    moe_z_loss_coeff: float | None = Field(None, gt=0)
    moe_expert_bias: bool | None = Field(None, description="aux-loss-free balancing: a per-expert routing bias "
                                         "updated each step toward equal load (DeepSeek-V3)")
    moe_expert_bias_update_rate: float | None = Field(None, gt=0)
    moe_capacity_factor: float | None = Field(None, gt=0)
    moe_token_drop_policy: Literal["probs", "position"] | None = None
    moe_pad_to_capacity: bool | None = None
    moe_token_dispatcher: Literal["auto", "permute", "alltoall", "allgather"] | None = None
    moe_shared_expert_overlap: bool | None = Field(None, description="MoE with shared experts: compute them while "
                                                   "the all-to-all dispatches the routed tokens")
    moe: MoeConfig = Field(default_factory=MoeConfig, description="expert replicas and the overlapped all-to-all "
                           "of MoE models")
    mtp_num_layers: int | None = Field(None, ge=0, description="multi-token prediction (DeepSeek-V3's MTP): depths "
                                       "trained after the decoder, loaded from / exported to the HF layers after "
                                       "num_hidden_layers")
    mtp_loss_weight: float | None = Field(None, gt=0, description="weight of the MTP loss (default 0.1)")

    @model_validator(mode="before")
    @classmethod
    def _freeze_is_a_train_key(cls, data: Any) -> Any:
        if isinstance(data, dict) and "freeze" in data:
            raise ValueError("freeze is a train key: set train.freeze (module groups or parameter-name globs)")
        return data

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.family is not None and self.family not in registry.families:
            known = registry.families.keys()
            close = difflib.get_close_matches(self.family, known, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ValueError(f"unknown model family '{self.family}'; {hint}installed: {', '.join(known)}")
        presets = registry.presets()
        if self.preset is not None and self.preset not in presets:
            close = difflib.get_close_matches(self.preset, presets, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ValueError(f"unknown preset '{self.preset}'; {hint}available: {', '.join(sorted(presets))}")
        if self.preset and self.hf:
            raise ValueError("give either preset or hf, not both")
        if not self.preset and not self.hf:
            fields = registry.get(self.family or "llama").arch_type.model_fields
            need = [f for f, info in fields.items() if info.is_required()]
            missing = [f for f in need if getattr(self, f, None) is None]
            if missing:
                raise ValueError(f"give a preset, an hf directory, or explicit sizes (missing: {', '.join(missing)})")
        return self

    def resolve(self) -> tuple[Any, Any]:
        """(spec, architecture) from the HF config / preset / family with the recipe's overrides."""
        if self.hf:
            from loongforge_megatron.models.hf_arch import arch_from_hf

            found = arch_from_hf(self.hf)
            spec, base = registry.spec_of(found), found.model_dump()
        elif self.preset:
            spec, base = registry.presets()[self.preset]
        else:
            spec, base = registry.get(self.family or "llama"), {}
        if self.family:
            if self.family != base.get("family", spec.name) and self.family != spec.name:
                spec = registry.get(self.family)
            base["family"] = self.family
        given = {f: getattr(self, f) for f in arch_keys(type(self)) if getattr(self, f) is not None}
        fields = spec.arch_type.model_fields
        wrong = [f for f in given if f not in fields]
        if wrong:
            raise ValueError(f"model.{wrong[0]} is not a setting of {spec.kind}")
        base.update(given)
        arch = spec.arch(base)
        return registry.spec_of(arch), arch

    def arch(self) -> Any:
        """Resolve preset / HF config / explicit sizes into the family's typed architecture."""
        return self.resolve()[1]

    def spec(self) -> Any:
        """The :class:`~loongforge_megatron.models.spec.ModelSpec` that trains this model."""
        return self.resolve()[0]


class DataSource(Section):
    """Raw input for ``loongforge data prepare``."""

    kind: Literal["python_stdlib", "text", "jsonl", "parquet"] = "text"
    paths: list[str] = Field(default_factory=list, description="files or glob patterns")
    text_key: str = Field("text", description="jsonl/parquet: field holding the text (pretraining)")
    max_bytes: int | None = Field(None, ge=1, description="stop reading after this many bytes of text")


class TokenizerTraining(Section):
    """Train a byte-level BPE tokenizer on the source during ``data prepare`` (saved in HF format)."""

    vocab_size: int = Field(4096, ge=260)


class BlendItem(Section):
    path: str = Field(description="prefix of a prepared dataset (without .bin/.idx)")
    weight: float = Field(1.0, gt=0)


def data_formats() -> dict[str, list[str]]:
    """Every ``data.format`` an installed model kind trains on -> the families that train on it."""
    out: dict[str, list[str]] = {}
    for spec in registry.all_specs().values():
        for fmt in spec.supports.data_formats:
            out.setdefault(fmt, []).append(spec.name)
    return out


class DataConfig(Section):
    """Training data. ``format``: one a model kind trains on (its spec's ``supports``): pretrain (megatron indexed
    datasets), sft (chat JSONL, packed), synthetic, and each kind's own (``loongforge validate`` names them)."""

    formats_without_path: ClassVar[tuple[str, ...]] = ("synthetic",)  # formats that need no data.path

    format: str = Field("pretrain", description="pretrain | sft | synthetic | a model kind's own format")
    path: str | None = Field(None, description="prepared data directory (what data prepare writes), or a kind's "
                             "records file / image folder")
    blend: list[BlendItem] = Field(default_factory=list, description="weighted dataset prefixes (default: PATH/train)")
    seq_length: int = Field(1024, ge=8)
    tokenizer: str | None = Field(None, description="HF tokenizer dir (default: PATH/tokenizer or model.hf)")
    source: DataSource | None = None
    train_tokenizer: TokenizerTraining | None = None
    split: str = Field("98,2,0", pattern=r"^\d+(\.\d+)?,\d+(\.\d+)?,\d+(\.\d+)?$", description="train,valid,test weights")
    sft_style: Literal["auto", "alpaca", "sharegpt", "openai"] = "auto"
    num_workers: int = Field(0, ge=0, le=64, description="worker processes that make the next steps' micro-batches "
                             "while the model trains (0: made in the step; worth it where a sample costs, e.g. a "
                             "VLM's image preprocessing; at most 64)")
    pack: bool | None = Field(None, description="(default true) sft: pack samples into seq_length rows without "
                              "cross-sample attention; a VLM's records: a micro-batch's records back to back in one "
                              "row (no padding, no attention across records)")
    balance: bool = Field(False, description="sft, conversations: place each global batch's samples over the "
                          "data-parallel ranks and micro-batches by their cost (a fitted a*sum(l^2) + b*sum(l) + c + "
                          "v*image patches per micro-batch), the same "
                          "samples each step: the loss is unchanged; the log shows dp_imbalance before / after")

    @field_validator("balance")
    @classmethod
    def _balance_needs_costs(cls, value: bool, info: ValidationInfo) -> bool:
        fmt = info.data.get("format")
        if value and fmt not in ("sft", "conversations"):
            raise ValueError(f"data.balance places samples by their cost (formats sft, conversations); format "
                             f"'{fmt}' does not give its samples' costs")
        return value

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if self.format not in self.formats_without_path and not self.path and not self.blend:
            raise ValueError(f"format '{self.format}' needs data.path (a prepared data directory) or data.blend")
        if self.pack is not None and self.format not in ("sft", "conversations"):
            raise ValueError(f"data.pack applies to formats sft and conversations, not '{self.format}'")
        if self.format == "pretrain" and float(self.split.split(",")[0]) <= 0:
            raise ValueError(f"data.split '{self.split}' leaves no training documents (its first, train weight is 0)")
        return self


class MegatronKernelsConfig(KernelsConfig):
    """The recipe's ``kernels`` section with the megatron backend's own keys."""

    layers: Literal["auto", "loongforge", "te", "local"] = Field(
        "auto", description="the layer set: loongforge (SDPA attention + fused kernels of kernels.provider), te "
        "(TransformerEngine's), local (megatron-core's own); auto: loongforge unless TransformerEngine is installed")
    grad_accum_fusion: bool = Field(False, description="add weight gradients into the fp32 main_grad inside "
                                    "the weight-gradient GEMM (gradient_accumulation_fusion; Apex's kernel when "
                                    "installed, else torch.addmm with out_dtype)")
    moe_grouped_gemm: bool | None = Field(None, description="MoE: all local experts' fc1 / fc2 in one "
                                          "torch grouped_mm each (true) or one expert after another (false, "
                                          "megatron's SequentialMLP); unset: grouped on the loongforge layers where "
                                          "grouped_mm runs (bf16 CUDA, CPU) and not for LoRA")
    moe_router_fusion: bool = Field(True, description="MoE, loongforge layers: the router's top-k (score "
                                    "function, expert bias, group-limited selection, scaling) in one fused kernel "
                                    "of kernels.provider (false: megatron's torch routing)")

    @model_validator(mode="before")
    @classmethod
    def _renamed_spec(cls, data: Any) -> Any:
        """``kernels.spec`` is the old name of ``kernels.layers``: still read, with a one-line notice."""
        if not isinstance(data, dict) or "spec" not in data:
            return data
        if "layers" in data:
            raise ValueError("kernels.spec is the old name of kernels.layers; give only kernels.layers")
        global _SPEC_NOTICE_SHOWN
        if not _SPEC_NOTICE_SHOWN:
            _SPEC_NOTICE_SHOWN = True
            print("notice: kernels.spec is renamed kernels.layers; the old name still works for now", file=sys.stderr)
        return {("layers" if k == "spec" else k): v for k, v in data.items()}


_SPEC_NOTICE_SHOWN = False  # NOTE: the notice once per process (a recipe is validated more than once)
