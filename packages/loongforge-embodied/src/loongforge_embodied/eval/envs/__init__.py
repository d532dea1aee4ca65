"""Simulators ``loongforge eval --env`` runs: a registry of environment adapters other packages can add to.

Ours live in :data:`ENVS` (name → ``"module:Class"``); another distribution adds one through the entry-point
group ``loongforge.embodied.envs`` (key = the ``--env`` name, value = ``module:Class``), e.g. in its pyproject::

    [project.entry-points."loongforge.embodied.envs"]
    myarm = "my_pkg.eval_env:MyArmAdapter"

A class follows :class:`~loongforge_embodied.eval.envs.base.EnvAdapter`. Classes are imported on first use only
(a simulator's import can take seconds), in the process that steps the environment.
"""

from __future__ import annotations

import importlib
from importlib import metadata

GROUP = "loongforge.embodied.envs"

ENVS: dict[str, str] = {
    "pusht": "loongforge_embodied.eval.envs.pusht:PushTAdapter",
    # NOTE: the extra loongforge-embodied[aloha] (gym-aloha, MuJoCo)
    "aloha": "loongforge_embodied.eval.envs.aloha:AlohaAdapter",
    "aloha_insertion": "loongforge_embodied.eval.envs.aloha:AlohaInsertionAdapter",
    # NOTE: the extra loongforge-embodied[metaworld] (MetaWorld, MuJoCo)
    "metaworld": "loongforge_embodied.eval.envs.metaworld:MetaWorldAdapter",
}


# What our simulators import, and the extra that brings it: checked before any worker starts.
REQUIRES: dict[str, tuple[str, str]] = {
    "aloha": ("gym_aloha", "loongforge-embodied[aloha]"),
    "aloha_insertion": ("gym_aloha", "loongforge-embodied[aloha]"),
    "metaworld": ("metaworld", "loongforge-embodied[metaworld]"),
}


def env_targets() -> dict[str, str]:
    """Every registered adapter: ours and those of installed distributions (name → ``module:Class``)."""
    from loongforge.errors import PluginError

    out = dict(ENVS)
    owner = dict.fromkeys(ENVS, "loongforge-embodied")
    for ep in metadata.entry_points(group=GROUP):
        dist = ep.dist.name if ep.dist is not None else "<unknown>"
        if ep.name in out and out[ep.name] != ep.value:
            raise PluginError(f"{GROUP} '{ep.name}' is registered by both {owner[ep.name]} and {dist}; uninstall one")
        out[ep.name], owner[ep.name] = ep.value, dist
    return out


def resolve_env(name: str) -> str:
    """``name`` → its ``module:Class`` (a ``module:Class`` passes through); a clear error for an unknown name."""
    if ":" in name:
        return name
    targets = env_targets()
    if name not in targets:
        from loongforge.errors import LoongForgeError

        raise LoongForgeError(f"unknown --env '{name}'; registered: {', '.join(sorted(targets))} (more through the "
                              f"entry-point group {GROUP})")
    if name in REQUIRES and targets[name] == ENVS.get(name):
        from loongforge.errors import require_module

        module, extra = REQUIRES[name]
        require_module(module, extra=extra, what=f"--env {name}")
    return targets[name]


def load_env(target: str):
    """Import the adapter class ``module:Class``."""
    module, _, attr = resolve_env(target).partition(":")
    return getattr(importlib.import_module(module), attr)
