"""The commands README.md and docs/*.md mark as runnable on a CPU do run, and the README's recipe table names recipes
that exist.

Marker: a fenced block whose info string is ``bash cpu`` (it renders as a plain ``bash`` block). Every line of such
a block is one command (a trailing ``# comment`` is allowed; no pipes, redirections or other shell syntax: each line
is split like a shell would and run without one). Convention for running them:

- ``uv run`` is stripped: the command runs with this test's interpreter (``python`` is ``sys.executable``) and with
  that interpreter's ``bin/`` first on ``PATH``, so ``loongforge`` is the workspace's;
- the working directory is the repository root, as in the README;
- a command that writes puts its output under ``runs/``: every argument starting with ``runs/`` is pointed at the
  test's ``tmp_path`` instead, so the checkout stays clean.

Mark only fast, self-contained commands: the whole file stays under about 30 s on a CPU. The quickstart is not
marked: ``tests/test_quickstart.py`` runs it.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```bash cpu[ \t]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
SHELL_SYNTAX = ("|", ">", "<", "&&", ";", "$(", "`")


def marked_commands(text: str) -> list[str]:
    """Each command line of each ``bash cpu`` block of a Markdown text, comments and blank lines dropped."""
    lines = []
    for block in BLOCK.findall(text):
        for line in block.splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def _cases() -> list:
    return [pytest.param(page, line, id=f"{page.relative_to(ROOT)}:{line}")
            for page in PAGES for line in marked_commands(page.read_text())]


def argv_for(line: str, *, tmp: Path) -> list[str]:
    """The argv a marked line runs as: ``uv run`` stripped, ``python`` this interpreter, ``runs/...`` under tmp."""
    argv = shlex.split(line)
    if argv[:2] == ["uv", "run"]:
        argv = argv[2:]
    if argv[0] == "python":
        argv[0] = sys.executable
    return [str(tmp / arg) if arg.startswith("runs/") else arg for arg in argv]


@pytest.mark.parametrize(("page", "line"), _cases())
def test_marked_command_runs(page, line, tmp_path):
    assert not any(s in line for s in SHELL_SYNTAX), f"{page.name}: a marked command is one plain command: {line}"
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(argv_for(line, tmp=tmp_path), cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, \
        f"{page.name}: `{line}` exited {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"


def test_the_readme_marks_commands_and_the_convention_holds(tmp_path):
    lines = marked_commands((ROOT / "README.md").read_text())
    assert lines, "README.md has no ```bash cpu block"
    assert all(line.startswith("uv run ") for line in lines), lines
    assert marked_commands("```bash cpu\nuv run loongforge plot runs/x  # a plot\n\n# note\n```\n```bash\nno\n```") \
        == ["uv run loongforge plot runs/x"]
    assert argv_for("uv run python -m m --output runs/a", tmp=tmp_path) == \
        [sys.executable, "-m", "m", "--output", str(tmp_path / "runs/a")]


def test_the_readme_recipe_table_names_existing_recipes():
    text = (ROOT / "README.md").read_text()
    table = text[text.index("## Recipe families"):text.index("## Install only what you need")]
    rows = [line for line in table.splitlines() if line.startswith("| ") and ".yaml" in line]
    named = [name for row in rows for name in re.findall(r"`([\w./-]+\.yaml)`", row)]
    assert len(rows) >= 4 and len(named) >= 12, named
    missing = [name for name in named if not (ROOT / "recipes" / name).is_file()]
    assert not missing, f"README.md's recipe table names recipes that do not exist: {missing}"


def test_relative_links_in_the_docs_resolve():
    broken = [(page.name, target) for page in PAGES
              for target in re.findall(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", page.read_text())
              if not (page.parent / target).exists()]
    assert not broken, broken
