"""Kunlun's environment tuning (``XMLIR_*`` for torch_xmlir, ``BKCL_*`` for the collective library) as recipe settings.

A recipe sets them under ``accelerator.env``; they are validated when the accelerator is created and exported
before ``torch_xmlir`` is imported (it reads them at import time). Precedence: recipe > the process environment >
the defaults below.

Validation catches what is certainly wrong: a lower-case name (environment names are case-sensitive), a name one
typo away from a known one, or a bad value for a known flag. Other ``XMLIR_*`` / ``BKCL_*`` names pass through
(the runtimes read many more than we list); list a name under ``accelerator.options.unchecked_env`` to pass it
even when it looks like a typo. Sources for every entry: README.md.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

PREFIXES = ("XMLIR_", "BKCL_")


@dataclass(frozen=True)
class EnvVar:
    """A known variable: ``kind`` is ``flag`` (0/1), ``bool`` (true/false/1/0), ``int`` or ``str``."""

    kind: str
    doc: str
    default: str | None = None


KNOWN: dict[str, EnvVar] = {
    # torch_xmlir (XMLIR)
    "XMLIR_F_XPU_ENABLED_BOOL": EnvVar("bool", "run torch ops on the XPU", default="true"),
    "XMLIR_TORCH_XCCL_ENABLED": EnvVar("bool", "torch.distributed collectives through BKCL", default="true"),
    "XMLIR_D_XPU_L3_SIZE": EnvVar("int", "bytes of on-chip L3 given to torch_xmlir"),
    "XMLIR_D_FORCE_FALLBACK_STR": EnvVar("str", "comma-separated aten ops forced to run on the CPU"),
    "XMLIR_CUDNN_ENABLED": EnvVar("flag", "the cuDNN-compatible optimised path"),
    "XMLIR_FORCE_USE_XPU_GRAPH": EnvVar("flag", "XPU graph capture in place of CUDA graphs"),
    "XMLIR_ENABLE_MOCK_TORCH_COMPILE": EnvVar("bool", "torch.compile becomes a no-op decorator"),
    "XMLIR_ENABLE_NEW_PG": EnvVar("bool", "BKCL process group: new 'kccl' (1) or legacy 'bccl' (0)"),
    "XMLIR_ENABLE_LINEAR_FC_FUSION": EnvVar("flag", "nn.Linear replaced by the fused XPU FC"),
    "XMLIR_USE_HYDRA_LINEAR": EnvVar("flag", "the hydra fast-FC path for nn.Linear"),
    "XMLIR_ENABLE_FAST_FC": EnvVar("flag", "bf16 fast FC (master switch)"),
    "XMLIR_ENABLE_FAST_FC_FWD_OUT": EnvVar("flag", "bf16 fast FC, forward output"),
    "XMLIR_ENABLE_FAST_FC_BWD_DW": EnvVar("flag", "bf16 fast FC, weight gradient"),
    "XMLIR_ENABLE_FAST_FC_BWD_DX": EnvVar("flag", "bf16 fast FC, input gradient"),
    "XMLIR_DIST_DISABLE_ASYNC_ISEND_IRECV": EnvVar("flag", "serial, non-coalesced batch_isend_irecv"),
    "XMLIR_DISABLE_CUDA_ALLOCATOR": EnvVar("flag", "bypass the CUDA-compatible caching allocator"),
    "XMLIR_FA_ACCUM_TYPE": EnvVar("str", "flash-attention softmax accumulation dtype (float / float16)"),
    # BKCL (collectives)
    "BKCL_PCIE_RING": EnvVar("flag", "ring all-reduce over PCIe"),
    "BKCL_CCIX_RING": EnvVar("flag", "ring all-reduce over CCIX links"),
    "BKCL_RING_ALL_REDUCE": EnvVar("flag", "ring all-reduce algorithm"),
    "BKCL_FORCE_SYNC": EnvVar("flag", "synchronous collectives (debugging)"),
    "BKCL_ENABLE_XDR": EnvVar("flag", "cross-node transport through XDR"),
    "BKCL_RDMA_NICS": EnvVar("str", "comma-separated RDMA NICs, one per device"),
    "BKCL_RDMA_VERBS": EnvVar("flag", "RDMA verbs transport"),
    "BKCL_TRACE_TOPO": EnvVar("flag", "log the detected topology"),
}

DEFAULTS: dict[str, str] = {k: v.default for k, v in KNOWN.items() if v.default is not None}

_NAME = re.compile(r"^[A-Z][A-Z0-9_]*$")
_BOOLS = {"true", "false", "1", "0"}


def _error(name: str, message: str) -> Exception:
    from loongforge.errors import RecipeError

    return RecipeError(message, key=f"accelerator.env.{name}")


def _check_value(name: str, value: str) -> None:
    kind = KNOWN[name].kind
    if kind == "flag" and value not in ("0", "1"):
        raise _error(name, f"expected 0 or 1, got '{value}'")
    if kind == "bool" and value.lower() not in _BOOLS:
        raise _error(name, f"expected true or false, got '{value}'")
    if kind == "int" and not value.isdigit():
        raise _error(name, f"expected a non-negative integer, got '{value}'")


def validate_env(env: Mapping[str, str], *, unchecked: Iterable[str] = ()) -> None:
    """Raise ``RecipeError`` (naming ``accelerator.env.NAME``) for a variable that is certainly wrong."""
    skip = set(unchecked)
    for name, value in env.items():
        if name in skip:
            continue
        upper = name.upper()
        if upper.startswith(PREFIXES) and not _NAME.match(name):
            hint = f"'{upper}'" if _NAME.match(upper) else "upper-case letters, digits and '_'"
            raise _error(name, f"environment variable names are case-sensitive; use {hint}")
        if name in KNOWN:
            _check_value(name, str(value))
            continue
        if not name.startswith(PREFIXES):
            continue  # other variables are the user's business
        close = difflib.get_close_matches(name, KNOWN, n=1, cutoff=0.9)
        if close:
            raise _error(name, f"unknown Kunlun variable (did you mean '{close[0]}'?); if it is right, "
                               f"add it to accelerator.options.unchecked_env")


def effective_env(env: Mapping[str, str], *, current: Mapping[str, str]) -> dict[str, str]:
    """What to export: the defaults not already set in ``current`` (the process environment), then ``env``."""
    out = {k: v for k, v in DEFAULTS.items() if k not in current}
    out.update(env)
    return out


def describe() -> str:
    """A Markdown table of the known variables (kept in sync with README.md by a test)."""
    rows = ["| variable | kind | default | what it does |", "|---|---|---|---|"]
    rows += [f"| `{k}` | {v.kind} | {v.default or ''} | {v.doc} |" for k, v in KNOWN.items()]
    return "\n".join(rows)
