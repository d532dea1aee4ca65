"""The workspace's import graph, read from the sources (no imports): each module's imports (at module level and inside
functions) and definitions, for the structure tests of the workspace and of each package."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = sorted(p for p in (ROOT / "packages").glob("*/src/*") if (p / "__init__.py").is_file())


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
