"""The byte tokenizer of tiny_vla and groot (no tokenizer download): token 0 = pad, 1..256 = the UTF-8 bytes
of the task. A policy puts its own ids (e.g. tiny_vla's state bins) after ``TEXT_OFFSET + BYTE_VOCAB``."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

TEXT_OFFSET = 1
BYTE_VOCAB = 256


def encode_tasks(tasks: list[str], *, max_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """UTF-8 bytes → token ids (pad 0), truncated to ``max_tokens``; returns (ids, mask)."""
    # NOTE: torch is imported here, not at the top: the policies' configuration modules read the constants above and must
    # stay torch-free (validating a recipe imports no torch).
    import torch

    ids = torch.zeros(len(tasks), max_tokens, dtype=torch.long)
    for i, text in enumerate(tasks):
        raw = list(text.encode("utf-8"))[:max_tokens]
        ids[i, : len(raw)] = torch.tensor(raw, dtype=torch.long) + TEXT_OFFSET
    return ids, ids != 0
