"""Which decoder layers each pipeline chunk holds: megatron-core's even split, or its uneven first/last-stage split.

megatron-core (``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage``, Megatron-LM's
``--decoder-first/last-pipeline-num-layers``) gives the first and/or last stage a set number of layers and splits
the rest evenly over the middle stages; with ``vpp`` chunks every stage's layers are split evenly over its chunks.
Chunks are numbered ``vpp_rank * pp + pp_rank`` and hold consecutive global layers in that order, so the stages
take chunks in interleaved order. This module reproduces that rule without importing megatron (the megatron
backend's tests check it against ``get_transformer_layer_offset`` / ``get_num_layers_to_build``).
"""

from __future__ import annotations

from loongforge.errors import ParallelPlanError


def chunk_layer_counts(
    num_layers: int, *, pp: int = 1, vpp: int = 1, first: int | None = None, last: int | None = None,
    prefix: str = "parallel",
) -> list[list[int]]:
    """Layers per chunk, ``counts[vpp_rank][pp_rank]``. Raises :class:`ParallelPlanError` naming the keys."""
    for key, value in (("first_stage_layers", first), ("last_stage_layers", last)):
        if value is None:
            continue
        if pp == 1:
            raise ParallelPlanError(f"{prefix}.{key} = {value} needs pipeline parallelism (pp > 1, got pp = 1)")
        if not isinstance(value, int) or value < 1:
            raise ParallelPlanError(f"{prefix}.{key} must be a positive integer (got {value!r})")
        if value % vpp:
            raise ParallelPlanError(f"{prefix}.{key} = {value} is not divisible by vpp = {vpp} (chunks per stage)")
    if first is None and last is None:
        chunks = pp * vpp
        if num_layers % chunks:
            hint = (f"{prefix}.first_stage_layers / {prefix}.last_stage_layers" if prefix != "layout" else
                    "first_stage_layers / last_stage_layers (convert: --first-stage-layers / --last-stage-layers)")
            raise ParallelPlanError(
                f"model has {num_layers} layers, not divisible by pp * vpp = {pp} * {vpp} = {chunks}; give {hint} "
                "for an uneven split"
            )
        return [[num_layers // chunks] * pp for _ in range(vpp)]
    middle_stages = pp - (first is not None) - (last is not None)
    middle = num_layers - (first or 0) - (last or 0)
    split = f"{num_layers} layers - first {first or 0} - last {last or 0} = {middle}"
    if middle < 0:
        raise ParallelPlanError(f"{prefix}: first_stage_layers + last_stage_layers exceed the model's {num_layers} layers")
    if middle_stages == 0 and vpp > 1:
        # NOTE: megatron-core 0.19's interleaved offset divides by the number of middle stages.
        raise ParallelPlanError(
            f"{prefix}: with pp = {pp} and vpp = {vpp} set only one of first_stage_layers / last_stage_layers "
            "(the other stage takes the rest); megatron-core cannot place layers with no middle stage and vpp > 1"
        )
    if middle_stages == 0 and middle:
        raise ParallelPlanError(
            f"{prefix}: pp = {pp} with both first_stage_layers and last_stage_layers set leaves no middle stage, so "
            f"they must add up to the model's {num_layers} layers ({split} left over)"
        )
    if middle_stages and (middle == 0 or middle % (middle_stages * vpp)):
        raise ParallelPlanError(
            f"{prefix}: {split} layers do not split evenly over {middle_stages} middle stage(s) x vpp = {vpp} "
            f"chunks (and every stage needs at least one layer)"
        )
    per_middle = middle // (middle_stages * vpp) if middle_stages else 0
    row = [per_middle] * pp
    if first is not None:
        row[0] = first // vpp
    if last is not None:
        row[-1] = last // vpp
    return [list(row) for _ in range(vpp)]


def layer_ranges(counts: list[list[int]]) -> dict[tuple[int, int], range]:
    """``(pp_rank, vpp_rank) -> range`` of global layers, from :func:`chunk_layer_counts`."""
    out, start = {}, 0
    for vpp_rank, row in enumerate(counts):
        for pp_rank, n in enumerate(row):
            out[(pp_rank, vpp_rank)] = range(start, start + n)
            start += n
    return out
