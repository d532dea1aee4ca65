"""Offline conversions: HF -> megatron layout, megatron layout -> HF, megatron -> megatron reshard.

All three stream one tensor group at a time, write into a staging directory and rename it into place, and
refuse a non-empty destination unless ``force=True``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from loongforge.checkpoint.atomic import fsync_tree, replace_dir
from loongforge.errors import CheckpointError

from loongforge_megatron.conversion.config_check import check_hf_dir
from loongforge_megatron.conversion.engine import HFSource, file_source, key_of, to_hf_dir, to_megatron_files
from loongforge_megatron.conversion.fp8_blocks import BlockFp8, read_quant_config
from loongforge_megatron.conversion.layout import ASSETS_DIR, LAYOUT_FILE, MegatronLayout
from loongforge_megatron.models.base import copy_assets
from loongforge_megatron.models.registry import get_family, read_hf_config


def _staging(out_dir: Path, force: bool) -> Path:
    if out_dir.exists() and any(out_dir.iterdir()) and not force:
        raise CheckpointError(f"{out_dir}: destination is not empty (--force, or force=True, overwrites it)")
    staging = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def _publish(staging: Path, out_dir: Path) -> Path:
    fsync_tree(staging)
    replace_dir(staging, out_dir)
    return out_dir


def hf_to_megatron(
    hf_dir: str | os.PathLike, out_dir: str | os.PathLike, *, family: str | None = None,
    tp: int = 1, pp: int = 1, vpp: int = 1, ep: int = 1, etp: int | None = None,
    make_vocab_size_divisible_by: int = 128, force: bool = False,
    first_stage_layers: int | None = None, last_stage_layers: int | None = None,
    dequantize_dtype: torch.dtype | None = None,
) -> MegatronLayout:
    """Shard an HF checkpoint into the offline megatron layout (one safetensors file per rank).

    A block-scaled FP8 checkpoint's weights are dequantized to ``dequantize_dtype`` (default: the checkpoint's own
    dtype; float32 keeps an FP8 -> megatron -> FP8 round trip byte-exact, scales included).

    ``family`` defaults to the one matching config.json's ``model_type``; ``etp`` defaults to ``tp`` (as in
    megatron-core). Checks that the HF tensors are exactly the ones the family needs before writing; the
    multi-token-prediction layers the checkpoint carries (DeepSeek-V3's) are converted too.
    """
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    hf_config = read_hf_config(hf_dir)
    fam = get_family(family, hf_config=hf_config)
    source = HFSource(hf_dir, family=fam.name, hf_config=hf_config, dtype=dequantize_dtype)
    check_hf_dir(hf_dir, hf_config, family=fam, reader=source.reader)
    layout = MegatronLayout(
        fam.name, hf_config, tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by, first_stage_layers=first_stage_layers,
        last_stage_layers=last_stage_layers, mtp_layers=fam.mtp_layers_in(hf_config, source.reader.keys()),
    )
    source.check_names(key_of(p) for p in layout.params())
    staging = _staging(out_dir, force)
    try:
        to_megatron_files(source, layout, staging)
        copy_assets(hf_dir, staging / ASSETS_DIR)
        layout.save(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _publish(staging, out_dir)
    return layout


def megatron_to_hf(
    src_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
    max_shard_bytes: int = 5 * 2**30, force: bool = False, fp8: bool = False,
) -> Path:
    """Gather an offline megatron checkpoint back into an HF directory (sharded safetensors + index, config,
    tokenizer). Vocab padding is stripped; tied output layers are not duplicated. ``fp8``: the decoder layers'
    linear weights as block-scaled FP8 with a ``weight_scale_inv`` per 128x128 block (the published DeepSeek-V3
    format; the source's own block size when it was converted from such a checkpoint)."""
    src_dir, out_dir = Path(src_dir), Path(out_dir)
    layout = MegatronLayout.load(src_dir)
    assets = src_dir / ASSETS_DIR

    def put_assets(staging: Path) -> None:
        if assets.is_dir():
            copy_assets(assets, staging)
        config = staging / "config.json"
        source_config = json.loads(config.read_text()) if config.is_file() else layout.hf_config
        exported = get_family(layout.family).export_config(source_config)
        # NOTE: the weights written say whether they are quantized, not the source's config
        exported.pop("quantization_config", None)
        if quant is not None:
            exported["quantization_config"] = {**(layout.hf_config.get("quantization_config") or {}),
                                               **quant.config()}
        config.write_text(json.dumps(exported, indent=2))

    quant = None
    if fp8:
        quant = read_quant_config(layout.hf_config, where=src_dir / LAYOUT_FILE) or BlockFp8()
    to_hf_dir(file_source(src_dir, layout), layout, out_dir, max_shard_bytes=max_shard_bytes, force=force,
              assets=put_assets, fp8=quant)
    return out_dir


def reshard(
    src_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
    tp: int = 1, pp: int = 1, vpp: int = 1, ep: int = 1, etp: int | None = None, force: bool = False,
    first_stage_layers: int | None = None, last_stage_layers: int | None = None,
) -> MegatronLayout:
    """Re-shard an offline megatron checkpoint to another (tp, pp, vpp, ep, etp), streaming through HF space
    one group at a time (no full-model materialisation)."""
    src_dir, out_dir = Path(src_dir), Path(out_dir)
    old = MegatronLayout.load(src_dir)
    new = MegatronLayout(
        old.family, old.hf_config, tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp,
        make_vocab_size_divisible_by=old.make_vocab_size_divisible_by, first_stage_layers=first_stage_layers,
        last_stage_layers=last_stage_layers, mtp_layers=old.mtp_layers,
    )
    staging = _staging(out_dir, force)
    try:
        to_megatron_files(file_source(src_dir, old), new, staging, label="reshard")
        if (src_dir / ASSETS_DIR).is_dir():
            shutil.copytree(src_dir / ASSETS_DIR, staging / ASSETS_DIR)
        new.save(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _publish(staging, out_dir)
    return new
