"""Which saved rank file a resuming rank reads: its own, a data-parallel replica's, or a clear refusal."""

from __future__ import annotations

import pytest
from loongforge.errors import CheckpointError
from loongforge_megatron.checkpointing import source_rank


def layout(**kw):
    """What a run writes now (with its layers per chunk: 4 layers here)."""
    base = {"world_size": 4, "tp": 2, "pp": 1, "vpp": 1, "cp": 1, "ep": 1, "etp": 2, "dp": 2, "distributed_optimizer": 0,
            "layers_per_chunk": [[4]]}
    return {**base, **kw}


def old_save(**kw):
    """What a run saved before uneven pipeline splits existed (no layers-per-chunk record: even split)."""
    out = layout(**kw)
    del out["layers_per_chunk"]
    return out


def coords(tp, dp):
    return {"tp": tp, "pp": 0, "cp": 0, "ep": 0, "etp": tp, "dp": dp}


# megatron's default order: tp fastest, then dp.
SAVED = {"layout": old_save(), "ranks": [coords(0, 0), coords(1, 0), coords(0, 1), coords(1, 1)]}


def test_same_layout_reads_own_file():
    assert source_rank(SAVED, layout=layout(), coords=coords(1, 1), rank=3) == 3


def test_smaller_dp_reads_the_replica_with_the_same_tp_rank():
    new = layout(world_size=2, dp=1)
    assert source_rank(SAVED, layout=new, coords=coords(0, 0), rank=0) == 0
    assert source_rank(SAVED, layout=new, coords=coords(1, 0), rank=1) == 1


def test_larger_dp_reads_dp_rank_zero():
    new = layout(world_size=8, dp=4)
    assert source_rank(SAVED, layout=new, coords=coords(1, 3), rank=7) == 1


def test_model_parallel_change_is_refused():
    with pytest.raises(CheckpointError, match="tp=2 but this run uses tp=1"):
        source_rank(SAVED, layout=layout(world_size=2, tp=1, etp=1, dp=2), coords=coords(0, 0), rank=0)


def test_distributed_optimizer_dp_change_is_refused():
    saved = {**SAVED, "layout": layout(distributed_optimizer=1)}
    with pytest.raises(CheckpointError, match="distributed optimizer"):
        source_rank(saved, layout=layout(world_size=2, dp=1, distributed_optimizer=1), coords=coords(0, 0), rank=0)


def test_pipeline_split_is_compared_by_layers_not_by_keys():
    ranks = [coords(0, 0), coords(1, 0), coords(0, 1), coords(1, 1)]
    pp2 = dict(world_size=8, pp=2)
    even = {"layout": old_save(**pp2), "ranks": ranks}
    # an old even save resumes under a run that states the same split explicitly (first_stage_layers=2 of 4)
    assert source_rank(even, layout=layout(**pp2, layers_per_chunk=[[2, 2]]), coords=coords(1, 1), rank=3) == 3
    with pytest.raises(CheckpointError, match=r"layers_per_chunk=\[\[2, 2\]\] but this run uses layers_per_chunk=\[\[1, 3\]\]"):
        source_rank(even, layout=layout(**pp2, layers_per_chunk=[[1, 3]]), coords=coords(1, 1), rank=3)
