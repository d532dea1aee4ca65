"""Dynamic expert replicas: which expert goes into which spare slot of which EP rank, and how its tokens split.

Every EP rank holds its ``E / ranks`` home experts (megatron's contiguous blocks, never moved) and
``slots_per_rank - E / ranks`` spare slots. From recent per-layer expert loads a planner fills the spare slots with
replicas of hot experts and gives every copy of an expert a token share (the shares of one expert's copies sum to 1).

``plan`` (ours) is a topology-aware water-filling planner in three vectorised passes (all layers at once):

1. *Replica counts and places* (greedy, one spare slot per round): the expert with the largest per-copy load gets
   the next copy (the water-filling rule that also drives DeepSeek's EPLB), plus ``locality / nodes`` of its load
   while some node has no copy of it (what a copy there keeps off the inter-node links). The copy goes to the rank with a free
   slot that (a) sits on a node with no copy of that expert yet, then (b) has the least estimated load, a rank that
   held the expert in ``previous`` counting ``stickiness`` mean rank loads lighter (its weights need not move).
   (a) is what cuts cross-node traffic: with a copy on every node, a node's tokens for that expert never leave it.
2. *Token shares* by Sinkhorn-style matrix scaling of the expert x copy flow: alternately scale down every rank
   above the mean load and renormalise each expert's flow to its load. Fractional shares level ranks that equal
   splits (EPLB's) cannot, e.g. a home rank that also holds other busy experts gets a small share of its hot one.
   A floor keeps ``locality / nodes`` of an expert's tokens on every node that has a copy (that node's own demand),
   trading a little balance for cross-node traffic.
3. *Locality*: a token is served by a copy on its own node while that copy's share lasts (see ``traffic``); with
   two-level link costs (every inter-node link costs the same) this is the optimal transport of the tokens for
   the given shares.

Why a greedy + scaling rather than an exact OT + integer matching per step: the plan is remade every step from
noisy loads, so it must cost well under 1% of a step (about 20 ms of one CPU core at 256 experts x 64 ranks x 60
layers); the next step's imbalance is dominated by how loads drift, which ``loongforge moe simulate`` measures.
``plan_eplb`` is the baseline: EPLB's replication rule, greedy packing of the replicas onto the least-loaded
ranks regardless of nodes, equal shares. Replica-sync bytes (weights out, gradients back every step) do not
depend on the planner beyond where replicas sit; the simulator reports them apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from loongforge.errors import LoongForgeError


class PlacementError(LoongForgeError):
    """Loads, topology or slot budget a replica plan cannot be made for (the message says what is allowed)."""


@dataclass(frozen=True)
class Topology:
    """EP ranks laid out on nodes: ranks ``n * ranks_per_node .. (n + 1) * ranks_per_node - 1`` share node ``n``.
    Link costs weigh a token or weight byte sent between two ranks of one node / of two nodes."""

    ranks: int
    ranks_per_node: int
    intra_node_cost: float = 0.1
    inter_node_cost: float = 1.0

    def __post_init__(self) -> None:
        for name in ("ranks", "ranks_per_node"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1:
                raise PlacementError(f"topology.{name} must be a positive integer, got {v!r}")
        if self.ranks % self.ranks_per_node:
            raise PlacementError(f"topology: {self.ranks} ranks do not fill nodes of {self.ranks_per_node} ranks")
        for name in ("intra_node_cost", "inter_node_cost"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not np.isfinite(v) or v < 0:
                raise PlacementError(f"topology.{name} must be a finite number >= 0, got {v!r}")

    @property
    def nodes(self) -> int:
        return self.ranks // self.ranks_per_node

    def node_of(self) -> np.ndarray:
        """``[ranks]``: the node of every rank."""
        return np.arange(self.ranks) // self.ranks_per_node

    def rank_cost(self) -> np.ndarray:
        """``[ranks, ranks]``: the cost of one byte from rank a to rank b (0 on the same rank)."""
        node = self.node_of()
        cost = np.where(node[:, None] == node[None, :], self.intra_node_cost, self.inter_node_cost)
        np.fill_diagonal(cost, 0.0)
        return cost


@dataclass
class Placement:
    """A replica plan: ``slot_expert[layer, rank, slot]`` the expert in that slot (slots ``0 .. home_slots - 1`` hold
    the rank's home experts, the rest replicas) and ``slot_share[layer, rank, slot]`` the fraction of that expert's
    tokens the slot serves (an expert's shares sum to 1 over all its slots)."""

    slot_expert: np.ndarray
    slot_share: np.ndarray
    home_slots: int

    def replicas(self, layer: int) -> list[tuple[int, int, int, float]]:
        """``(expert, rank, slot, share)`` of every replica (spare-slot copy) of one layer."""
        ex, sh = self.slot_expert[layer], self.slot_share[layer]
        return [(int(ex[r, s]), r, s, float(sh[r, s])) for r in range(ex.shape[0])
                for s in range(self.home_slots, ex.shape[1])]

    def rank_loads(self, loads: np.ndarray) -> np.ndarray:
        """``[layers, ranks]``: the tokens each rank computes when experts see ``loads[layers, experts]``."""
        per_slot = self.slot_share * np.take_along_axis(loads, self.slot_expert.reshape(len(loads), -1), 1).reshape(
            self.slot_expert.shape)
        return per_slot.sum(2)


def validate(loads: object, topology: object, slots_per_rank: object) -> np.ndarray:
    """``loads`` as a float64 ``[layers, experts]`` array, or :class:`PlacementError` saying what is wrong."""
    if not isinstance(topology, Topology):
        raise PlacementError(f"topology must be a Topology(ranks=..., ranks_per_node=...), got {type(topology).__name__}")
    try:
        arr = np.asarray(loads, dtype=np.float64)
    except (TypeError, ValueError):
        raise PlacementError(f"loads must be numbers [layers, experts], got {type(loads).__name__}") from None
    if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 1:
        raise PlacementError(f"loads must be a [layers, experts] array of token counts, got shape {arr.shape}")
    if not np.isfinite(arr).all():
        raise PlacementError("loads must be finite token counts (found NaN or inf)")
    if (arr < 0).any():
        raise PlacementError(f"loads must be token counts >= 0 (found {arr.min():g})")
    experts, ranks = arr.shape[1], topology.ranks
    if experts % ranks:
        raise PlacementError(f"{experts} experts do not split over {ranks} EP ranks (each rank homes E / ranks)")
    if isinstance(slots_per_rank, bool) or not isinstance(slots_per_rank, int | np.integer):
        raise PlacementError(f"slots_per_rank must be an integer, got {slots_per_rank!r}")
    if not experts // ranks <= slots_per_rank <= experts:
        raise PlacementError(f"slots_per_rank = {slots_per_rank} for {experts} experts on {ranks} EP ranks: allowed "
                             f"{experts // ranks} (the home experts per rank) .. {experts} (one copy of each)")
    return arr


def _homes(layers: int, experts: int, ranks: int, slots: int) -> np.ndarray:
    """``slot_expert`` with the home experts in place and ``-1`` in the spare slots."""
    home = experts // ranks
    out = np.full((layers, ranks, slots), -1, dtype=np.int64)
    out[:, :, :home] = np.arange(experts).reshape(ranks, home)
    return out


def _replica_counts(loads: np.ndarray, spare: int) -> np.ndarray:
    """EPLB's water-filling: ``spare`` extra copies, each to the expert with the largest per-copy load."""
    layers, experts = loads.shape
    copies = np.ones((layers, experts))
    rows = np.arange(layers)
    for _ in range(spare):
        copies[rows, np.argmax(loads / copies, 1)] += 1
    return copies


def _pick(per_copy: np.ndarray, free: np.ndarray, held: np.ndarray) -> np.ndarray:
    """Per layer the expert with the largest ``per_copy`` that some rank with a free slot does not hold yet."""
    rows = np.arange(len(per_copy))
    e = np.argmax(per_copy, 1)
    stuck = ~((free > 0) & ~held[rows, e]).any(1)
    if stuck.any():
        per_copy = per_copy.copy()
        while stuck.any():
            per_copy[rows[stuck], e[stuck]] = -np.inf
            e = np.argmax(per_copy, 1)
            stuck = ~((free > 0) & ~held[rows, e]).any(1)
    return e


def _equal_shares(slot_expert: np.ndarray, experts: int) -> np.ndarray:
    layers = slot_expert.shape[0]
    flat = slot_expert.reshape(layers, -1) + np.arange(layers)[:, None] * experts
    count = np.bincount(flat.ravel(), minlength=layers * experts).reshape(layers, experts)
    return (1.0 / np.take_along_axis(count, slot_expert.reshape(layers, -1), 1)).reshape(slot_expert.shape)


def plan_eplb(loads: object, topology: Topology, slots_per_rank: int) -> Placement:
    """EPLB-style baseline (DeepSeek EPLB's replicate + balanced packing, homes fixed): replica counts by
    water-filling; replicas, busiest per-copy load first, to the least-loaded rank with a free slot that does not
    hold the expert yet; every copy gets an equal share. Nodes are ignored."""
    arr = validate(loads, topology, slots_per_rank)
    layers, experts = arr.shape
    ranks, home = topology.ranks, experts // topology.ranks
    spare = slots_per_rank - home
    copies = _replica_counts(arr, ranks * spare)
    per_copy = arr / copies
    slot_expert = _homes(layers, experts, ranks, slots_per_rank)
    rank_load = per_copy.reshape(layers, ranks, home).sum(2)
    free = np.full((layers, ranks), spare)
    held = np.zeros((layers, experts, ranks), dtype=bool)
    held[:, np.arange(experts), np.arange(experts) // home] = True
    # NOTE: one extra copy per round, the busiest per-copy load first (EPLB packs its items in that order); the
    # per-copy load of an item is fixed by the counts, so this is EPLB's sorted greedy packing
    left = copies - 1
    rows = np.arange(layers)
    for _ in range(ranks * spare):
        e = _pick(np.where(left > 0, per_copy, -1.0), free, held)
        score = np.where((free > 0) & ~held[rows, e], rank_load, np.inf)
        r = np.argmin(score, 1)
        slot_expert[rows, r, home + spare - free[rows, r]] = e
        free[rows, r] -= 1
        held[rows, e, r] = True
        rank_load[rows, r] += per_copy[rows, e]
        left[rows, e] -= 1
    return Placement(slot_expert, _equal_shares(slot_expert, experts), home)


def _place(arr: np.ndarray, topology: Topology, slots_per_rank: int, previous: Placement | None, *,
           stickiness: float, locality: float) -> np.ndarray:
    """Pass 1 of ``plan``: ``slot_expert`` with the spare slots filled (see the module docstring)."""
    layers, experts = arr.shape
    ranks, home = topology.ranks, experts // topology.ranks
    spare = slots_per_rank - home
    node = topology.node_of()
    rows = np.arange(layers)
    slot_expert = _homes(layers, experts, ranks, slots_per_rank)
    copies = np.ones((layers, experts))
    held = np.zeros((layers, experts, ranks), dtype=bool)
    held[:, np.arange(experts), np.arange(experts) // home] = True
    on_node = np.zeros((layers, experts, topology.nodes), dtype=bool)
    on_node[:, np.arange(experts), node[np.arange(experts) // home]] = True
    spread = np.ones((layers, experts))  # nodes with a copy
    rank_load = arr.reshape(layers, ranks, home).sum(2)  # estimated, equal shares
    free = np.full((layers, ranks), spare)
    mean = np.maximum(arr.sum(1) / ranks, 1e-12)[:, None]
    was = None
    if previous is not None and previous.slot_expert.shape == slot_expert.shape:
        was = previous.slot_expert[:, :, home:]  # [layers, ranks, spare]
    for _ in range(ranks * spare):
        # NOTE: a copy on a new node also keeps 1 / nodes of the expert's tokens on their node
        e = _pick(arr / copies + locality * arr / topology.nodes * (spread < topology.nodes), free, held)
        per_copy_now, per_copy_next = arr[rows, e] / copies[rows, e], arr[rows, e] / (copies[rows, e] + 1)
        # score in units of the mean rank load: a new node first, then keep last plan's slot, then the lightest rank
        score = rank_load / mean + 4.0 * on_node[rows, e][:, node]
        if was is not None:
            score -= stickiness * (was == e[:, None, None]).any(2)
        score = np.where((free > 0) & ~held[rows, e], score, np.inf)
        r = np.argmin(score, 1)
        rank_load -= held[rows, e] * (per_copy_now - per_copy_next)[:, None]
        rank_load[rows, r] += per_copy_next
        slot_expert[rows, r, home + spare - free[rows, r]] = e
        free[rows, r] -= 1
        held[rows, e, r] = True
        spread[rows, e] += ~on_node[rows, e, node[r]]
        on_node[rows, e, node[r]] = True
        copies[rows, e] += 1
    if was is not None:  # NOTE: a replica kept on its rank stays in its slot, so no weights move for it
        for k in range(spare):
            for j in range(spare):
                cur = slot_expert[:, :, home:]
                hit = (cur[:, :, j] == was[:, :, k]) & (cur[:, :, k] != was[:, :, k]) & (j != k)
                a, b = cur[:, :, k].copy(), cur[:, :, j].copy()
                cur[:, :, k] = np.where(hit, b, a)
                cur[:, :, j] = np.where(hit, a, b)
    return slot_expert


def _sinkhorn_shares(arr: np.ndarray, slot_expert: np.ndarray, topology: Topology, *, iterations: int,
                     locality: float) -> np.ndarray:
    """Pass 2 of ``plan``: per-slot shares that level the ranks (scale overloaded ranks down, renormalise experts),
    never taking a node's copies of an expert below ``locality / nodes`` of its tokens (that node's own demand)."""
    layers, experts = arr.shape
    ranks, slots = slot_expert.shape[1], slot_expert.shape[2]
    flat = slot_expert.reshape(layers, -1)
    index = (flat + np.arange(layers)[:, None] * experts).ravel()
    node_of_slot = np.repeat(topology.node_of(), slots)
    # copies of the slot's expert on the slot's node: the floor splits the node's demand over them
    key = index * topology.nodes + np.tile(node_of_slot, layers)
    counts = np.bincount(key, minlength=layers * experts * topology.nodes)
    floor = (locality / topology.nodes / counts[key]).reshape(layers, -1)
    share = _equal_shares(slot_expert, experts).reshape(layers, -1)
    load = np.take_along_axis(arr, flat, 1)
    mean = arr.sum(1, keepdims=True)[:, :, None] / ranks
    shape = (layers, ranks, slots)
    for _ in range(iterations):
        rank = (share * load).reshape(shape).sum(2, keepdims=True)
        scale = np.minimum(1.0, mean / np.maximum(rank, 1e-12))
        share = np.maximum((share.reshape(shape) * scale).reshape(layers, -1), floor)
        total = np.bincount(index, share.ravel(), minlength=layers * experts).reshape(layers, experts)
        share = share / np.take_along_axis(total, flat, 1)
    return share.reshape(slot_expert.shape)


def plan(loads: object, topology: Topology, slots_per_rank: int, *, previous: Placement | None = None,
         stickiness: float = 0.5, locality: float = 0.5, iterations: int = 20) -> Placement:
    """Replica placement and token shares for every layer from ``loads[layers, experts]`` (recent token counts per
    expert). ``slots_per_rank`` counts all expert slots of a rank, its ``experts / ranks`` home experts included.
    ``previous`` (the last plan) makes unchanged replicas stay where they are; ``stickiness`` is how much rank load
    (in units of the mean rank load) keeping a replica in place is worth; ``locality`` (0..1) weighs cross-node traffic
    against balance: how much a copy on a new node is worth, and how much of a node's own demand its copies of an
    expert keep when shares are levelled. See the module docstring for the method."""
    arr = validate(loads, topology, slots_per_rank)
    if not (0.0 <= locality <= 1.0 and stickiness >= 0 and iterations >= 1):
        raise PlacementError(f"plan: allowed locality 0..1, stickiness >= 0, iterations >= 1; got {locality}, "
                             f"{stickiness}, {iterations}")
    slot_expert = _place(arr, topology, slots_per_rank, previous, stickiness=stickiness, locality=locality)
    shares = _sinkhorn_shares(arr, slot_expert, topology, iterations=iterations, locality=locality)
    return Placement(slot_expert, shares, arr.shape[1] // topology.ranks)


def no_replicas(experts: int, topology: Topology, layers: int) -> Placement:
    """The plan without replicas: every expert only on its home rank (megatron's contiguous placement)."""
    home = experts // topology.ranks
    slot_expert = _homes(layers, experts, topology.ranks, home)
    return Placement(slot_expert, np.ones(slot_expert.shape), home)


def _local(placement: Placement, loads: np.ndarray, topology: Topology) -> np.ndarray:
    """``[layers, experts]`` tokens served on the node they come from (see ``traffic``)."""
    layers, experts = loads.shape
    nodes = topology.nodes
    idx = placement.slot_expert.reshape(layers, -1) + np.arange(layers)[:, None] * experts
    node_of_slot = np.repeat(topology.node_of(), placement.slot_expert.shape[2])
    # share of each expert held on each node: [layers, experts, nodes]
    held = np.zeros((layers * experts, nodes))
    np.add.at(held, (idx.ravel(), np.tile(node_of_slot, layers)), placement.slot_share.reshape(-1))
    return (np.minimum(held.reshape(layers, experts, nodes), 1.0 / nodes) * loads[:, :, None]).sum(2)


def cross_node_tokens(placement: Placement, loads: np.ndarray, topology: Topology) -> np.ndarray:
    """``[layers]`` tokens of one dispatch that cross nodes under ``placement`` (see ``traffic``)."""
    return (loads - _local(placement, loads, topology)).sum(1)


def traffic(placement: Placement, loads: np.ndarray, topology: Topology) -> np.ndarray:
    """``[layers]`` link-cost-weighted tokens of one dispatch under ``placement`` for ``loads[layers, experts]``.

    Every rank routes ``1 / ranks`` of every expert's tokens (data parallel batches). A node's tokens for an expert
    go to that expert's copies on the node while their shares last (intra-node cost, except the part a rank serves
    itself), the rest crosses nodes (inter-node cost)."""
    local = _local(placement, loads, topology)
    cross = loads - local
    # NOTE: of a node's local tokens, 1 / ranks_per_node start on the rank that serves them (no link at all)
    intra = local * (1 - 1 / topology.ranks_per_node)
    return (cross * topology.inter_node_cost + intra * topology.intra_node_cost).sum(1)


def migration(before: Placement | None, after: Placement, topology: Topology) -> np.ndarray:
    """``[layers]`` link-cost-weighted expert copies that move: spare slots whose expert changed, each copied from
    its home rank (no cost before the first plan: replicas are first filled at start-up)."""
    if before is None or before.slot_expert.shape != after.slot_expert.shape:
        return np.zeros(after.slot_expert.shape[0])
    home = after.home_slots
    new, old = after.slot_expert[:, :, home:], before.slot_expert[:, :, home:]
    return _copy_cost(new, topology, home=home, mask=new != old)


def replica_sync(placement: Placement, topology: Topology) -> np.ndarray:
    """``[layers]`` link-cost-weighted expert copies of a step's replica refresh: every replica's weights out from its
    home rank and its gradients back (the same for every plan with as many replicas, up to where they sit)."""
    home = placement.home_slots
    new = placement.slot_expert[:, :, home:]
    return 2 * _copy_cost(new, topology, home=home, mask=np.ones(new.shape, dtype=bool))


def _copy_cost(spare: np.ndarray, topology: Topology, *, home: int, mask: np.ndarray) -> np.ndarray:
    cost = topology.rank_cost()
    dst = np.broadcast_to(np.arange(topology.ranks)[None, :, None], spare.shape)
    return (cost[spare // home, dst] * mask).sum((1, 2))
