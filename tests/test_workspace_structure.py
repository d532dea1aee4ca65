"""The workspace's structure, read from the sources (no imports): no import loop inside any package, and the failure
machinery in one place — each error class defined once, the failure helpers only in ``loongforge.failures``, and
one name for the skipped-steps metric wherever it is written or documented."""

from __future__ import annotations

import ast
import functools
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p for p in (ROOT / "packages").glob("*/src/*") if (p / "__init__.py").is_file())
FAILURES = "loongforge.failures"
# what the failure module owns: a definition of one of these names anywhere else is a second copy
FAILURE_NAMES = {"agree", "all_ranks_ok", "all_ranks_finite", "tensors_finite", "weights_finite",
                 "check_weights_finite", "NonFiniteGuard", "marker_path", "describe_error", "raised_on_every_rank"}
METRIC = re.compile(r"\bskipped_[a-z_]+")
QUOTED = re.compile(r"[\"'](skipped_[a-z_]+)[\"']")  # such a name as a string constant


class Module:
    """What the tests read of one source file: the modules it imports and the classes / functions it defines."""

    def __init__(self, name: str, path: Path):
        self.name, self.path = name, path
        self.imports: list[tuple[int, str | None, list[str]]] = []  # (level, module, names) of each import
        self.classes: list[str] = []
        self.functions: list[str] = []
        # NOTE: statements only (imports and definitions are statements): a walk of every expression node of the
        # workspace would take most of this file's time
        todo = list(ast.parse(path.read_text()).body)
        while todo:
            node = todo.pop()
            if isinstance(node, ast.Import):
                self.imports += [(0, a.name, []) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                self.imports.append((node.level, node.module, [a.name for a in node.names]))
            elif isinstance(node, ast.ClassDef):
                self.classes.append(node.name)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                self.functions.append(node.name)
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                todo += [n for n in getattr(node, field, ()) if isinstance(n, ast.stmt | ast.excepthandler |
                                                                                ast.match_case)]


@functools.cache
def modules() -> dict[str, Module]:
    """Every package's modules by dotted name; read once."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted(pkg.rglob("*.py")):
            parts = path.relative_to(pkg.parent).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = Module(name, path)
    return out


@functools.cache
def import_graph() -> dict[str, frozenset[str]]:
    """module -> the modules of its own package it imports: at module level AND inside functions (a lazy import that
    closes a loop is still a loop, only deferred), TYPE_CHECKING-only imports too. ``from pkg import name`` is an
    import of ``pkg.name`` when that is a module, else of ``pkg``."""
    mods = modules()
    graph: dict[str, frozenset[str]] = {}
    for name, module in mods.items():
        package = name.split(".") if module.path.name == "__init__.py" else name.split(".")[:-1]
        deps: set[str] = set()
        for level, imported, names in module.imports:
            if not names:  # ``import a.b``
                targets = [imported]
            else:
                base = package[: len(package) - level + 1] if level else []
                mod = ".".join(base + ([imported] if imported else []))
                targets = [f"{mod}.{n}" if f"{mod}.{n}" in mods else mod for n in names]
            for t in targets:
                while t and t not in mods:  # ``import a.b.c`` of a name inside a module: the module
                    t = t.rpartition(".")[0]
                if t and t != name and t.split(".")[0] == name.split(".")[0]:
                    deps.add(t)
        graph[name] = frozenset(deps)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import loop of ``graph`` as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            # NOTE: a package's __init__ importing its own submodules is how packages hand names on, not a loop
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
