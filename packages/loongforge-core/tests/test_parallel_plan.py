"""ParallelPlan arithmetic, exhaustively for world sizes 1-64."""

from __future__ import annotations

import itertools
import re

import pytest
from loongforge.errors import ParallelPlanError
from loongforge.parallel import resolve_plan

SIZES = (1, 2, 3, 4, 8)


def _expected_ok(world: int, tp: int, pp: int, cp: int, ep: int, etp: int, vpp: int, sp: bool) -> bool:
    mp = tp * pp * cp
    if world % mp:
        return False
    dp = world // mp
    if vpp > 1 and pp == 1:
        return False
    if sp and tp == 1:
        return False
    if world % (etp * ep * pp):
        return False
    return (tp * cp * dp) % (etp * ep) == 0


def test_exhaustive_world_sizes_1_to_64():
    checked = 0
    for world in range(1, 65):
        for tp, pp, cp, ep in itertools.product(SIZES, SIZES, (1, 2, 4), SIZES):
            for etp, vpp, sp in ((None, 1, False), (1, 1, False), (None, 2, False), (None, 1, True)):
                etp_eff = tp if etp is None else etp
                ok = _expected_ok(world, tp, pp, cp, ep, etp_eff, vpp, sp)
                checked += 1
                if ok:
                    plan = resolve_plan(world_size=world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, vpp=vpp, sp=sp)
                    assert plan.tp * plan.pp * plan.cp * plan.dp == world
                    assert plan.edp * plan.ep * plan.etp * plan.pp == world
                    assert plan.etp == etp_eff
                else:
                    with pytest.raises(ParallelPlanError):
                        resolve_plan(world_size=world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, vpp=vpp, sp=sp)
    assert checked == 64 * 5 * 5 * 3 * 5 * 4


def test_message_shows_arithmetic():
    with pytest.raises(ParallelPlanError, match=r"tp\*pp\*cp = 3\*2\*2 = 12 does not divide world size 8"):
        resolve_plan(world_size=8, tp=3, pp=2, cp=2)


def test_explicit_dp_must_match():
    assert resolve_plan(world_size=8, tp=2, dp=4).dp == 4
    with pytest.raises(ParallelPlanError, match=r"dp = 2 but world size 8 / \(tp\*pp\*cp = 2\) = 4"):
        resolve_plan(world_size=8, tp=2, dp=2)


def test_vpp_needs_pp_and_sp_needs_tp():
    with pytest.raises(ParallelPlanError, match="vpp = 2 needs pipeline"):
        resolve_plan(world_size=4, vpp=2)
    with pytest.raises(ParallelPlanError, match="sp = true needs tensor"):
        resolve_plan(world_size=4, sp=True)


def test_grad_accumulation_keeps_global_batch():
    for world in (1, 2, 4, 8):
        plan = resolve_plan(world_size=world)
        assert plan.grad_accumulation(global_batch_size=16, micro_batch_size=2) * 2 * plan.dp == 16
    with pytest.raises(ParallelPlanError, match="not divisible by train.micro_batch_size \\* dp = 4 \\* 2 = 8"):
        resolve_plan(world_size=2).grad_accumulation(global_batch_size=12, micro_batch_size=4)


def test_model_checks():
    plan = resolve_plan(world_size=8, tp=4, pp=2)
    plan.check_model(num_layers=16, num_attention_heads=32, num_query_groups=8)
    with pytest.raises(ParallelPlanError, match="2 query groups"):
        plan.check_model(num_layers=16, num_attention_heads=32, num_query_groups=2)
    with pytest.raises(ParallelPlanError, match="15 layers, not divisible by pp \\* vpp"):
        plan.check_model(num_layers=15, num_attention_heads=32)
    with pytest.raises(ParallelPlanError, match="need a MoE model"):
        resolve_plan(world_size=2, ep=2).check_model(num_layers=2, num_attention_heads=2)
    with pytest.raises(ParallelPlanError, match="not divisible by 2 \\* cp"):
        resolve_plan(world_size=2, cp=2).check_model(num_layers=2, num_attention_heads=2, seq_length=6)


def test_components_colocated_and_disjoint():
    plan = resolve_plan(world_size=8, tp=4, components={"vision": {"tp": 1}, "language": {"tp": 4, "pp": 2}})
    assert plan.component("vision").tp == 1 and plan.component("vision").dp == 8
    assert plan.component("language").dp == 1
    assert plan.component("projector") is plan
    plan = resolve_plan(world_size=8, components={"vision": {"num_ranks": 2}, "language": {"num_ranks": 6, "tp": 2}})
    assert plan.component("vision").world_size == 2 and plan.component("language").first_rank == 2
    assert plan.component("language").dp == 3
    with pytest.raises(ParallelPlanError, match="vision=2 \\+ language=4 = 6 != world size 8"):
        resolve_plan(world_size=8, components={"vision": {"num_ranks": 2}, "language": {"num_ranks": 4}})
    with pytest.raises(ParallelPlanError, match="components.vision: tp\\*pp\\*cp = 3"):
        resolve_plan(world_size=8, components={"vision": {"tp": 3}})


def test_a_component_can_run_outside_the_pipeline_schedule():
    plan = resolve_plan(world_size=4, tp=2, pp=2, components={"vision": {"tp": 1, "decoupled": True}})
    assert plan.component("vision").decoupled and plan.component("vision").pp == 2
    assert not resolve_plan(world_size=4, pp=2, components={"vision": {"tp": 1}}).component("vision").decoupled


def test_uneven_pipeline_split():
    from loongforge.parallel.layers import chunk_layer_counts, layer_ranges

    # DeepSeek-V3's 61 layers on 16 stages: 4 on the first, 1 on the last, 4 on each of the 14 middle stages
    counts = chunk_layer_counts(61, pp=16, first=4, last=1)
    assert counts == [[4] + [4] * 14 + [1]] and sum(counts[0]) == 61
    # only the first stage set: the other stages split the rest
    assert chunk_layer_counts(10, pp=4, first=1) == [[1, 3, 3, 3]]
    # with vpp every stage's layers split over its chunks; chunk (pp_rank, vpp_rank) takes layers in vpp-major order
    counts = chunk_layer_counts(12, pp=3, vpp=2, first=2, last=2)
    assert counts == [[1, 4, 1], [1, 4, 1]]
    ranges = layer_ranges(counts)
    assert ranges[(0, 0)] == range(0, 1) and ranges[(1, 0)] == range(1, 5) and ranges[(0, 1)] == range(6, 7)
    plan = resolve_plan(world_size=4, pp=4, first_stage_layers=1)
    plan.check_model(num_layers=10, num_attention_heads=4)


@pytest.mark.parametrize("kw,num_layers,match", [
    ({"pp": 1, "first_stage_layers": 2}, 8, "first_stage_layers = 2 needs pipeline parallelism"),
    ({"pp": 4, "first_stage_layers": 2}, 9, r"9 layers - first 2 - last 0 = 7 layers do not split evenly over 3"),
    ({"pp": 2, "first_stage_layers": 2, "last_stage_layers": 2}, 5, "must add up to the model's 5 layers"),
    ({"pp": 2, "first_stage_layers": 6}, 5, "exceed the model's 5 layers"),
    ({"pp": 2, "vpp": 2, "first_stage_layers": 3}, 7, "first_stage_layers = 3 is not divisible by vpp = 2"),
    ({"pp": 2}, 7, "give parallel.first_stage_layers / parallel.last_stage_layers for an uneven split"),
])
def test_uneven_pipeline_split_errors_name_the_key(kw, num_layers, match):
    with pytest.raises(ParallelPlanError, match=match):
        resolve_plan(world_size=kw["pp"], **kw).check_model(num_layers=num_layers, num_attention_heads=2)


@pytest.mark.parametrize(("layout", "components", "message"), [
    (dict(world_size=8, tp=4), {"vision": {"tp": 3}},
     r"^key 'parallel\.components\.vision\.tp': parallel\.components\.vision\.tp = 3 must divide parallel\.tp = 4 or "
     r"be a multiple of it \(4 % 3 = 1, 3 % 4 = 3\)"),
    (dict(world_size=12, tp=4), {"vision": {"tp": 6}}, r"vision\.tp = 6 must divide parallel\.tp = 4"),
    (dict(world_size=8, tp=2), {"vision": {"tp": 16}},
     r"parallel\.components\.vision: tp\*pp\*cp = 16\*1\*1 = 16 does not divide world size 8"),
    (dict(world_size=8, cp=4), {"vision": {"cp": 3}}, r"vision\.cp = 3 must divide parallel\.cp = 4"),
    (dict(world_size=8, pp=2), {"vision": {"pp": 3}},
     r"parallel\.components\.vision: tp\*pp\*cp = 1\*3\*1 = 3 does not divide world size 8"),
    (dict(world_size=4), {"vision": {"vpp": 2}}, r"parallel\.components\.vision\.vpp = 2 needs pipeline parallelism"),
    (dict(world_size=4, tp=2), {"vision": {"sp": True, "tp": 1}},
     r"parallel\.components\.vision\.sp = true needs tensor parallelism"),
    (dict(world_size=4, tp=2), {"vision": {"recompute": "some"}},
     r"parallel\.components\.vision\.recompute = 'some'; allowed: none, selective, full"),
    (dict(world_size=4, tp=2), {"vision": {"ep": 3}},
     r"parallel\.components\.vision: expert grid etp\*ep\*pp = 2\*3\*1 = 6 does not divide world size 4"),
    (dict(world_size=8), {"vision": {"tp": 0}}, r"parallel\.components\.vision\.tp must be a positive integer"),
    (dict(world_size=8), {"vision": {"dp": 2}}, r"parallel\.components\.vision\.dp is not a per-component key"),
    (dict(world_size=8), {"vision": {"num_ranks": 3, "tp": 2}, "language": {"num_ranks": 5}},
     r"vision: tp\*pp\*cp = 2\*1\*1 = 2 does not divide parallel\.components\.vision\.num_ranks = 3"),
    (dict(world_size=8), {"vision": {"num_ranks": 0}}, r"vision\.num_ranks must be a positive integer"),
    (dict(world_size=8), {"vision": {"num_ranks": 2}, "language": {"num_ranks": 4}},
     r"num_ranks vision=2 \+ language=4 = 6 != world size 8"),
    (dict(world_size=8), {"vision": {"num_ranks": 2}, "language": {"tp": 2}},
     r"either every component sets num_ranks or none does \(missing on \['language'\]\)"),
    (dict(world_size=8), {"vision": {"num_ranks": 4, "pp": 2, "vpp": 2}, "language": {"num_ranks": 4}},
     None),  # a disjoint grid may pipeline on its own
])
def test_impossible_component_layouts_are_refused_with_the_arithmetic(layout, components, message):
    """Each impossible per-component layout is one line naming the keys and the arithmetic, before any group."""
    if message is None:
        resolve_plan(**layout, components=components)
        return
    with pytest.raises(ParallelPlanError) as info:
        resolve_plan(**layout, components=components)
    assert "\n" not in str(info.value)
    assert re.search(message, str(info.value)), str(info.value)
