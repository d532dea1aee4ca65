"""Backends run kernels only through the core's kernel registry: no module of the megatron or the embodied backend
imports ``loongforge_kernels`` (an AST scan of their sources), and nothing in the workspace's sources reads a
second selection rule from the environment (``LOONGFORGE_KERNELS`` is gone; ``kernels.provider`` is the one)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = [ROOT / "packages" / name / "src" for name in ("loongforge-megatron", "loongforge-embodied")]


def _kernel_imports(path: Path, *, base: Path = ROOT) -> list[str]:
    """``file:line imports module`` for each import of ``loongforge_kernels`` (or a submodule) in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
        found += [f"{path.relative_to(base)}:{node.lineno} imports {n}" for n in names
                  if n == "loongforge_kernels" or n.startswith("loongforge_kernels.")]
    return found


def test_no_backend_module_imports_the_kernel_package():
    files = [f for src in BACKENDS for f in sorted(src.rglob("*.py"))]
    assert len(files) > 50  # NOTE: the scan saw the backends' sources
    offenders = [hit for f in files for hit in _kernel_imports(f)]
    assert offenders == [], "\n".join(offenders)


def test_the_scan_finds_imports_anywhere(tmp_path):
    """Function-level (lazy) imports count too; a name that merely starts alike does not."""
    f = tmp_path / "m.py"
    f.write_text("import loongforge_kernels_extra\n\ndef f():\n    from loongforge_kernels.fp8_linear import Fp8Linears\n"
                 "    import loongforge_kernels as lk\n")
    assert _kernel_imports(f, base=tmp_path) == ["m.py:4 imports loongforge_kernels.fp8_linear",
                                                 "m.py:5 imports loongforge_kernels"]


def test_no_environment_variable_selects_kernels():
    srcs = [f for f in (ROOT / "packages").glob("*/src/**/*.py")]
    assert [str(f.relative_to(ROOT)) for f in srcs if "LOONGFORGE_KERNELS" in f.read_text()] == []
