"""Plugin registries over Python entry points.

Groups: ``loongforge.backends``, ``loongforge.accelerators``, ``loongforge.kernels``, ``loongforge.commands``
(key: command name; value: ``module:register`` where ``register(subparsers) -> None`` adds its argparse subparser
and ``set_defaults(handler=fn)``, ``fn(args) -> int`` the exit code), and the megatron backend's
``loongforge.megatron.models`` (read by that backend; listed here so ``loongforge plugins`` shows it).
Entries load lazily (on first ``get``), a key declared by two distributions is rejected naming both, and a
plugin that fails to import is reported with its error instead of crashing unrelated commands.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from loongforge.errors import PluginError

GROUPS = (
    "loongforge.backends", "loongforge.accelerators", "loongforge.kernels", "loongforge.commands",
    "loongforge.megatron.models",
)

# Which distribution provides a well-known key, so a missing plugin gets an actionable message.
KNOWN_PROVIDERS = {
    ("loongforge.backends", "megatron"): "loongforge-megatron",
    ("loongforge.backends", "embodied"): "loongforge-embodied",
    ("loongforge.accelerators", "kunlun"): "loongforge-xpu",
    ("loongforge.kernels", "triton"): "loongforge-kernels",
    ("loongforge.kernels", "tilelang"): "loongforge-kernels",
}


def install_hint(package: str) -> str:
    """How to install one of the workspace's packages (not on PyPI yet: from a LoongForge checkout)."""
    return (f"pip install ./packages/{package} (from a LoongForge checkout; into its uv environment: "
            f"uv pip install ./packages/{package}, or `uv sync` for the whole workspace)")


@dataclass
class Entry:
    """One registered entry: where it comes from and, once loaded, the object or the load error."""

    group: str
    key: str
    value: str
    distribution: str
    builtin: bool = False
    obj: Any = None
    error: str | None = None
    loaded: bool = False


class Registry:
    """The entries of one entry-point group plus the built-ins core registers itself."""

    def __init__(self, group: str, builtins: dict[str, str] | None = None):
        self.group = group
        self._builtins = dict(builtins or {})
        self._entries: dict[str, Entry] | None = None
        self._duplicates: dict[str, list[str]] = {}

    def _scan(self) -> dict[str, Entry]:
        if self._entries is not None:
            return self._entries
        entries: dict[str, Entry] = {
            k: Entry(self.group, k, v, "loongforge-core", builtin=True) for k, v in self._builtins.items()
        }
        for ep in metadata.entry_points(group=self.group):
            dist = ep.dist.name if ep.dist is not None else "<unknown>"
            if ep.name in entries:
                if entries[ep.name].distribution == dist and entries[ep.name].value == ep.value:
                    continue  # the same distribution seen twice on sys.path
                self._duplicates.setdefault(ep.name, [entries[ep.name].distribution]).append(dist)
                continue
            entries[ep.name] = Entry(self.group, ep.name, ep.value, dist)
        self._entries = entries
        return entries

    def keys(self) -> list[str]:
        return sorted(self._scan())

    def entries(self) -> list[Entry]:
        """Every entry, loaded (so load errors are known); never raises for a broken plugin."""
        out = []
        for key in self.keys():
            entry = self._scan()[key]
            self._load(entry)
            out.append(entry)
        return out

    def distributions(self) -> set[str]:
        """The distributions that registered entries here (nothing is imported)."""
        return {e.distribution for e in self._scan().values()}

    def duplicates(self) -> dict[str, list[str]]:
        self._scan()
        return dict(self._duplicates)

    def _load(self, entry: Entry) -> None:
        if entry.loaded:
            return
        entry.loaded = True
        module_name, _, attr = entry.value.partition(":")
        try:
            import importlib

            obj: Any = importlib.import_module(module_name)
            for part in attr.split(".") if attr else []:
                obj = getattr(obj, part)
            entry.obj = obj
        except Exception as exc:  # a broken plugin must not crash unrelated commands
            entry.error = f"{type(exc).__name__}: {exc}".splitlines()[0]

    def get(self, key: str) -> Any:
        """Load and return the object registered under ``key``; raise :class:`PluginError` if impossible."""
        entries = self._scan()
        if key in self._duplicates:
            dists = " and ".join(self._duplicates[key])
            raise PluginError(f"{self.group} '{key}' is registered by more than one package: {dists}; uninstall one")
        if key not in entries:
            hint = KNOWN_PROVIDERS.get((self.group, key))
            if hint:
                raise PluginError(f"{self.group} '{key}' is not installed: {install_hint(hint)}")
            close = difflib.get_close_matches(key, entries, n=1)
            allowed = ", ".join(sorted(entries)) or "none installed"
            suggestion = f" (did you mean '{close[0]}'?)" if close else ""
            raise PluginError(f"unknown {self.group.split('.')[-1][:-1]} '{key}'{suggestion}; installed: {allowed}")
        entry = entries[key]
        self._load(entry)
        if entry.error:
            raise PluginError(f"{self.group} '{key}' from {entry.distribution} failed to load: {entry.error}")
        return entry.obj

    def __contains__(self, key: str) -> bool:
        return key in self._scan()

    def reset(self) -> None:
        """Forget what was scanned (tests install plugins at run time)."""
        self._entries = None
        self._duplicates = {}


backends = Registry("loongforge.backends")
accelerators = Registry(
    "loongforge.accelerators",
    builtins={"cpu": "loongforge.accelerator.cpu:CpuAccelerator", "cuda": "loongforge.accelerator.cuda:CudaAccelerator"},
)
kernels = Registry("loongforge.kernels")
commands = Registry("loongforge.commands")

megatron_models = Registry("loongforge.megatron.models")  # model families of the megatron backend
REGISTRIES = {r.group: r for r in (backends, accelerators, kernels, commands, megatron_models)}
