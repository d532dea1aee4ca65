"""A fresh venv holding only the packages a test names, as a user's "Install only what you need" line builds it.

Every third-party version is pinned to the workspace environment's, so uv takes each wheel from its cache (no
download, no resolution surprise). The venv is byte-compiled the cheap way: uv links the same cached files into
both environments, so the workspace's ``__pycache__`` entries are valid there too and are linked alongside instead of
compiling ~15k files again (Python still checks each one against its source's mtime and size, and recompiles a
stale one).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 540


def run(cmd: list, **kw) -> subprocess.CompletedProcess:
    """``cmd`` (paths allowed) with its output captured as text."""
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=TIMEOUT, **kw)


@dataclass(frozen=True)
class FreshVenv:
    """A venv at ``root`` and the pins its installs are held to."""

    root: Path
    pins: Path
    uv: str

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    @property
    def cli(self) -> Path:
        return self.root / "bin" / "loongforge"

    def install(self, *specs: str | Path) -> subprocess.CompletedProcess:
        """``uv pip install`` ``specs`` (workspace packages, ``pkg[extra]``) into this venv under the pins."""
        return self.install_line(" ".join(["uv pip install", *(str(s) for s in specs)]))

    def install_line(self, line: str) -> subprocess.CompletedProcess:
        """Run a documented ``uv pip install ...`` line from the checkout's root, into this venv under the pins,
        then link the workspace's bytecode for what it installed."""
        assert line.startswith("uv pip install "), line
        # NOTE: the workspace's `compile-bytecode = true` would byte-compile the whole venv (tens of seconds); the
        # flag wins over that setting (UV_COMPILE_BYTECODE=0 does not)
        cmd = line.replace("uv pip install", f"{self.uv} pip install -q --no-compile-bytecode --python {self.python} "
                           f"-c {self.pins}", 1)
        env = dict(os.environ)
        env.pop("VIRTUAL_ENV", None)
        proc = subprocess.run(["bash", "-c", cmd], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT)
        if proc.returncode == 0:
            _link_bytecode(_site_packages(self.python), Path(sysconfig.get_paths()["purelib"]))
        return proc

    def installed(self) -> set[str]:
        """Lower-case names of the distributions installed."""
        lines = run([self.uv, "pip", "freeze", "--python", self.python]).stdout.splitlines()
        return {ln.split("==")[0].split(" @ ")[0].strip().lower() for ln in lines if ln.strip()}


def fresh_venv(root: Path) -> FreshVenv:
    """An empty venv under ``root`` (skips without uv on PATH)."""
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not on PATH")
    root.mkdir(parents=True, exist_ok=True)
    frozen = run([uv, "pip", "freeze", "--python", sys.executable]).stdout.splitlines()
    pins = root / "pins.txt"
    pins.write_text("\n".join(ln for ln in frozen if "==" in ln and not ln.lower().startswith("loongforge")) + "\n")
    venv = root / "venv"
    made = run([uv, "venv", "-q", venv, "--python", sys.executable])
    assert made.returncode == 0, made.stderr[-2000:]
    return FreshVenv(root=venv, pins=pins, uv=uv)


def _site_packages(python: Path) -> Path:
    out = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    assert out.returncode == 0, out.stderr[-2000:]
    return Path(out.stdout.strip())


def _link_bytecode(site: Path, workspace_site: Path) -> None:
    """Hard-link (or copy) each ``__pycache__/*.pyc`` of ``workspace_site`` whose source is the same file (one inode,
    both linked from uv's cache; or the same size and mtime, copied from it) into the same place under ``site``."""
    for dirpath, dirnames, filenames in os.walk(site):
        if "__pycache__" in dirnames:
            dirnames.remove("__pycache__")
        rel = os.path.relpath(dirpath, site)
        cache = workspace_site / rel / "__pycache__"
        if not cache.is_dir():
            continue
        tag = f".{sys.implementation.cache_tag}.pyc"
        compiled = {name[: -len(tag)]: name for name in os.listdir(cache) if name.endswith(tag)}
        linked = False
        for name in filenames:
            if not name.endswith(".py") or name[:-3] not in compiled:
                continue
            try:
                ours, theirs = os.stat(os.path.join(dirpath, name)), os.stat(workspace_site / rel / name)
            except FileNotFoundError:
                continue
            if ours.st_ino != theirs.st_ino and (ours.st_size, ours.st_mtime_ns) != (theirs.st_size, theirs.st_mtime_ns):
                continue
            target = Path(dirpath) / "__pycache__"
            if not linked:
                target.mkdir(exist_ok=True)
                linked = True
            pyc = compiled[name[:-3]]
            try:
                os.link(cache / pyc, target / pyc)
            except FileExistsError:
                pass
            except OSError:
                shutil.copy2(cache / pyc, target / pyc)
