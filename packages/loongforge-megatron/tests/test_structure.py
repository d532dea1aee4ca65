"""The backend's structure: no import circle inside ``loongforge_megatron``, a job / backend that name no model,
and one family list (the ``loongforge.megatron.models`` entry points)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "src" / "loongforge_megatron"


def _module(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the ``loongforge_megatron`` modules it imports, at module level AND inside functions (both count:
    a function-level import that closes a loop is still a circle, only deferred). ``from pkg import name`` counts
    as an import of ``pkg.name`` when that is a module, else of ``pkg``. TYPE_CHECKING-only imports count too."""
    modules = {_module(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
            for t in targets:
                while t and t not in modules:  # ``import a.b.c`` of a name inside a module: the module
                    t = t.rpartition(".")[0]
                if t.startswith("loongforge_megatron") and t != name:
                    deps.add(t)
        graph[name] = deps
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            # NOTE: a package's __init__ importing its own submodules is how packages hand names on, not a circle
            if n.startswith(m + ".") or m.startswith(n + "."):
                continue
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_the_graph_reader_sees_imports():
    graph = import_graph()
    assert "loongforge_megatron.hf_io" in graph["loongforge_megatron.checkpointing"] or \
        "loongforge_megatron.engine.model" in graph["loongforge_megatron.checkpointing"]
    assert "loongforge_megatron.models.registry" in graph["loongforge_megatron.config"]
    # a function-level import is an edge
    assert "loongforge_megatron.job" in graph["loongforge_megatron.backend"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_module_imports_one_that_imports_it_back():
    cycle = _cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


# Names of model kinds / families and the attributes that used to select them.
_MODEL_WORDS = ("llama", "qwen", "mistral", "deepseek", "llava", "dit", "vlm", "gpt", "family", "is_dit", "is_vlm",
                "is_mla", "vision", "clip")


@pytest.mark.parametrize("name", ["job.py", "backend.py"])
def test_job_and_backend_branch_on_no_model(name):
    """No ``if`` / conditional expression / match in the job or the backend tests a model kind or family: the
    spec decides. (Features such as MoE router statistics stay: ``arch.is_moe`` is not a model kind.)"""
    tree = ast.parse((PKG / name).read_text())
    found = []
    for node in ast.walk(tree):
        tests = []
        if isinstance(node, (ast.If, ast.IfExp, ast.While)):
            tests = [node.test]
        elif isinstance(node, ast.comprehension):
            tests = node.ifs
        elif isinstance(node, ast.Match):
            tests = [node.subject]
        for t in tests:
            words = {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
            words |= {n.attr for n in ast.walk(t) if isinstance(n, ast.Attribute)}
            words |= {str(n.value) for n in ast.walk(t) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
            hits = [w for w in words if any(k in w.lower() for k in _MODEL_WORDS)]
            if hits:
                found.append((node.lineno, hits))
    assert not found, f"{name} branches on a model: {found}"


def test_the_family_list_exists_once():
    """Every family the backend ships is an entry point of its pyproject, and the registry sees exactly those."""
    import tomllib

    from loongforge_megatron.models import registry

    pyproject = tomllib.loads((PKG.parents[1] / "pyproject.toml").read_text())
    declared = pyproject["project"]["entry-points"][registry.GROUP]
    assert set(declared) <= set(registry.families.keys())
    for key, spec in registry.all_specs().items():
        assert spec.name == key
        from loongforge_megatron.models.spec import ModelSpec

        assert isinstance(spec, ModelSpec), key


# Each model kind's own words: its name, its data format and recipe keys, its building blocks. None of them may
# appear (in code, strings or comments) outside the kind's folder: adding or removing a kind edits one folder.
# A word with a capital letter matches in that case only, as a whole word ("CLIP", not gradient clipping's _CLIP);
# others in any case, also as a part of an identifier (``is_dit``).
# NOTE: words other kinds share are not listed: "diffusers" (a checkpoint format), "image_size" / "patch_size" (HF
# vision configs), "conversations" (ShareGPT's SFT record field, data/sft.py), "mrope" (megatron's multimodal RoPE).
KIND_WORDS = {
    "dit": ("dit", "latents", "vae", "class_dropout", "sample_size", "learn_sigma", "adaln"),
    "llava": ("llava", "CLIP"),
    "qwen_vl": ("qwen_vl", "qwen-vl", "qwen2_5_vl", "qwen3_vl", "deepstack"),
    "wan": ("wan", "t2v", "i2v", "ti2v", "umt5", "latent_frames", "latent_height", "latent_width", "boundary_ratio",
            "image_tokens", "rope_max_seq_len", "added_kv_proj_dim"),
    "qwen_image": ("qwen_image", "qwen-image", "qwenimage", "joint_attention_dim", "axes_dims_rope", "zero_cond_t",
                   "reference_images", "mmdit"),
}


def _hits(word: str, text: str) -> list[int]:
    import re

    exact = word != word.lower()  # NOTE: an identifier part counts (``is_dit``), except for a capitalised word
    edge = "A-Za-z0-9_" if exact else "A-Za-z0-9"
    pattern = re.compile(rf"(?<![{edge}]){re.escape(word)}(?![{edge}])", 0 if exact else re.IGNORECASE)
    return [i + 1 for i, line in enumerate(text.splitlines()) if pattern.search(line)]


def test_the_word_reader_sees_words():
    assert _hits("dit", "a DiT's latents\nedit it\nis_dit") == [1, 3]
    assert _hits("CLIP", "LLaVA's CLIP tower\ngrad clip\n_CLIP = 1") == [1]


@pytest.mark.parametrize("kind", sorted(KIND_WORDS))
def test_no_kind_is_named_outside_its_folder(kind):
    """A kind's name, data format and recipe keys live in ``models/<kind>/`` only (the entry points in the
    pyproject name its spec)."""
    folder = PKG / "models" / kind
    found = []
    for path in sorted(PKG.rglob("*.py")):
        if folder in path.parents:
            continue
        text = path.read_text()
        for word in KIND_WORDS[kind]:
            found += [f"{path.relative_to(PKG)}:{n}: {word}" for n in _hits(word, text)]
    assert not found, f"{kind}'s words outside models/{kind}/:\n" + "\n".join(found)
