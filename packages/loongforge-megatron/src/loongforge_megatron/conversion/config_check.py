"""An HF directory's config.json must describe its weights: every mapped tensor's shape in the safetensors headers
is compared with the shape its name-map entry derives from the config (``Entry.shape``), before anything is read
or built; mapped weights must be floating point. One mechanism for every family: the family's name map says what
each HF tensor's shape is as a function of the config, this module compares and names the key that disagrees."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import torch
from loongforge.errors import CheckpointError

from loongforge_megatron.conversion.config_tree import check_config_tree
from loongforge_megatron.conversion.sizes import Size, Sizes, as_shape, describe


class ShapeReader(Protocol):
    """What the check reads: tensor names, shapes and dtypes (a safetensors reader, or the specs of an export)."""

    def keys(self) -> Iterable[str]: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def dtype(self, name: str) -> torch.dtype: ...


class SpecReader:
    """A :class:`ShapeReader` over ``{name: (dtype, shape)}`` (the tensors an export is about to write)."""

    def __init__(self, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]]):
        self._specs = specs

    def keys(self) -> list[str]:
        return list(self._specs)

    def __contains__(self, name: str) -> bool:
        return name in self._specs

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._specs[name][1])

    def dtype(self, name: str) -> torch.dtype:
        return self._specs[name][0]


def _expected(shape: Any, roles: Iterable[str]) -> dict[str, list[tuple[Size | int, ...]]]:
    """role -> alternatives of one Entry.shape result (a tuple, a list of alternative tuples, or role -> either)."""
    def alts(s: Any) -> list[tuple]:
        return [tuple(a) for a in s] if isinstance(s, list) else [tuple(s)]

    if isinstance(shape, dict):
        return {r: alts(shape[r]) for r in roles if r in shape}
    return {r: alts(shape) for r in roles}


def check_weights(where: str | Path, hf_config: dict[str, Any], *, family: Any, reader: ShapeReader,
                  layout: Any) -> None:
    """Raise CheckpointError naming the config key, its value and the tensor shape it disagrees with, or a mapped
    tensor stored with a non-float dtype. ``layout``: a MegatronLayout of ``hf_config`` (its parameters are walked
    once; shapes are computed once per name-map entry)."""
    sizes = Sizes(hf_config, where=where)
    extra = getattr(family, "config_checks", None)
    if extra is not None:
        extra(sizes)
    names = set(reader.keys())
    cache: dict[int, dict[str, list[tuple]]] = {}
    seen: set[str] = set()
    mismatches: list[tuple[str, tuple[int, ...], tuple]] = []
    for p in layout.params():
        for role, name in p.hf.items():
            if name in seen or name not in names:
                continue
            seen.add(name)
            dtype = reader.dtype(name)
            if not dtype.is_floating_point:
                raise CheckpointError(f"{where}: tensor '{name}' is stored as {str(dtype).removeprefix('torch.')}; "
                                      "the model's weights are floating point (a float / bfloat16 checkpoint is "
                                      "needed)")
            if p.shape is None:
                continue
            if id(p.shape) not in cache:
                cache[id(p.shape)] = _expected(p.shape(sizes), p.hf)
            alts = cache[id(p.shape)].get(role)
            have = tuple(reader.shape(name))
            if alts and all(as_shape(a) != have for a in alts):
                mismatches.append((name, have, alts[0]))
    if mismatches:
        name, have, want = min(mismatches)
        raise CheckpointError(f"{where} does not match the weights: tensor '{name}' has shape {have} but the config "
                              f"({describe(want) or 'constant'}) gives {as_shape(want)}")


def check_hf_checkpoint(hf_dir: str | Path) -> None:
    """An HF checkpoint directory's config.json against its weights' headers (``checkpoint.load``, checked at
    validate: before any process builds a model)."""
    from loongforge.checkpoint import SafetensorsReader

    from loongforge_megatron.conversion.aliased_reader import AliasedReader
    from loongforge_megatron.conversion.fp8_blocks import fp8_reader
    from loongforge_megatron.models.registry import get_family, read_hf_config

    cfg = read_hf_config(hf_dir)
    family = get_family(hf_config=cfg)
    reader = fp8_reader(SafetensorsReader(hf_dir), cfg, where=Path(hf_dir) / "config.json")
    check_hf_dir(hf_dir, cfg, family=family, reader=AliasedReader(reader, family.hf_alias))


def check_hf_dir(hf_dir: str | Path, hf_config: dict[str, Any], *, family: Any, reader: ShapeReader,
                 mtp_layers: int | None = None) -> None:
    """:func:`check_weights` of an HF directory's config.json against its safetensors headers (pp / tp 1 layout:
    shapes are the HF tensors' own, whatever the run's parallel layout)."""
    check_config(Path(hf_dir) / "config.json", hf_config, family=family, reader=reader, mtp_layers=mtp_layers)


def check_config(where: str | Path, hf_config: dict[str, Any], *, family: Any, reader: ShapeReader,
                 mtp_layers: int | None = None) -> None:
    """:func:`check_weights` of ``hf_config`` (named ``where`` in errors) against ``reader``'s tensors."""
    layout = layout_of(where, hf_config, family=family, reader=reader, mtp_layers=mtp_layers)
    check_weights(where, hf_config, family=family, reader=reader, layout=layout)


def layout_of(where: str | Path, hf_config: dict[str, Any], *, family: Any, reader: ShapeReader,
              mtp_layers: int | None = None) -> Any:
    """The one-rank layout of ``hf_config`` after :func:`check_config_tree`; a config the family's name map cannot
    read (a key missing or of the wrong type) is one line naming the file."""
    from loongforge_megatron.conversion.layout import MegatronLayout

    names = list(reader.keys())
    check_config_tree(hf_config, where=where, limit=len(names))
    try:
        mtp = family.mtp_layers_in(hf_config, names) if mtp_layers is None else mtp_layers
        layout = MegatronLayout(family.name, hf_config, mtp_layers=mtp)
        layout.num_layers, layout.num_experts  # noqa: B018 - read here so a bad value fails with the file named
        layout.name_map()
    except CheckpointError as exc:
        raise CheckpointError(f"{where}: {exc}") from None
    except KeyError as exc:
        raise CheckpointError(f"{where}: key {exc} is missing") from None
    except (TypeError, ValueError, AttributeError, ZeroDivisionError, IndexError) as exc:
        raise CheckpointError(f"{where}: a key has a value of the wrong kind for family '{family.name}' "
                              f"({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})") from None
    return layout
