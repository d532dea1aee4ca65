"""Online conversion for training: each rank shards an HF checkpoint for itself, and per-rank state dicts
gather back into HF tensors for export. Same rules and name maps as the offline path."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from loongforge.checkpoint import Param, check_shapes
from loongforge.errors import CheckpointError

from loongforge_megatron.conversion.config_check import check_hf_dir
from loongforge_megatron.conversion.convert import copy_assets, read_hf_config
from loongforge_megatron.conversion.engine import (
    HFSource,
    Key,
    MegatronSource,
    hf_params,
    key_of,
    row_streamable,
    shard,
    to_hf_dir,
)
from loongforge_megatron.conversion.layout import MegatronLayout, Rank
from loongforge_megatron.models.registry import get_family


def shard_state_dict_for_rank(
    hf_dir: str | os.PathLike, *, tp_rank: int, tp_size: int, pp_rank: int = 0, pp_size: int = 1,
    ep_rank: int = 0, ep_size: int = 1, etp_size: int | None = None, vpp_rank: int = 0, vpp_size: int = 1,
    family: str | None = None, make_vocab_size_divisible_by: int = 128,
    first_stage_layers: int | None = None, last_stage_layers: int | None = None,
    expected_shapes: Mapping[str, tuple[int, ...]] | None = None, dtype: torch.dtype | None = None,
    whole: tuple[str, ...] = (), mtp_layers: int = 0, held: Callable[[str], bool] | None = None,
) -> dict[str, torch.Tensor]:
    """Exactly one rank's megatron state dict (one virtual chunk when vpp_size > 1), reading only the HF
    tensors that rank needs. Pass the model's ``{name: shape}`` as ``expected_shapes`` to fail with the
    first missing / unexpected / mis-shaped tensor named; ``dtype`` casts on the way (None keeps HF dtypes).
    ``whole``: megatron-name prefixes of components every TP rank holds unsplit; ``mtp_layers``: the model's
    multi-token-prediction layers, read from the HF layers after ``num_hidden_layers``; ``held``: which megatron
    names this process holds (None: all of its layout rank's), for a rank that holds some components of the model
    only (an encoder on ranks of its own, or the language model beside it): it reads only those.
    """
    hf_config = read_hf_config(hf_dir)
    fam = get_family(family, hf_config=hf_config)
    source = HFSource(hf_dir, family=fam.name, hf_config=hf_config, dtype=dtype)
    check_hf_dir(hf_dir, hf_config, family=fam, reader=source.reader)
    layout = MegatronLayout(
        fam.name, hf_config, tp=tp_size, pp=pp_size, vpp=vpp_size, ep=ep_size, etp=etp_size,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by, first_stage_layers=first_stage_layers,
        last_stage_layers=last_stage_layers, whole=whole, mtp_layers=mtp_layers,
    )
    if not (0 <= tp_rank < tp_size and 0 <= pp_rank < pp_size and 0 <= ep_rank < ep_size and 0 <= vpp_rank < vpp_size):
        raise CheckpointError(f"rank (tp={tp_rank}, pp={pp_rank}, ep={ep_rank}, vpp={vpp_rank}) is outside the layout")
    params = list(layout.params())
    source.check_names(key_of(p) for p in params)
    me: Rank = (tp_rank, pp_rank, ep_rank, vpp_rank)
    mine: dict[Key, list[tuple[Param, int]]] = {}
    for p in params:
        for rank, index in layout.holders(p):
            if rank == me and (held is None or held(p.megatron)):
                mine.setdefault(key_of(p), []).append((p, index))
    out: dict[str, torch.Tensor] = {}
    for held in mine.values():
        if (shards := _row_shards(source, layout, held)) is not None or \
                (shards := _column_shards(source, layout, held)) is not None:
            out.update({k: t if dtype is None else t.to(dtype) for k, t in shards.items()})
            continue
        # NOTE: one read per HF group (a fused experts tensor serves all of this rank's experts)
        group = source.get(held[0][0])
        for p, index in held:
            t = shard(layout, p, group, index)
            # NOTE: a copy so the result does not keep the whole HF tensor alive through a view (a fused experts
            # tensor holds every expert of the layer)
            out[p.megatron] = t.to(dtype=dtype if dtype is not None else t.dtype, copy=True)
        del group
    if expected_shapes is not None:
        actual = {k: tuple(v.shape) for k, v in out.items()}
        check_shapes(expected_shapes, actual, where=f"{hf_dir} (tp={tp_rank}, pp={pp_rank}, ep={ep_rank})")
    return out


def _row_shards(source: HFSource, layout: MegatronLayout, held: list[tuple[Param, int]]) -> dict | None:
    """This rank's shards of one row-wise HF group, filled with positioned reads of just its rows (an FP8 weight
    dequantizes just their blocks); None when the group is not row-wise (or its shapes do not split: the whole-group
    path names the problem)."""
    specs = source.spec(held[0][0])
    if not row_streamable(held[0][0], specs) or len({d for d, _ in specs.values()}) != 1:
        return None
    group_dtype = next(iter(specs.values()))[0]
    try:
        shapes = [p.rule.shard_shape({r: s for r, (_, s) in specs.items()}, tp_size=layout.split_size(p))
                  for p, _ in held]
    except (CheckpointError, RuntimeError):
        return None
    return {p.megatron: source.read_shard(p, index=index, size=layout.split_size(p), spec=(group_dtype, shape))
            for (p, index), shape in zip(held, shapes, strict=True)}


def _column_shards(source: HFSource, layout: MegatronLayout, held: list[tuple[Param, int]]) -> dict | None:
    """This rank's shards of one row-parallel FP8 weight, dequantizing only their columns; None otherwise."""
    out = {}
    for p, index in held:
        t = source.read_column_shard(p, index=index, size=layout.split_size(p))
        if t is None:
            return None
        out[p.megatron] = t
    return out


def _layout(hf_config: dict, family: str | None, **sizes) -> MegatronLayout:
    fam = get_family(family, hf_config=hf_config)
    return MegatronLayout(fam.name, hf_config, **sizes)


def _dict_source(layout: MegatronLayout, state_dicts: Mapping[Rank, Mapping[str, torch.Tensor]]) -> MegatronSource:
    def read(rank: Rank, name: str) -> torch.Tensor:
        try:
            return state_dicts[rank][name].detach().cpu()
        except KeyError:
            raise CheckpointError(f"rank {rank}: state dict has no tensor '{name}'") from None

    def spec(rank: Rank, name: str):
        t = read(rank, name)
        return t.dtype, tuple(t.shape)

    return MegatronSource(layout, read=read, spec=spec)


def gather_to_hf(
    state_dicts: Mapping[Rank, Mapping[str, torch.Tensor]], *, hf_config: dict, family: str | None = None,
    tp: int = 1, pp: int = 1, vpp: int = 1, ep: int = 1, etp: int | None = None,
    make_vocab_size_divisible_by: int = 128, first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
) -> dict[str, torch.Tensor]:
    """HF tensors from per-rank megatron state dicts keyed by ``(tp, pp, ep, vpp)`` rank. Only the ranks
    that hold a shard are read: for ep > 1 non-expert tensors come from EP rank 0; for etp=1 experts from TP
    rank 0."""
    layout = _layout(hf_config, family, tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp,
                     make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                     first_stage_layers=first_stage_layers, last_stage_layers=last_stage_layers)
    source = _dict_source(layout, state_dicts)
    out: dict[str, torch.Tensor] = {}
    for p in hf_params(layout):
        for role, t in source.get(p).items():
            out[p.hf[role]] = t
    return out


def gather_to_hf_dir(
    state_dicts: Mapping[Rank, Mapping[str, torch.Tensor]], out_dir: str | os.PathLike, *, hf_config: dict,
    family: str | None = None, tp: int = 1, pp: int = 1, vpp: int = 1, ep: int = 1, etp: int | None = None,
    make_vocab_size_divisible_by: int = 128, assets_from: str | os.PathLike | None = None,
    max_shard_bytes: int = 5 * 2**30, force: bool = False, first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
) -> Path:
    """Like ``gather_to_hf`` but streams straight into an HF directory (config.json from ``hf_config``,
    tokenizer and other assets copied from ``assets_from``)."""
    import json

    layout = _layout(hf_config, family, tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp,
                     make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                     first_stage_layers=first_stage_layers, last_stage_layers=last_stage_layers)

    def put_assets(staging: Path) -> None:
        if assets_from is not None:
            copy_assets(Path(assets_from), staging)
        (staging / "config.json").write_text(json.dumps(hf_config, indent=2))

    out_dir = Path(out_dir)
    to_hf_dir(_dict_source(layout, state_dicts), layout, out_dir, max_shard_bytes=max_shard_bytes,
              force=force, assets=put_assets)
    return out_dir
