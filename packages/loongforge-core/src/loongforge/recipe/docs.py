"""``docs/recipes.md``: every recipe key with its type, default and meaning, generated from the schema classes.

    python -m loongforge.recipe.docs                  # rewrite docs/recipes.md
    python -m loongforge.recipe.docs --check          # exit 1 when docs/recipes.md is not what the schemas give

The core sections come from :mod:`loongforge.recipe.schema`; each installed backend (found through the
``loongforge.backends`` registry, never imported by name) contributes the classes its
:meth:`Backend.recipe_schemas` returns — its ``model`` / ``data`` sections, the keys it adds to ``parallel`` /
``kernels``, and any per-kind class. Nothing here knows a backend's keys: a new schema class is documented by being
returned there.
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from loongforge.recipe import schema

HEADER = """# Recipe keys

Every key a recipe may set, with its type, default and meaning. Generated from the schema classes by
`python -m loongforge.recipe.docs` (a test fails when this file is stale); do not edit it by hand.
A recipe is YAML; `extends:` merges a base recipe and `a.b.c=value` on the command line overrides a key.
Keys a section does not list are errors, as are values outside the type shown.
"""

CORE_SECTIONS: dict[str, type[BaseModel]] = {
    "parallel": schema.ParallelConfig,
    "train": schema.TrainConfig,
    "checkpoint": schema.CheckpointConfig,
    "accelerator": schema.AcceleratorConfig,
    "kernels": schema.KernelsConfig,
    "logging": schema.LoggingConfig,
}


def _type_name(ann: Any) -> str:
    """A short, readable rendering of a field's annotation (``int | None``, ``one of a, b``, ``list[str]``)."""
    origin = typing.get_origin(ann)
    args = typing.get_args(ann)
    if ann is type(None):
        return "null"
    if origin is Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in args)
    if origin in (list, tuple, set):
        return f"list[{', '.join(_type_name(a) for a in args if a is not Ellipsis)}]"
    if origin is dict:
        return f"map[{_type_name(args[0])}, {_type_name(args[1])}]" if args else "map"
    if origin is typing.Annotated:
        return _type_name(args[0])
    if ann is Any:
        return "any"
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return "section"
    return getattr(ann, "__name__", str(ann))


def _bounds(info: FieldInfo) -> str:
    """The numeric bounds and pattern of a field (``>= 1``, ``> 0, < 1``)."""
    out = []
    for meta in info.metadata:
        for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            v = getattr(meta, attr, None)
            if v is not None:
                out.append(f"{sign} {v}")
        if getattr(meta, "pattern", None):
            out.append(f"matches `{meta.pattern}`")
    return ", ".join(out)


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        value = info.default_factory()
    elif info.default is PydanticUndefined:
        return "required"
    else:
        value = info.default
    if isinstance(value, BaseModel):
        return "(section)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if value in ([], {}):
        return "empty"
    return f"`{value}`"


def _sections_in(ann: Any) -> list[tuple[str, type[BaseModel]]]:
    """Nested sections reachable from an annotation: (key suffix, class); ``.<name>`` for a map's values."""
    origin = typing.get_origin(ann)
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return [("", ann)]
    if origin is dict:
        return [(".<name>" + s, c) for s, c in _sections_in(typing.get_args(ann)[1])]
    if origin in (list, tuple, set):
        return [("[]" + s, c) for a in typing.get_args(ann) for s, c in _sections_in(a)]
    if origin in (typing.Union, types.UnionType, typing.Annotated):
        return [x for a in typing.get_args(ann) for x in _sections_in(a)]
    return []


def rows(cls: type[BaseModel], prefix: str, *, skip: set[str] = frozenset()) -> list[tuple[str, str, str, str]]:
    """(key, type, default, meaning) of every field of ``cls`` under ``prefix``, nested sections flattened."""
    out: list[tuple[str, str, str, str]] = []
    for name, info in cls.model_fields.items():
        if name in skip:
            continue
        key = f"{prefix}.{name}" if prefix else name
        kind = _type_name(info.annotation)
        bounds = _bounds(info)
        doc = " ".join((info.description or "").split())
        nested = _sections_in(info.annotation)
        if nested and not doc:
            doc = " ".join((nested[0][1].__doc__ or "").split())
        out.append((key, kind + (f" ({bounds})" if bounds else ""), _default(info), doc))
        for suffix, sub in nested:
            out += rows(sub, key + suffix)
    return out


def _table(rows_: list[tuple[str, str, str, str]]) -> list[str]:
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for key, kind, default, doc in rows_:
        lines.append(f"| `{key}` | {kind} | {default} | {doc.replace('|', chr(92) + '|')} |")
    return lines


def _doc(cls: type[BaseModel]) -> str:
    return " ".join((cls.__doc__ or "").split())


def backend_schemas() -> dict[str, dict[str, type[BaseModel]]]:
    """Every registered backend's documented schema classes, by backend name (sorted); broken plugins skipped."""
    from loongforge import registry
    from loongforge.backend import Backend

    out = {}
    for entry in sorted(registry.backends.entries(), key=lambda e: e.key):
        cls = entry.obj
        if entry.error or not (isinstance(cls, type) and issubclass(cls, Backend)):
            continue
        out[entry.key] = cls.recipe_schemas()
    return out


def render(backends: dict[str, dict[str, type[BaseModel]]] | None = None) -> str:
    """The whole of ``docs/recipes.md``."""
    backends = backend_schemas() if backends is None else backends
    lines = [HEADER, "## Top level", ""]
    lines += _table(rows(schema.Recipe, "", skip={"model", "data", *CORE_SECTIONS}))
    lines += ["", "`model` and `data` belong to the backend (see its sections below).", ""]
    for section, cls in CORE_SECTIONS.items():
        lines += [f"## `{section}`", "", _doc(cls), ""] if _doc(cls) else [f"## `{section}`", ""]
        lines += _table(rows(cls, section)) + [""]
    for backend, sections in backends.items():
        lines += [f"## Backend `{backend}`", ""]
        for title, cls in sections.items():
            section = title.split()[0]
            base = CORE_SECTIONS.get(section)
            # NOTE: a backend's parallel / kernels class subclasses core's: list only the keys it adds
            skip = set(base.model_fields) if base is not None and issubclass(cls, base) else set()
            lines += [f"### `{title}`" + (" (keys added to the core section)" if skip else ""), ""]
            if _doc(cls):
                lines += [_doc(cls), ""]
            lines += _table(rows(cls, section, skip=skip)) + [""]
    return "\n".join(lines).rstrip() + "\n"


def default_path() -> Path:
    """``docs/recipes.md`` of the repository this package is checked out in (or of the current directory)."""
    for parent in Path(__file__).resolve().parents:
        if (parent / "docs").is_dir() and (parent / "packages").is_dir():
            return parent / "docs" / "recipes.md"
    return Path("docs/recipes.md")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loongforge.recipe.docs", description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", type=Path, default=None, help="default: the repository's docs/recipes.md")
    ap.add_argument("--check", action="store_true", help="exit 1 if the file differs from what the schemas give")
    args = ap.parse_args(argv)
    path = args.output or default_path()
    text = render()
    if args.check:
        current = path.read_text() if path.is_file() else ""
        if current != text:
            print(f"{path} is stale: run `python -m loongforge.recipe.docs`", file=sys.stderr)
            return 1
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
