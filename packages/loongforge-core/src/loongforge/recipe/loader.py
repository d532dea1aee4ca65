"""Load a recipe: YAML → ``extends:`` merge → ``a.b.c=value`` overrides → validated :class:`Recipe`.

Every failure is a :class:`RecipeError` naming the file and the dotted key path; the CLI prints it on one line.
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from loongforge.errors import LoongForgeError, PluginError, RecipeError
from loongforge.recipe import limits
from loongforge.recipe.schema import SECTIONS, Recipe


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, except that a key repeated in one mapping is an error (YAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # NOTE: ``<<: *base`` merges; explicit keys override it
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                repeated = key in seen
            except TypeError:  # an unhashable key: the base loader reports it
                break
            if repeated:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key '{key}' appears twice in one mapping", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Parse one YAML file into a mapping; errors name the file and the line."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError("file not found", file=str(path))
    if path.stat().st_size > limits.MAX_BYTES:
        raise RecipeError(f"{path.stat().st_size:,} bytes: larger than a recipe can be ({limits.MAX_BYTES:,})",
                          file=str(path))
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise RecipeError(f"not UTF-8 text (byte {exc.start}); save the recipe as UTF-8", file=str(path)) from None
    except OSError as exc:
        raise RecipeError(f"cannot be read ({exc.strerror or exc})", file=str(path)) from None
    limits.check_yaml_depth(text, file=str(path))
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise RecipeError(f"invalid YAML{where}: {problem}", file=str(path)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RecipeError(f"a recipe must be a mapping of sections, got {type(data).__name__}", file=str(path))
    return data


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Recursively merge ``over`` into a copy of ``base``: mappings merge, everything else replaces."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def resolve_extends(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read ``path`` and merge the recipes it ``extends:`` (paths relative to the file), parents first."""
    path = Path(path).resolve()
    if path in _seen:
        chain = " -> ".join(str(p) for p in (*_seen, path))
        raise RecipeError(f"extends cycle: {chain}", key="extends", file=str(path))
    data = read_yaml(path)
    parents = data.pop("extends", None)
    if parents is None:
        return data
    if isinstance(parents, str):
        parents = [parents]
    if not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
        raise RecipeError("must be a path or a list of paths", key="extends", file=str(path))
    merged: dict[str, Any] = {}
    for parent in parents:
        parent_path = (path.parent / parent).resolve()
        if not parent_path.is_file():
            raise RecipeError(f"extended recipe '{parent}' not found (looked for {parent_path})", key="extends", file=str(path))
        merged = deep_merge(merged, resolve_extends(parent_path, (*_seen, path)))
    return deep_merge(merged, data)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` → (["a","b","c"], value); the value is parsed as YAML (``3``, ``true``, ``[dist,hf]``)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise RecipeError(f"override '{text}' is not of the form a.b.c=value")
    if len(text) > limits.MAX_BYTES:
        raise RecipeError(f"override of {len(text):,} characters: larger than a recipe can be", key=key)
    limits.check_yaml_depth(raw, file=None, what=f"override '{key}'")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply command-line overrides to a recipe mapping (creating intermediate mappings)."""
    out = copy.deepcopy(data)
    for text in overrides:
        path, value = parse_override(text)
        node = out
        for i, part in enumerate(path[:-1]):
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            elif not isinstance(nxt, dict):
                if path[0] == "accelerator" and i == 0 and isinstance(nxt, str):
                    nxt = node[part] = {"name": nxt}
                else:
                    raise RecipeError(f"cannot set '{'.'.join(path)}': '{'.'.join(path[: i + 1])}' is not a section", key=".".join(path))
            node = nxt
        node[path[-1]] = value
    return out


def _format_loc(loc: Sequence[Any], prefix: str) -> str:
    parts = [prefix] if prefix else []
    parts += [str(p) for p in loc if not (isinstance(p, str) and p.startswith(("function-", "union[", "literal[")))]
    return ".".join(p for p in parts if p)


def _fields_at(model: type[BaseModel], loc: Sequence[Any]) -> list[str]:
    """Known field names of the (nested) model that owns ``loc[-1]``, for did-you-mean suggestions."""
    cls: Any = model
    for part in loc[:-1]:
        field = getattr(cls, "model_fields", {}).get(part)
        if field is None:
            return []
        ann = field.annotation
        candidates = [ann, *getattr(ann, "__args__", ())]
        cls = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if cls is None:
            return []
    return list(getattr(cls, "model_fields", {}))


def validation_error(exc: ValidationError, *, schema: type[BaseModel], prefix: str = "", file: str | None = None) -> RecipeError:
    """Turn pydantic's first error into a one-line :class:`RecipeError` with the key path."""
    err = exc.errors()[0]
    loc = err.get("loc", ())
    key = _format_loc(loc, prefix)
    kind = err.get("type", "")
    value = err.get("input")
    if kind == "extra_forbidden":
        name = str(loc[-1]) if loc else "?"
        known = _fields_at(schema, loc)
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        allowed = f"; allowed keys: {', '.join(known)}" if known and not close else ""
        return RecipeError(f"unknown key{hint}{allowed}", key=key, file=file)
    if kind == "missing":
        return RecipeError("required key is missing", key=key, file=file)
    msg = err.get("msg", "invalid value").replace("\n", " ")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    if isinstance(value, dict) and kind == "value_error":  # NOTE: a section's own check: its message says it all
        return RecipeError(msg, key=key, file=file)
    shown = repr(value) if not isinstance(value, dict | list) else type(value).__name__
    return RecipeError(f"{msg} (got {shown})", key=key, file=file)


def _check_plugin_names(recipe: Recipe, *, file: str | None) -> None:
    """Accelerator and kernel-provider names must be installed (availability is checked at run time)."""
    from loongforge import registry

    for key, value, reg in (
        ("accelerator.name", recipe.accelerator.name, registry.accelerators),
        ("kernels.provider", recipe.kernels.provider, registry.kernels),
    ):
        if value == "auto" or value in reg:
            continue
        hint = registry.KNOWN_PROVIDERS.get((reg.group, value))
        if hint:
            from loongforge.registry import install_hint

            raise RecipeError(f"'{value}' is not installed: {install_hint(hint)}", key=key, file=file)
        known = ["auto", *reg.keys()]
        close = difflib.get_close_matches(value, known, n=1)
        suggestion = f" (did you mean '{close[0]}'?)" if close else ""
        raise RecipeError(f"unknown value '{value}'{suggestion}; installed: {', '.join(known)}", key=key, file=file)


def validate_recipe(data: dict[str, Any], *, file: str | None = None, backend_schemas: bool = True) -> Recipe:
    """Validate a merged recipe mapping into a :class:`Recipe`.

    With ``backend_schemas`` (the default) the backend named by ``backend`` must be installed: its ``model``
    and ``data`` schemas validate those sections.
    """
    odd = [k for k in data if not isinstance(k, str)]
    if odd:
        # NOTE: YAML reads 1:, null:, yes: / on: (True) as non-string keys
        raise RecipeError(f"section names are strings; {odd[0]!r} is a {type(odd[0]).__name__} (quote it, or fix "
                          f"the indentation); allowed sections: {', '.join(SECTIONS)}", key=str(odd[0]), file=file)
    unknown = [k for k in data if k not in SECTIONS and k != "description"]
    if unknown:
        close = difflib.get_close_matches(unknown[0], SECTIONS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else f"; allowed sections: {', '.join(SECTIONS)}"
        raise RecipeError(f"unknown section{hint}", key=unknown[0], file=file)
    if "backend" not in data:
        raise RecipeError("required key is missing (e.g. backend: megatron)", key="backend", file=file)
    if not isinstance(data["backend"], str):
        raise RecipeError(f"must be a backend name (got {data['backend']!r})", key="backend", file=file)
    backend_cls, missing = None, None
    own: dict[str, Any] = {}  # the sections a backend extends with its own keys, validated by its schema below
    if backend_schemas:
        from loongforge.backend import get_backend_class

        try:
            backend_cls = get_backend_class(data["backend"])
        except PluginError as exc:
            missing = exc  # NOTE: reported after the core sections' own errors, as before
        own = {s: data[s] for s in ("parallel", "kernels")
               if getattr(backend_cls, f"{s}_schema", None) is not None and s in data}
    try:
        recipe = Recipe.model_validate({k: v for k, v in data.items() if k not in own})
    except ValidationError as exc:
        raise validation_error(exc, schema=Recipe, file=file) from None
    if backend_cls is None:
        _check_plugin_names(recipe, file=file)
        if missing is not None:
            raise RecipeError(str(missing), key="backend", file=file) from None
        return recipe
    for section in ("parallel", "kernels"):
        _validate_backend_section(recipe, backend_cls, section, own.get(section), file=file)
    _check_plugin_names(recipe, file=file)
    for section in ("model", "data"):
        _validate_backend_section(recipe, backend_cls, section, data.get(section), file=file)
    try:
        _refuse_unused(recipe, backend_cls.unused_keys, backend=recipe.backend)
        backend_cls.check_recipe(recipe)
    except RecipeError as exc:
        if exc.file is None and file:
            raise RecipeError(exc.message, key=exc.key, file=file) from None
        raise
    return recipe


def _refuse_unused(recipe: Recipe, unused: dict[str, str], *, backend: str) -> None:
    """``RecipeError`` for the first key of ``unused`` that the recipe sets to something other than its default."""
    for key, why in unused.items():
        *parents, leaf = key.split(".")
        section = recipe
        for name in parents:
            section = getattr(section, name)
        field = type(section).model_fields[leaf]
        if getattr(section, leaf) != field.get_default(call_default_factory=True):
            raise RecipeError(f"not used by the {backend} backend: {why}", key=key)


def load_recipe(path: str | Path, overrides: Sequence[str] = (), *, backend_schemas: bool = True) -> Recipe:
    """Load a recipe file with ``extends:`` and overrides, validated. The public entry point."""
    data = apply_overrides(resolve_extends(path), overrides)
    limits.check_size(data, file=str(path))
    try:
        return validate_recipe(data, file=str(path), backend_schemas=backend_schemas)
    except RecipeError as exc:
        origin = _key_origin(path, exc.key) if exc.key and exc.file == str(path) else None
        overridden = exc.key and any(o.partition("=")[0].strip() == exc.key for o in overrides)
        if origin is None or origin == Path(path).resolve() or overridden:
            raise
        # NOTE: the key was set in a recipe this one extends: name that file, where the fix goes
        raise RecipeError(exc.message, key=exc.key, file=f"{origin} (extended by {path})") from None


def _key_origin(path: str | Path, key: str, _seen: tuple[Path, ...] = ()) -> Path | None:
    """The file of ``path``'s ``extends:`` chain whose value of dotted ``key`` the merge kept (the last one to set
    it: the recipe itself, then its parents last to first), or None."""
    path = Path(path).resolve()
    if path in _seen:
        return None
    try:
        data = read_yaml(path)
    except RecipeError:
        return None
    node: Any = data
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            break
        node = node[part]
    else:
        return path
    parents = data.get("extends") or []
    for parent in reversed([parents] if isinstance(parents, str) else parents):
        if isinstance(parent, str):
            found = _key_origin(path.parent / parent, key, (*_seen, path))
            if found is not None:
                return found
    return None


def dump_recipe(recipe: Recipe, *, data: dict[str, Any] | None = None) -> str:
    """YAML text of the fully resolved recipe (``data``: its plain data to write instead, e.g.
    :meth:`Backend.resolved`)."""
    return yaml.safe_dump(recipe.to_dict() if data is None else data, sort_keys=False, default_flow_style=False)


def _validate_backend_section(recipe: Recipe, backend_cls: Any, section: str, raw: Any, *, file: Any) -> None:
    """Replace ``recipe.<section>`` by the backend's own schema for it (``<section>_schema``), when it has one."""
    raw = raw or {}
    if not isinstance(raw, dict):
        if getattr(backend_cls, f"{section}_schema", None) is None:
            return
        raise RecipeError(f"must be a mapping (got {type(raw).__name__})", key=section, file=file)
    pick = getattr(backend_cls, "section_schema", None)
    try:
        schema = pick(section, raw=raw, recipe=recipe) if pick else getattr(backend_cls, f"{section}_schema", None)
    except RecipeError as exc:
        raise RecipeError(exc.message, key=exc.key, file=exc.file or file) from None
    if schema is None:
        return
    try:
        setattr(recipe, section, schema.model_validate(raw))
    except ValidationError as exc:
        raise validation_error(exc, schema=schema, prefix=section, file=file) from None
    except LoongForgeError as exc:
        raise RecipeError(str(exc), key=section, file=file) from None
