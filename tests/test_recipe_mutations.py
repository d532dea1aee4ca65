"""Every leaf of every shipped recipe, mutated (deleted / wrong type / unknown sibling): `loongforge validate`
either accepts the recipe or exits 2 with one line naming the key — never a traceback."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from loongforge.cli import main
from loongforge.recipe.loader import resolve_extends

ROOT = Path(__file__).resolve().parents[1] / "recipes"
RECIPES = sorted(p for p in ROOT.rglob("*.yaml") if not p.name.startswith("_"))


def leaves(node, path=()):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from leaves(v, (*path, k))
    else:
        yield path, node


def wrong_type(value):
    if isinstance(value, bool):
        return {"nested": 1}
    if isinstance(value, int | float):
        return "not-a-number"
    if isinstance(value, str):
        return {"unexpected": ["a", "b"]}
    if isinstance(value, list):
        return 12345
    return "x"


def set_at(data, path, value=None, delete=False):
    node = data
    for k in path[:-1]:
        node = node[k]
    if delete:
        del node[path[-1]]
    else:
        node[path[-1]] = value


def validate(tmp_path, data, capsys) -> tuple[int, str]:
    p = tmp_path / "mutated.yaml"
    p.write_text(yaml.safe_dump(data))
    code = main(["validate", str(p)])
    err = capsys.readouterr().err
    return code, err


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_leaf_mutation_is_a_clean_error(recipe, tmp_path, capsys):
    base = resolve_extends(recipe)
    assert main(["validate", str(recipe)]) == 0, capsys.readouterr().err
    capsys.readouterr()
    checked = 0
    for path, value in leaves(base):
        key = ".".join(map(str, path))
        for kind in ("delete", "wrong_type", "unknown_sibling"):
            data = copy.deepcopy(base)
            if kind == "delete":
                set_at(data, path, delete=True)
            elif kind == "wrong_type":
                set_at(data, path, wrong_type(value))
            else:
                parent = (*path[:-1], "zz_unknown_key")
                set_at(data, parent, 1)
            code, err = validate(tmp_path, data, capsys)
            assert "Traceback" not in err, (key, kind, err)
            if kind == "delete":
                assert code in (0, 2), (key, kind, code, err)
            else:
                assert code == 2, (key, kind, code, err)
            if code == 2:
                assert err.startswith("error: ") and err.count("\n") == 1, (key, kind, err)
                if kind == "unknown_sibling":
                    assert "zz_unknown_key" in err, (key, err)
                elif kind == "wrong_type" and path[0] not in ("backend",):
                    assert str(path[0]) in err, (key, err)
            checked += 1
    assert checked >= 3


@pytest.mark.parametrize(("recipe", "override"), [
    ("embodied/tiny_vla_synthetic.yaml", "parallel.components={vision: {tp: 1}}"),
    ("embodied/tiny_vla_synthetic.yaml", "parallel.recompute_layers=2"),
])
def test_keys_a_backend_does_not_use_are_refused(recipe, override, capsys):
    """A shared key the recipe's backend ignores (``Backend.unused_keys``) is an error naming it, not a silent no-op;
    setting it to its default is fine."""
    key = override.split("=")[0]
    code = main(["validate", str(ROOT / recipe), override])
    err = capsys.readouterr().err
    assert code == 2 and f"key '{key}'" in err and "not used by the" in err and err.count("\n") == 1, err
    from loongforge.backend import get_backend_class

    assert key in get_backend_class(resolve_extends(ROOT / recipe)["backend"]).unused_keys


@pytest.mark.parametrize(("recipe", "override"), [
    ("llm/tiny/llama_tiny.yaml", "parallel.shard_size=2"),
    ("llm/tiny/llama_tiny.yaml", "parallel.strategy=auto"),
    ("embodied/tiny_vla_synthetic.yaml", "kernels.layers=te"),
    ("embodied/tiny_vla_synthetic.yaml", "kernels.grad_accum_fusion=true"),
])
def test_another_backends_keys_are_unknown_keys(recipe, override, capsys):
    """A key one backend owns (``Backend.parallel_schema`` / ``kernels_schema``) does not exist for the other: an
    unknown-key error naming it and the allowed keys, in one line; the other backend lists none of them."""
    key = override.split("=")[0]
    code = main(["validate", str(ROOT / recipe), override])
    err = capsys.readouterr().err
    assert code == 2 and f"key '{key}': unknown key" in err and "allowed keys" in err and err.count("\n") == 1, err
    from loongforge.backend import get_backend_class

    for name in ("megatron", "embodied"):
        assert key not in get_backend_class(name).unused_keys


def test_an_unused_key_at_its_default_is_accepted(capsys):
    assert main(["validate", str(ROOT / "embodied/tiny_vla_synthetic.yaml"), "train.eval_steps=1"]) == 0, \
        capsys.readouterr()
