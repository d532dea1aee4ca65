"""The offline megatron layout: which rank file holds which shard of which parameter.

On disk: ``loongforge_layout.json`` + one safetensors file per rank, ``mp_rank_{tp:02d}_{pp:03d}_{ep:03d}/
model.safetensors`` (``model_vpp{v}.safetensors`` per virtual chunk when vpp > 1) + ``hf_assets/`` (config,
tokenizer). Every EP rank file carries the non-expert parameters too, as megatron's own checkpoints do.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from loongforge.checkpoint import Expert, NameMap, Param, padded_vocab_size
from loongforge.errors import CheckpointError

from loongforge_megatron.conversion.sizes import Sizes
from loongforge_megatron.models.registry import get_family

LAYOUT_FILE = "loongforge_layout.json"
ASSETS_DIR = "hf_assets"
FORMAT = "loongforge-megatron/1"
Rank = tuple[int, int, int, int]  # (tp, pp, ep, vpp)


@dataclass(frozen=True)
class MegatronLayout:
    """Model family, parallel sizes and the HF config a megatron checkpoint was sharded for."""

    family: str
    hf_config: dict[str, Any]
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    etp: int | None = None  # None: megatron's default, expert TP = TP
    first_stage_layers: int | None = None  # uneven pipeline split (megatron's num_layers_in_first_pipeline_stage)
    last_stage_layers: int | None = None
    make_vocab_size_divisible_by: int = 128
    # components not split like the language model, e.g. a VLM's vision tower: a megatron-name prefix (kept whole,
    # TP 1, on every TP rank) or (prefix, tp) (split over tp ranks of its own, a divisor of tp: TP rank r holds
    # shard r % tp)
    whole: tuple[str | tuple[str, int], ...] = ()
    # multi-token-prediction layers the checkpoint holds (HF: the layers after num_hidden_layers)
    mtp_layers: int = 0

    def __post_init__(self) -> None:
        for key in ("tp", "pp", "vpp", "ep"):
            if getattr(self, key) < 1:
                raise CheckpointError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        if self.etp not in (1, self.tp):
            raise CheckpointError(f"etp must be 1 or equal to tp ({self.tp}), got {self.etp}")
        if self.vpp > 1 and self.pp == 1:
            raise CheckpointError("vpp > 1 needs pp > 1")
        whole = tuple(w if isinstance(w, str) else (str(w[0]), int(w[1])) for w in self.whole)
        for w in whole:
            if not isinstance(w, str) and (w[1] < 1 or self.tp % w[1]):
                raise CheckpointError(f"component '{w[0]}' at tp {w[1]}: must divide tp ({self.tp})")
        object.__setattr__(self, "whole", whole)

    @property
    def text_config(self) -> dict[str, Any]:
        return get_family(self.family).text_config(self.hf_config)

    @property
    def num_layers(self) -> int:
        return self.text_config["num_hidden_layers"]

    @property
    def num_experts(self) -> int:
        return get_family(self.family).num_experts(self.hf_config)

    @property
    def padded_vocab_size(self) -> int:
        return padded_vocab_size(
            self.text_config["vocab_size"], divisible_by=self.make_vocab_size_divisible_by, tp_size=self.tp
        )

    def name_map(self) -> NameMap:
        # NOTE: the map of the MTP layers this checkpoint holds (transformers saves num_nextn_predict_layers 1
        # whether or not a checkpoint carries their weights)
        cfg = {**self.hf_config, "num_nextn_predict_layers": self.mtp_layers}
        return get_family(self.family).name_map(cfg, divisible_by=self.make_vocab_size_divisible_by)

    def params(self) -> Iterator[Param]:
        """Every concrete parameter, placed on this layout's stages and EP ranks."""
        return self.name_map().expand(
            num_layers=self.num_layers, num_experts=self.num_experts, pp=self.pp, vpp=self.vpp, ep=self.ep,
            first_stage_layers=self.first_stage_layers, last_stage_layers=self.last_stage_layers,
            mtp_layers=self.mtp_layers,
        )

    def ranks(self) -> Iterator[Rank]:
        for tp in range(self.tp):
            for pp in range(self.pp):
                for ep in range(self.ep):
                    for vpp in range(self.vpp):
                        yield tp, pp, ep, vpp

    def rank_file(self, root: str | os.PathLike, rank: Rank) -> Path:
        tp, pp, ep, vpp = rank
        name = "model.safetensors" if self.vpp == 1 else f"model_vpp{vpp}.safetensors"
        return Path(root) / f"mp_rank_{tp:02d}_{pp:03d}_{ep:03d}" / name

    def split_size(self, p: Param) -> int:
        """How many shards a parameter is cut into: ETP for routed experts, 1 in a whole component, TP otherwise."""
        if isinstance(p.rule, Expert):
            return self.etp
        for w in self.whole:
            prefix, tp = (w, 1) if isinstance(w, str) else w
            if p.megatron.startswith(prefix):
                return tp
        return self.tp

    def holders(self, p: Param) -> Iterator[tuple[Rank, int]]:
        """(rank, shard index) for every rank that stores ``p`` (replicas included)."""
        size = self.split_size(p)
        eps = range(self.ep) if p.where.ep_rank is None else [p.where.ep_rank]
        for tp in range(self.tp):
            for ep in eps:
                yield (tp, p.where.pp_rank, ep, p.where.vpp_rank), tp % size

    def shard_sources(self, p: Param) -> list[Rank]:
        """One rank per shard index, in order: where to read ``p``'s shards back from."""
        ep = p.where.ep_rank or 0
        return [(i, p.where.pp_rank, ep, p.where.vpp_rank) for i in range(self.split_size(p))]

    def save(self, root: str | os.PathLike) -> None:
        data = {"format": FORMAT, **asdict(self), "padded_vocab_size": self.padded_vocab_size}
        (Path(root) / LAYOUT_FILE).write_text(json.dumps(data, indent=2, sort_keys=True))

    @classmethod
    def load(cls, root: str | os.PathLike) -> MegatronLayout:
        """The layout a checkpoint was written with; a tampered or foreign file is one CheckpointError naming it
        (and the key)."""
        from loongforge_megatron.models.registry import load_config_json

        path = Path(root) / LAYOUT_FILE
        if not path.is_file():
            raise CheckpointError(f"{root}: not a LoongForge megatron checkpoint (no {LAYOUT_FILE})")
        data = load_config_json(path)
        if data.pop("format", None) != FORMAT:
            raise CheckpointError(f"{path}: unknown format (expected '{FORMAT}')")
        data.pop("padded_vocab_size", None)
        data.pop("megatron_config", None)  # NOTE: written by earlier versions; the family's spec derives it
        _check_fields(path, data)
        try:
            layout = cls(**data)
            get_family(layout.family)
            layout.num_layers, layout.num_experts  # noqa: B018 - fail here, with the file named
            text = layout.text_config
            layout.name_map()
        except CheckpointError as exc:
            raise CheckpointError(f"{path}: {exc}") from None
        except KeyError as exc:
            raise CheckpointError(f"{path}: key 'hf_config.{exc.args[0]}' is missing") from None
        except (TypeError, ValueError, AttributeError, ZeroDivisionError, OverflowError) as exc:
            raise CheckpointError(f"{path}: a value has the wrong kind ({str(exc).splitlines()[0][:120]})") from None
        Sizes(text, where=path, prefix="hf_config.")["vocab_size"]  # NOTE: an image model's is its class count
        return layout


_INT_FIELDS = ("tp", "pp", "vpp", "ep", "make_vocab_size_divisible_by", "mtp_layers")
_OPTIONAL_INT_FIELDS = ("etp", "first_stage_layers", "last_stage_layers")


def _check_fields(path: Path, data: dict[str, Any]) -> None:
    """The layout file's keys and their types (the rank files must exist for the sizes given)."""
    known = {f for f in MegatronLayout.__dataclass_fields__}
    unknown = sorted(set(data) - known)
    if unknown:
        raise CheckpointError(f"{path}: unknown key '{unknown[0]}' (allowed: format, {', '.join(sorted(known))})")
    for key in ("family", "hf_config"):
        if key not in data:
            raise CheckpointError(f"{path}: key '{key}' is missing")
    if not isinstance(data["family"], str):
        raise CheckpointError(f"{path}: key 'family' must be a string")
    if not isinstance(data["hf_config"], dict):
        raise CheckpointError(f"{path}: key 'hf_config' must be an object")
    for key in _INT_FIELDS + _OPTIONAL_INT_FIELDS:
        v = data.get(key)
        if v is None and (key in _OPTIONAL_INT_FIELDS or key not in data):
            continue
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 4096:
            raise CheckpointError(f"{path}: key '{key}' must be an integer from 0 to 4096, got {v!r:.40}")
    whole = data.get("whole", [])
    if not isinstance(whole, list) or not all(
            isinstance(w, str) or (isinstance(w, list) and len(w) == 2 and isinstance(w[0], str)
                                   and isinstance(w[1], int) and not isinstance(w[1], bool)) for w in whole):
        raise CheckpointError(f"{path}: key 'whole' must be a list of prefixes or [prefix, tp] pairs")
    data["whole"] = tuple(w if isinstance(w, str) else tuple(w) for w in whole)
    layers = data["hf_config"]
    from loongforge_megatron.conversion.config_tree import check_config_tree

    # NOTE: counts bounded by the tensors a rank file can name (no header read yet): far above any real model
    check_config_tree(layers, where=f"{path} (hf_config)", limit=2**16)
