"""Backend-neutral checkpoint primitives: streaming safetensors I/O, typed sharding rules, wildcard name maps,
atomic checkpoint directories. Backends build their conversions and resume checkpoints on these."""

from __future__ import annotations

from loongforge.checkpoint.atomic import (
    apply_retention,
    atomic_checkpoint,
    complete_checkpoints,
    latest_checkpoint,
    require_complete,
)
from loongforge.checkpoint.compare import check_shapes
from loongforge.checkpoint.mapping import (
    ColumnParallel,
    Copies,
    Expert,
    FusedExperts,
    FusedQKV,
    GatedMLP,
    Replicated,
    Reshaped,
    RowParallel,
    Rule,
    Shared,
    VocabParallel,
    padded_vocab_size,
)
from loongforge.checkpoint.name_map import Entry, NameMap, Param, PipelineLayout, Placement
from loongforge.checkpoint.safetensors_io import (
    SafetensorsReader,
    ShardedSafetensorsWriter,
    StreamingSafetensorsFile,
)

__all__ = [
    "ColumnParallel", "Copies", "Entry", "Expert", "FusedExperts", "FusedQKV", "GatedMLP", "NameMap", "Param", "PipelineLayout",
    "Placement", "Replicated", "Reshaped", "RowParallel", "Rule", "SafetensorsReader", "Shared", "ShardedSafetensorsWriter",
    "StreamingSafetensorsFile", "VocabParallel", "apply_retention", "atomic_checkpoint", "check_shapes",
    "complete_checkpoints", "latest_checkpoint", "padded_vocab_size", "require_complete",
]
