"""Expert replicas of one MoE layer under expert parallelism: which slot serves each routed token, and the
replicas' weights fetched from their home ranks with their gradients sent back.

Every EP rank has ``S = E / ep + K`` expert slots: its home experts, then ``K`` spare slots that hold copies of
other ranks' experts (a :class:`~loongforge_megatron.moe.placement.Placement` says which, and each copy's share of
its expert's tokens). The dispatcher then routes over ``ep * S`` *slots* instead of ``E`` experts: global slot
``r * S + s`` is slot ``s`` of rank ``r``.

- :class:`SlotRouting` turns a router's ``[tokens, E]`` routing map and probabilities into ``[tokens, ep * S]``
  ones: the ``i``-th of this rank's ``n`` tokens for expert ``e`` goes to the copy whose cumulative share interval
  holds ``(i + 0.5) / n``, so a copy with share 0.3 gets about 30% of them (every rank splits its own tokens).
- :class:`ReplicaWeights` copies the replicas' weights from their home ranks (one all-to-all over the EP group,
  started early so it runs while the tokens are routed and dispatched) into leaf tensors the replica GEMMs use;
  after the step's backward, :meth:`ReplicaWeights.reduce_grads` sends the replicas' accumulated gradients back
  and adds them to the home experts' gradients, before the data-parallel reduction and the optimizer. The model's
  math is unchanged: a token computed on a copy sees the same weights, and the home expert's gradient is the same
  sum over its tokens.

NOTE: the gradients go back once per step, in module order, outside autograd: a collective inside the backward
graph would run at a point that depends on which GEMMs had tokens on each rank, and gloo / NCCL need every rank to
issue the EP collectives in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist


@dataclass
class SlotRouting:
    """One layer's expert -> copies table: ``copy_slot[e, m]`` the global slot of copy ``m`` of expert ``e`` and
    ``copy_end[e, m]`` the end of its cumulative share interval (``inf`` for the last copy and the padding)."""

    copy_slot: torch.Tensor
    copy_end: torch.Tensor
    num_slots: int

    @classmethod
    def from_plan(cls, slot_expert: np.ndarray, slot_share: np.ndarray, *, num_experts: int,
                  device: torch.device) -> SlotRouting:
        """From one layer of a placement (``slot_expert`` / ``slot_share`` ``[ranks, slots]``)."""
        ranks, slots = slot_expert.shape
        copies: list[list[tuple[int, float]]] = [[] for _ in range(num_experts)]
        for r in range(ranks):
            for s in range(slots):
                e = int(slot_expert[r, s])
                if e >= 0:  # NOTE: a copy with share 0 gets an empty interval: no tokens
                    copies[e].append((r * slots + s, float(slot_share[r, s])))
        width = max(len(c) for c in copies)
        slot = np.zeros((num_experts, width), dtype=np.int64)
        end = np.full((num_experts, width), np.inf)
        for e, c in enumerate(copies):
            total = sum(sh for _, sh in c) or 1.0
            acc = 0.0
            for m, (g, sh) in enumerate(c):
                acc += sh / total
                slot[e, m] = g
                if m < len(c) - 1:
                    end[e, m] = acc
            slot[e, len(c):] = c[-1][0]
        return cls(torch.from_numpy(slot).to(device), torch.from_numpy(end).to(device), ranks * slots)

    def apply(self, probs: torch.Tensor, routing_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(probs, routing_map)`` over slots ``[tokens, ep * S]`` for the router's ``[tokens, E]`` ones."""
        tokens = routing_map.shape[0]
        routed = routing_map.to(torch.int64)
        position = routed.cumsum(0) - 1
        count = routed.sum(0).clamp(min=1)
        frac = (position.to(torch.float64) + 0.5) / count
        copy = (frac.unsqueeze(-1) >= self.copy_end.unsqueeze(0)).sum(-1)  # [tokens, E]
        slot = self.copy_slot.unsqueeze(0).expand(tokens, -1, -1).gather(2, copy.unsqueeze(-1)).squeeze(-1)
        # NOTE: experts a token is not routed to write into one extra column, dropped after
        slot = torch.where(routing_map, slot, self.num_slots)
        slot_map = torch.zeros(tokens, self.num_slots + 1, dtype=torch.bool, device=slot.device)
        slot_map.scatter_(1, slot, routing_map)
        slot_probs = torch.zeros(tokens, self.num_slots + 1, dtype=probs.dtype, device=probs.device)
        slot_probs = slot_probs.scatter(1, slot, probs * routing_map)
        return slot_probs[:, :self.num_slots], slot_map[:, :self.num_slots]


class ReplicaWeights:
    """The weights of one layer's ``K`` replica slots on this rank, fetched from their home ranks (see module doc).

    ``slot_expert``: this layer's ``[ranks, S]`` placement; ``home``: experts per rank (``E / ep``)."""

    def __init__(self, slot_expert: np.ndarray, *, home: int, rank: int, group: Any):
        ranks, slots = slot_expert.shape
        self.group, self.home, self.spare = group, home, slots - home
        spare = slot_expert[:, home:]
        mine = spare[rank]
        # receive: from every source rank (in rank order) its experts in my spare slots, in slot order
        order = [k for src in range(ranks) for k in range(self.spare) if mine[k] >= 0 and mine[k] // home == src]
        self.recv_splits = [sum(1 for k in range(self.spare) if mine[k] >= 0 and mine[k] // home == src)
                            for src in range(ranks)]
        self.recv_slot = torch.tensor(order, dtype=torch.long)  # row i of the received block -> spare slot
        # send: to every destination rank my home experts in its spare slots, in its slot order
        send = [[int(e) % home for e in spare[dst] if e >= 0 and e // home == rank] for dst in range(ranks)]
        self.send_splits = [len(s) for s in send]
        self.send_local = torch.tensor([i for s in send for i in s], dtype=torch.long)
        self.weights: tuple[torch.Tensor, torch.Tensor] | None = None
        self._pending: tuple[Any, torch.Tensor, torch.Size, torch.Size] | None = None

    def start(self, weight1: torch.Tensor, weight2: torch.Tensor) -> None:
        """Start copying the replicas' weights from their home ranks (asynchronous where the backend allows)."""
        with torch.no_grad():
            idx = self.send_local.to(weight1.device)
            send = torch.cat([weight1[idx].flatten(1), weight2[idx].flatten(1)], 1).contiguous()
            recv = send.new_empty(sum(self.recv_splits), send.shape[1])
            handle = dist.all_to_all_single(recv, send, output_split_sizes=self.recv_splits,
                                            input_split_sizes=self.send_splits, group=self.group, async_op=True)
        self._pending = (handle, recv, weight1.shape[1:], weight2.shape[1:])
        self._trained = weight1.requires_grad  # NOTE: frozen experts (LoRA) get no replica gradients either
        self._keep = send  # NOTE: the send buffer lives until the copy is done

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The replicas' ``(weight1, weight2)`` ``[K, ...]``: leaf tensors whose gradients accumulate over the
        step's micro-batches (for :meth:`reduce_grads`)."""
        if self._pending is not None:
            handle, recv, shape1, shape2 = self._pending
            handle.wait()
            self._pending = self._keep = None
            rows = recv.new_zeros(self.spare, recv.shape[1])
            rows[self.recv_slot.to(recv.device)] = recv
            split = shape1.numel()
            w1 = rows[:, :split].reshape(self.spare, *shape1).requires_grad_(self._trained)
            w2 = rows[:, split:].reshape(self.spare, *shape2).contiguous().requires_grad_(self._trained)
            self.weights = (w1, w2)
        return self.weights

    def reduce_grads(self, weight1: torch.nn.Parameter, weight2: torch.nn.Parameter) -> None:
        """Send the replicas' gradients back to their home ranks and add them to the home experts' gradients
        (``main_grad`` under megatron's DDP, else ``grad``); every EP rank calls it, also without replicas' grads.
        The next forward fetches the (updated) weights again."""
        w = self.weights
        self.weights = None
        if not weight1.requires_grad:  # the same on every rank: no collective anywhere
            return
        dtype, device = weight1.dtype, weight1.device
        split = weight1[0].numel()
        width = split + weight2[0].numel()
        rows = torch.zeros(self.spare, width, dtype=torch.float32, device=device)
        if w is not None:
            for part, cols in ((w[0], slice(0, split)), (w[1], slice(split, width))):
                if part.grad is not None:
                    rows[:, cols] = part.grad.flatten(1).float()
        send = rows[self.recv_slot.to(device)].contiguous()
        back = torch.empty(sum(self.send_splits), width, dtype=torch.float32, device=device)
        dist.all_to_all_single(back, send, output_split_sizes=self.send_splits, input_split_sizes=self.recv_splits,
                               group=self.group)
        if not len(back):
            return
        idx = self.send_local.to(device)
        for param, cols in ((weight1, slice(0, split)), (weight2, slice(split, width))):
            grad = back[:, cols].reshape(len(back), *param.shape[1:])
            target = getattr(param, "main_grad", None)
            if target is None:
                if param.grad is None:
                    param.grad = torch.zeros_like(param, dtype=dtype)
                target = param.grad
            target.index_add_(0, idx, grad.to(target.dtype))
