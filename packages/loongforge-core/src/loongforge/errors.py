"""User-facing errors.

Every error a user can cause (bad recipe, missing plugin, impossible parallel plan, bad checkpoint) is a
``LoongForgeError``. The CLI prints ``str(error)`` on one line and exits with code 2 — never a traceback.
"""

from __future__ import annotations


class LoongForgeError(Exception):
    """An error caused by user input; printed as one line by the CLI (exit code 2)."""


class RecipeError(LoongForgeError):
    """A recipe is malformed. ``key`` is the dotted key path, ``file`` the recipe file (if known)."""

    def __init__(self, message: str, *, key: str | None = None, file: str | None = None):
        self.key = key
        self.file = file
        self.message = message
        where = []
        if file:
            where.append(str(file))
        if key:
            where.append(f"key '{key}'")
        prefix = ": ".join(where)
        super().__init__(f"{prefix}: {message}" if prefix else message)


class PluginError(LoongForgeError):
    """A plugin (backend, accelerator, kernel provider, model) is missing or failed to load."""


class ParallelPlanError(LoongForgeError):
    """A parallel layout is impossible for the world size or the model; the message shows the arithmetic.
    ``key``: the recipe key at fault, when one is (shown first, as a :class:`RecipeError` shows it)."""

    def __init__(self, message: str, *, key: str | None = None):
        self.key, self.message = key, message
        super().__init__(f"key '{key}': {message}" if key else message)


class LaunchError(LoongForgeError):
    """A launched multi-process run failed; the CLI exits with the failing worker's code (``exit_code``: 2 for a
    worker's user error, 128 + N for a rank killed by signal N), so a scheduler can tell a crash from bad input."""

    def __init__(self, message: str, *, exit_code: int):
        self.exit_code = exit_code
        super().__init__(message)


class CheckpointError(LoongForgeError):
    """A checkpoint is missing, incomplete, or does not match the model."""


class NonFiniteError(LoongForgeError):
    """Training produced a NaN / inf loss, gradient norm or weight; the message names the step (and what to try).
    Raised by every rank together (the verdict is agreed across ranks: ``loongforge.failures``)."""


class PeerFailedError(LoongForgeError):
    """Another rank failed in a phase every rank passes together (``loongforge.failures.agree``); the message is
    that rank's (``rank``: the first rank that failed)."""

    def __init__(self, message: str, *, rank: int):
        self.rank = rank
        super().__init__(message)


class AdaptationError(LoongForgeError):
    """A device adaptation no longer matches the library it patches (e.g. after an upgrade)."""


class MissingDependencyError(LoongForgeError):
    """An optional dependency is not installed; the one line names the package extra that brings it."""

    def __init__(self, module: str, *, extra: str, what: str, install: str | None = None):
        self.module, self.extra = module, extra
        install = install or f"uv pip install './packages/{extra}'"
        super().__init__(f"{what} needs the Python module '{module}', which is not installed: install the extra "
                         f"{extra} (from a LoongForge checkout: {install})")


def require_module(module: str, *, extra: str, what: str, install: str | None = None) -> None:
    """Raise :class:`MissingDependencyError` unless ``module`` can be imported (checked without importing it);
    ``install``: the command to show when it is not the plain ``uv pip install './packages/EXTRA'``."""
    import importlib.util

    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # NOTE: a parent package that is itself missing
        found = False
    if not found:
        raise MissingDependencyError(module, extra=extra, what=what, install=install)
