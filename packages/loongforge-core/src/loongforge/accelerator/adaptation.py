"""Device adaptations: the door through which a backend is made to run on a non-CUDA device.

Libraries such as megatron-core assume CUDA in a handful of places. An :class:`Adaptation` is one named,
narrow change to such a library (usually replacing one attribute), together with a ``check`` that fails loudly
when the library no longer looks the way the adaptation expects (for example after an upgrade).

An :class:`AdaptationSet` applies a list of adaptations for the duration of a backend's run and undoes them
afterwards, so nothing is patched at import time and nothing leaks into other code. :func:`active` lists what
is applied in the process right now (a run's adaptations while it runs; nothing after).

Who provides adaptations: a backend package ships the ones it needs per device type (e.g. the megatron
backend's ``cpu`` list) and per model (LLaVA's CLIP norms, pi05's joint attention layer), and an accelerator plugin
may add its own through ``Accelerator.adaptations(backend)``. Every change a LoongForge package makes to another
library's objects goes through this door.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from loongforge.errors import AdaptationError

_MISSING = object()


@dataclass(frozen=True)
class Adaptation:
    """One named change to a library.

    ``apply`` performs the change and returns a zero-argument callable that undoes it. ``check`` raises
    :class:`AdaptationError` (or returns False) when the target no longer matches what the adaptation
    was written for; it runs before ``apply``.
    """

    name: str
    description: str
    apply: Callable[[], Callable[[], None]]
    check: Callable[[], bool] = field(default=lambda: True)


def resolve(dotted: str) -> tuple[Any, str]:
    """Split ``pkg.module.attr`` / ``pkg.module.Class.attr`` into (owner object, attribute name)."""
    parts = dotted.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            owner: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:-1]:
            owner = getattr(owner, name)
        return owner, parts[-1]
    raise AdaptationError(f"cannot import any module prefix of '{dotted}'")


def replace_attr(
    name: str,
    target: str,
    factory: Callable[[Any], Any],
    *,
    description: str,
    expect: Callable[[Any], bool] | None = None,
) -> Adaptation:
    """An adaptation that replaces ``target`` (a dotted attribute path) by ``factory(original)``.

    ``expect(original)`` verifies that the original still looks like what we patch (e.g. that its source
    still mentions ``torch.cuda``); if it returns False the adaptation fails loudly instead of silently
    patching something that has changed.
    """

    def check() -> bool:
        owner, attr = resolve(target)
        original = getattr(owner, attr, _MISSING)
        if original is _MISSING:
            raise AdaptationError(f"adaptation '{name}': {target} no longer exists")
        if expect is not None and not expect(original):
            raise AdaptationError(
                f"adaptation '{name}': {target} no longer matches what this adaptation expects; "
                "the library was probably upgraded — review the adaptation"
            )
        return True

    def apply() -> Callable[[], None]:
        owner, attr = resolve(target)
        original = getattr(owner, attr)
        # NOTE: an attribute a class inherits (torch.Tensor.type from its C base) is restored by deleting the
        # override, so the class's own namespace is exactly what it was
        own = attr in getattr(owner, "__dict__", {})
        setattr(owner, attr, factory(original))

        def undo() -> None:
            if own:
                setattr(owner, attr, original)
            else:
                delattr(owner, attr)

        return undo

    return Adaptation(name=name, description=description, apply=apply, check=check)


# name -> how many applied sets hold it now (this process). NOTE: a set entered while another holds the same
# adaptation (a job started inside a test's ``with``, a LLaVA run inside a CPU run) shares it instead of patching
# the patched object again; the last one out undoes it.
_ACTIVE: dict[str, int] = {}
_UNDO: dict[str, Callable[[], None]] = {}
_LOCK = threading.RLock()


def active() -> list[str]:
    """The names of the adaptations applied in this process right now, in the order they were applied."""
    with _LOCK:
        return list(_ACTIVE)


class AdaptationSet:
    """An ordered list of adaptations, applied together as a context manager and undone in reverse order.

    Adaptations already applied by an enclosing set (same name) are shared, not applied twice.
    """

    def __init__(self, adaptations: Sequence[Adaptation]):
        names = [a.name for a in adaptations]
        dupes = {n for n in names if names.count(n) > 1}
        if dupes:
            raise AdaptationError(f"duplicate adaptation names: {sorted(dupes)}")
        self.adaptations = list(adaptations)
        self._undo: list[Callable[[], None]] = []

    @property
    def names(self) -> list[str]:
        return [a.name for a in self.adaptations]

    def check(self) -> None:
        """Run every adaptation's check; raise :class:`AdaptationError` on the first that fails."""
        _check(self.adaptations)

    def __enter__(self) -> AdaptationSet:
        with _LOCK:
            _check([a for a in self.adaptations if a.name not in _ACTIVE])
            try:
                for a in self.adaptations:
                    if a.name not in _ACTIVE:
                        _UNDO[a.name] = a.apply()
                    _ACTIVE[a.name] = _ACTIVE.get(a.name, 0) + 1
                    self._undo.append(functools.partial(_release, a.name))
            except BaseException:
                self._exit_locked()
                raise
        return self

    def __exit__(self, *exc: object) -> None:
        with _LOCK:
            self._exit_locked()

    def _exit_locked(self) -> None:
        while self._undo:
            self._undo.pop()()


def _check(adaptations: Sequence[Adaptation]) -> None:
    for a in adaptations:
        if a.check() is False:
            raise AdaptationError(f"adaptation '{a.name}' does not match its target: {a.description}")


def _release(name: str) -> None:
    _ACTIVE[name] -= 1
    if _ACTIVE[name] == 0:
        del _ACTIVE[name]
        _UNDO.pop(name)()


@contextlib.contextmanager
def applied(adaptations: Sequence[Adaptation]) -> Iterator[AdaptationSet]:
    """Apply ``adaptations`` for the duration of the ``with`` block."""
    with AdaptationSet(adaptations) as s:
        yield s
