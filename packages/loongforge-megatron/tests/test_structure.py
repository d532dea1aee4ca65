"""The backend's structure: no import circle inside ``loongforge_megatron``, a job / backend that name no model,
and one family list (the ``loongforge.megatron.models`` entry points)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from import_graph import find_cycle
from import_graph import import_graph as workspace_graph

PKG = Path(__file__).resolve().parents[1] / "src" / "loongforge_megatron"


def import_graph() -> dict[str, frozenset[str]]:
    """module -> the ``loongforge_megatron`` modules it imports (the workspace's reader: at module level AND inside
    functions, TYPE_CHECKING-only imports too)."""
    return {name: deps for name, deps in workspace_graph().items() if name.split(".")[0] == PKG.name}


def test_the_graph_reader_sees_imports():
    graph = import_graph()
    assert "loongforge_megatron.hf_io" in graph["loongforge_megatron.checkpointing"] or \
        "loongforge_megatron.engine.model" in graph["loongforge_megatron.checkpointing"]
    assert "loongforge_megatron.models.registry" in graph["loongforge_megatron.config"]
    # a function-level import is an edge
    assert "loongforge_megatron.job" in graph["loongforge_megatron.backend"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_module_imports_one_that_imports_it_back():
    cycle = find_cycle(import_graph())
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
# vision configs), "conversations" (ShareGPT's SFT record field, data/sft.py), "mrope" (megatron's multimodal RoPE),
# "latents" / "vae" / "latent_cache" (every latent-diffusion kind's: DiT, Wan and Qwen-Image encode with an
# autoencoder; models/latent_cache.py is their shared cache).
KIND_WORDS = {
    "dit": ("dit", "class_dropout", "sample_size", "learn_sigma", "adaln"),
    "llava": ("llava", "CLIP"),
    "qwen_vl": ("qwen_vl", "qwen-vl", "qwen2_5_vl", "qwen3_vl", "deepstack"),
    "wan": ("wan", "t2v", "i2v", "ti2v", "umt5", "latent_frames", "latent_height", "latent_width", "boundary_ratio",
            "image_tokens", "rope_max_seq_len", "added_kv_proj_dim", "packed_frames"),
    "hybrid": ("qwen3_next", "qwen3-next", "qwen3_5", "qwen3.5", "deltanet", "linear_attention", "full_attention"),
    "qwen_image": ("qwen_image", "qwen-image", "qwenimage", "joint_attention_dim", "axes_dims_rope", "zero_cond_t",
                   "reference_images", "mmdit", "packed_sizes"),
}


# A kind whose models are another kind's model on its own layers names that kind (its modules, its words): the Qwen3.5
# VLMs (models/hybrid/) are the Qwen-VL model (models/qwen_vl/) on hybrid layers. The other way round stays closed.
BUILDS_ON = {"hybrid": ("qwen_vl",)}


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
    pyproject name its spec), and in the folders of the kinds that declare they build on it (``BUILDS_ON``)."""
    folder = PKG / "models" / kind
    users = [PKG / "models" / k for k, uses in BUILDS_ON.items() if kind in uses]
    found = []
    for path in sorted(PKG.rglob("*.py")):
        if folder in path.parents or any(u in path.parents for u in users):
            continue
        text = path.read_text()
        for word in KIND_WORDS[kind]:
            found += [f"{path.relative_to(PKG)}:{n}: {word}" for n in _hits(word, text)]
    assert not found, f"{kind}'s words outside models/{kind}/:\n" + "\n".join(found)
