"""Defaults of the :class:`ModelSpec` HF-checkpoint hooks (a family whose checkpoint is a plain decoder's), and the
copy of an HF directory's non-weight files (config, tokenizer) that conversions and exports share."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from loongforge_megatron.config import DataConfig, ModelConfig
from loongforge_megatron.models.spec import HFConfig, Supports

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json",
                   "diffusion_pytorch_model.safetensors.index.json", "diffusion_pytorch_model.bin.index.json",
                   # NOTE: a diffusers pipeline's index names component sub-folders, which are not copied
                   "model_index.json")


def copy_assets(src: Path, dst: Path) -> None:
    """Copy config, tokenizer and other non-weight files (top level only)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES) and f.name not in _WEIGHT_INDEXES:
            shutil.copy2(f, dst / f.name)


class HFCheckpoint:
    """A transformers checkpoint with ``model.safetensors``, no experts, nothing to ignore but rotary buffers; the
    recipe's ``model`` / ``data`` keys every kind shares, and a language model's :class:`Supports`."""

    hf_weights = "model"
    model_section: type = ModelConfig
    data_section: type = DataConfig
    supports = Supports()
    mtp = False  # has an HF layout for multi-token-prediction layers (DeepSeek-V3's)

    def complete_hf_config(self, cfg: HFConfig) -> HFConfig:
        return cfg

    def num_experts(self, cfg: HFConfig) -> int:
        return 0

    def text_config(self, cfg: HFConfig) -> HFConfig:
        """The language model's part of the config (a VLM nests it), for the layer count and the vocabulary."""
        return cfg

    def ignore_hf(self, cfg: HFConfig, name: str) -> bool:
        return "rotary_emb.inv_freq" in name

    def mtp_layers_in(self, cfg: HFConfig, names: list[str]) -> int:
        """How many multi-token-prediction layers a checkpoint with these tensor names carries."""
        return 0

    def hf_alias(self, name: str) -> str:
        """A checkpoint's tensor name -> the name map's spelling."""
        return name

    #: the PEFT export's target_modules are the adapted modules' paths, not their last names (a model with other
    #: linears of the same names that must not get adapters: a VLM's vision tower)
    peft_module_paths: bool = False

    def peft_name(self, name: str) -> str:
        """A checkpoint's tensor name -> the module path of transformers' model, which PEFT adapters name."""
        return name

    peft_prefix: str = "base_model.model."  # PEFT's names of a transformers model's adapters
    peft_weights: str = "adapter_model.safetensors"

    def peft_metadata(self, config: dict[str, Any]) -> dict[str, str]:
        """safetensors metadata of the LoRA export beyond ``format`` (none: PEFT reads adapter_config.json)."""
        return {}

    def hf_extra(self, cfg: HFConfig) -> dict[str, Any]:
        """HF tensors an export adds that the megatron model has no parameter for."""
        return {}

    def export_config(self, cfg: HFConfig) -> HFConfig:
        """The config.json an HF export writes for a source config."""
        return cfg

    def config_checks(self, sizes: Any) -> None:
        """config.json values no tensor shape shows (``sizes``: the config as
        :class:`~loongforge_megatron.conversion.sizes.Sizes`); raise CheckpointError naming the key. The shapes
        themselves are the name map's ``Entry.shape``."""

    def adaptations(self, *, arch: Any, accelerator: Any) -> list:
        """Patches of megatron-core the model needs for the run (none: megatron's layers as they are)."""
        return []

    def prepare_data(self, recipe: Any, *, force: bool = False) -> Path | None:
        """No data format of its own to prepare: the backend tokenizes pretrain / sft data."""
        return None
