"""The workspace's structure, read from the sources (no imports): no import loop inside any package, and the failure
machinery in one place — each error class defined once, the failure helpers only in ``loongforge.failures``, and
one name for the skipped-steps metric wherever it is written or documented."""

from __future__ import annotations

import re
from collections import defaultdict

from import_graph import PACKAGES, ROOT, find_cycle, import_graph, modules

FAILURES = "loongforge.failures"
# what the failure module owns: a definition of one of these names anywhere else is a second copy
FAILURE_NAMES = {"agree", "all_ranks_ok", "all_ranks_finite", "tensors_finite", "weights_finite",
                 "check_weights_finite", "NonFiniteGuard", "marker_path", "describe_error", "raised_on_every_rank"}
METRIC = re.compile(r"\bskipped_[a-z_]+")
QUOTED = re.compile(r"[\"'](skipped_[a-z_]+)[\"']")  # such a name as a string constant


def test_the_graph_reader_sees_lazy_imports():
    graph = import_graph()
    assert {p.name for p in PACKAGES} >= {"loongforge", "loongforge_megatron", "loongforge_embodied"}
    assert "loongforge_embodied.job" in graph["loongforge_embodied.backend"]  # inside build()
    assert "loongforge.failures" in graph["loongforge.worker"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"p": {"p.x"}, "p.x": {"p"}}) is None


def test_no_module_imports_one_that_imports_it_back():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import loop: " + " -> ".join(cycle)


def _definitions(*, classes: bool, functions: bool) -> dict[str, list[str]]:
    where: dict[str, list[str]] = defaultdict(list)
    for name, module in modules().items():
        for defined in (module.classes if classes else []) + (module.functions if functions else []):
            where[defined].append(name)
    return where


def test_each_error_class_is_defined_once():
    classes = _definitions(classes=True, functions=False)
    errors = {k: v for k, v in classes.items() if k.endswith(("Error", "Exception"))}
    twice = {k: v for k, v in errors.items() if len(v) > 1}
    assert not twice, f"error classes defined more than once: {twice}"
    for name in ("LoongForgeError", "PeerFailedError", "NonFiniteError", "CheckpointError", "RecipeError"):
        assert errors.get(name) == ["loongforge.errors"], (name, errors.get(name))


def test_the_failure_helpers_live_only_in_the_failure_module():
    found = {k: v for k, v in _definitions(classes=True, functions=True).items()
             if k in FAILURE_NAMES and v != [FAILURES]}
    assert not found, f"failure machinery outside {FAILURES}: {found}"


def test_the_skipped_steps_metric_has_one_name_defined_once():
    """The metric's name is one string constant (``SKIPPED_NONFINITE``); every backend, description, README and doc
    that writes a ``skipped_*`` name writes that one."""
    sources = {name: m.path.read_text() for name, m in modules().items()}
    constants = [(name, word) for name, text in sources.items() for word in QUOTED.findall(text)]
    assert len(constants) == 1 and constants[0][0] == FAILURES, constants
    metric = constants[0][1]
    assert f"SKIPPED_NONFINITE = \"{metric}\"" in sources[FAILURES]
    docs = [ROOT / "README.md", *ROOT.glob("packages/*/README.md"), *ROOT.glob("docs/**/*.md")]
    texts = {**{str(m.path.relative_to(ROOT)): sources[n] for n, m in modules().items()},
             **{str(p.relative_to(ROOT)): p.read_text() for p in docs}}
    others = {(where, word) for where, text in texts.items() for word in METRIC.findall(text) if word != metric}
    assert not others, f"the skipped-steps metric is '{metric}': {sorted(others)}"
