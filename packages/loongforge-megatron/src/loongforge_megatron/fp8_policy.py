"""``train.fp8.policy``: reading the policy file that ``loongforge fp8 profile`` writes, checked at validate.

A policy is ``{"gemms": {KEY: {"fwd": {"fp8_faster": bool, ...}, "dgrad": {...}, "wgrad": {...}, "name": ...}},
...}`` with KEY ``MxNxK`` (a linear's GEMM) or ``expertsE:MxNxK`` (a grouped expert projection). The file is read
as any JSON file a user hands us (``loongforge.bounded_json``): a regular file of bounded size and nesting; a file that
does not have this shape is refused in one line naming the entry, before any model is built.
"""

from __future__ import annotations

import re
from functools import partial
from pathlib import Path
from typing import Any

from loongforge.bounded_json import read_json
from loongforge.errors import RecipeError

KEY = "train.fp8.policy"
MAX_BYTES = 16 * 2**20  # NOTE: a profiled model has a few dozen distinct GEMM shapes: a few KiB
_GEMM_KEY = re.compile(r"(experts[1-9]\d*:)?[1-9]\d*x[1-9]\d*x[1-9]\d*")
_GEMMS = ("fwd", "dgrad", "wgrad")


def load_policy(path: str | Path) -> dict[str, Any]:
    """The policy of ``path`` (RecipeError naming the file and what is wrong otherwise)."""
    policy = read_json(path, error=partial(RecipeError, key=KEY), max_bytes=MAX_BYTES, what="policy file")
    hint = "write it with: loongforge fp8 profile RECIPE"
    if not isinstance(policy, dict) or not isinstance(policy.get("gemms"), dict):
        raise RecipeError(f"'{path}' is not a policy file of 'loongforge fp8 profile' (no 'gemms' mapping); {hint}",
                          key=KEY)
    for key, entry in policy["gemms"].items():
        where = f"'{path}': gemms entry '{str(key)[:60]}'"
        if not _GEMM_KEY.fullmatch(key):
            raise RecipeError(f"{where}: a key is MxNxK or expertsE:MxNxK (positive integers); {hint}", key=KEY)
        if not isinstance(entry, dict):
            raise RecipeError(f"{where}: an entry is a mapping of fwd / dgrad / wgrad; {hint}", key=KEY)
        for g in _GEMMS:
            flag = entry.get(g, {})
            if not isinstance(flag, dict) or not isinstance(flag.get("fp8_faster", False), bool):
                raise RecipeError(f"{where}: '{g}' must be a mapping with a boolean 'fp8_faster'; {hint}", key=KEY)
    return policy
