"""megatron's ``MoELayer`` under expert parallelism with two additions, each a recipe value:

- **expert replicas** (``model.moe.replica_slots_per_rank: K``): ``K`` spare expert slots per EP rank serve copies of
  hot experts that a planner picks from live loads (``moe/replicas.py``); tokens are dispatched over slots, and
  the copies' weights and gradients travel as ``layers/expert_replicas.py`` says. The math is the model's own.
- **overlapped all-to-all** (``model.moe.overlap_a2a``): the layer's tokens, once routed, go through dispatch ->
  experts -> combine as two halves with two dispatchers, the second half's dispatch issued before the first half's
  expert GEMMs and the first half's combine before the second's GEMMs. On CUDA the communication runs on a side
  stream, so each all-to-all hides behind the other half's expert compute (forward, and in backward too: autograd
  runs an op's backward on the stream of its forward). Every token meets the same weights and the same reduction
  as on the plain path; on the CPU (gloo) the stream switches are no-ops and the split / reorder logic runs as is.

The routing (router, aux losses, expert bias) sees all the layer's tokens at once, as in megatron's layer.

NOTE: our own two-half schedule rather than megatron-core's combined 1F1B (``overlap_moe_expert_parallel_comm``):
that one refuses fp32 models (the CPU tests that check the overlap changes nothing are fp32) and full recompute,
and with pipeline parallelism needs virtual stages; the two halves need none of that.
"""

from __future__ import annotations

import contextlib
import copy
from types import SimpleNamespace
from typing import Any

import torch


def _megatron_bases():
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    return MoELayer, MoEAlltoAllTokenDispatcher


_MoELayer, _AlltoAll = _megatron_bases()


class _Streams:
    """A side stream for the all-to-alls on CUDA; plain calls elsewhere."""

    def __init__(self, device: torch.device):
        self.side = torch.cuda.Stream(device=device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def comm(self, *inputs: torch.Tensor):
        """Run the block on the side stream after what the main stream has queued (``inputs`` are kept alive for
        it); :meth:`join` before the main stream reads what it made."""
        if self.side is None:
            yield
            return
        main = torch.cuda.current_stream()
        self.side.wait_stream(main)
        for t in inputs:
            if isinstance(t, torch.Tensor):
                t.record_stream(self.side)
        with torch.cuda.stream(self.side):
            yield

    def join(self, *outputs: Any) -> None:
        if self.side is None:
            return
        main = torch.cuda.current_stream()
        main.wait_stream(self.side)
        for t in outputs:
            if isinstance(t, torch.Tensor):
                t.record_stream(main)


class EPMoELayer(_MoELayer):
    """``MoELayer`` with expert replicas and / or the overlapped all-to-all (see the module docstring)."""

    def __init__(self, *args: Any, replica_slots: int = 0, overlap_a2a: bool = False, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if self.config.moe_token_dispatcher_type != "alltoall":
            raise ValueError("expert replicas and the overlapped all-to-all run on megatron's alltoall dispatcher, "
                             f"not {self.config.moe_token_dispatcher_type}")
        if not hasattr(self.experts, "compute"):
            raise ValueError("expert replicas need grouped experts (kernels.moe_grouped_gemm)")
        old = self.token_dispatcher
        self._groups = SimpleNamespace(ep=old.ep_group, expt_tp=old.tp_group, tp_ep=old.tp_ep_group)
        self.ep_size, self.ep_rank = old.ep_size, old.ep_rank
        self.replica_slots, self.overlap_a2a = replica_slots, overlap_a2a
        self.slots = self.num_local_experts + replica_slots
        config = self.config
        if replica_slots:
            config = copy.copy(self.config)  # NOTE: the dispatcher routes over ep * slots "experts"
            config.num_moe_experts = self.ep_size * self.slots
        local = [self.ep_rank * self.slots + i for i in range(self.slots)]
        self._dispatchers = [_AlltoAll(self.slots, local, config=config, pg_collection=self._groups)
                             for _ in range(2 if overlap_a2a else 1)]
        self.token_dispatcher = self._dispatchers[0]
        if self.shared_expert_overlap:  # NOTE: megatron's dispatcher computes the shared experts during its comms
            if overlap_a2a:
                raise ValueError("moe_shared_expert_overlap and the overlapped all-to-all: use one of them")
            self.token_dispatcher.set_shared_experts(self.shared_experts)
        self._streams: _Streams | None = None
        self.routing = None  # SlotRouting of the current placement (moe/replicas.py sets it)
        self.replica = None  # ReplicaWeights of the current placement
        self.replica_tokens = torch.zeros(2, dtype=torch.float64)  # tokens on replica slots, all tokens (training)

    # ------------------------------------------------------------------ replicas
    def set_placement(self, slot_expert: Any, slot_share: Any) -> None:
        """Use one layer of a :class:`~loongforge_megatron.moe.placement.Placement` (``[ranks, slots]`` each)
        from the next forward on; the replicas' weights are fetched again."""
        from loongforge_megatron.layers.expert_replicas import ReplicaWeights, SlotRouting

        device = self.experts.weight1.device
        self.routing = SlotRouting.from_plan(slot_expert, slot_share, num_experts=self.config.num_moe_experts,
                                             device=device)
        self.replica = ReplicaWeights(slot_expert, home=self.num_local_experts, rank=self.ep_rank,
                                      group=self._groups.ep)

    def reduce_replica_grads(self) -> None:
        """Add the step's replica gradients into the home experts' (all EP ranks, after the backward)."""
        if self.replica is not None:
            self.replica.reduce_grads(self.experts.weight1, self.experts.weight2)

    # ------------------------------------------------------------------ forward
    def _experts(self, dispatcher: Any, hidden: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        x, per_slot, permuted_probs = dispatcher.dispatch_postprocess(hidden, probs)
        if not self.replica_slots:
            out, _ = self.experts(x, per_slot, permuted_probs)
            return dispatcher.combine_preprocess(out)
        home = self.num_local_experts
        w1, w2 = self.replica.wait()
        n_home = int(per_slot[:home].sum())
        if self.training:
            self.replica_tokens += torch.tensor([len(x) - n_home, len(x)], dtype=torch.float64)
        parts = []
        for rows, counts, weights in ((slice(0, n_home), per_slot[:home], (self.experts.weight1, self.experts.weight2)),
                                      (slice(n_home, len(x)), per_slot[home:], (w1, w2))):
            if rows.stop > rows.start:  # NOTE: grouped_mm refuses zero rows
                p = permuted_probs[rows] if permuted_probs is not None else None
                parts.append(self.experts.compute(x[rows], counts, p, weight1=weights[0], weight2=weights[1]))
        out = torch.cat(parts) if len(parts) > 1 else parts[0] if parts else x[:0]
        return dispatcher.combine_preprocess(out)

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors: Any = None,
                padding_mask: torch.Tensor | None = None):
        if intermediate_tensors is not None:
            raise ValueError("expert replicas / the overlapped all-to-all do not run partial CUDA-graph capture")
        if padding_mask is not None:
            padding_mask = padding_mask.transpose(0, 1).bool()

        def body(hidden_states: torch.Tensor, padding_mask: torch.Tensor | None):
            if self.replica_slots and self.replica.weights is None and self.replica._pending is None:
                # NOTE: once per step (weights change only at the optimizer step), while routing and dispatch run
                self.replica.start(self.experts.weight1, self.experts.weight2)
            shared = self.shared_experts_compute(hidden_states)
            probs, routing_map = self.route(hidden_states, padding_mask)
            if self.replica_slots:
                probs, routing_map = self.routing.apply(probs, routing_map)
            shape = hidden_states.shape
            tokens = hidden_states.reshape(-1, shape[-1])
            if self.overlap_a2a:
                out = self._overlapped(tokens, probs, routing_map)
            else:
                d = self._dispatchers[0]
                h, p = d.dispatch_preprocess(tokens, routing_map, probs)
                h, p = d.token_dispatch(h, p)
                out = d.combine_postprocess(d.token_combine(self._experts(d, h, p)))
            out = out.view(shape)
            if shared is not None:
                out = out + shared
            return out, None

        if self.moe_layer_recompute and self.training:
            from megatron.core import tensor_parallel

            return tensor_parallel.checkpoint(body, False, hidden_states, padding_mask)
        return body(hidden_states, padding_mask)

    def _overlapped(self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor) -> torch.Tensor:
        """Two halves of the tokens: dispatch B hides behind experts A, combine A behind experts B."""
        if self._streams is None:
            self._streams = _Streams(tokens.device)
        s = self._streams
        cut = (len(tokens) + 1) // 2
        halves = [(tokens[:cut], probs[:cut], routing_map[:cut]), (tokens[cut:], probs[cut:], routing_map[cut:])]
        da, db = self._dispatchers
        ha, pa = da.dispatch_preprocess(halves[0][0], halves[0][2], halves[0][1])
        ha, pa = da.token_dispatch(ha, pa)
        hb, pb = db.dispatch_preprocess(halves[1][0], halves[1][2], halves[1][1])
        with s.comm(hb, pb):
            hb, pb = db.token_dispatch(hb, pb)
        ya = self._experts(da, ha, pa)
        with s.comm(ya):
            za = da.token_combine(ya)
        s.join(hb, pb)
        yb = self._experts(db, hb, pb)
        zb = db.token_combine(yb)
        s.join(za)
        return torch.cat([da.combine_postprocess(za), db.combine_postprocess(zb)])


def with_ep_moe_layer(layer_spec: Any, *, replica_slots: int = 0, overlap_a2a: bool = False) -> Any:
    """``layer_spec`` with its ``MoELayer`` replaced by :class:`EPMoELayer` (a dense spec is unchanged)."""
    import dataclasses
    import functools

    mlp = layer_spec.submodules.mlp
    if not isinstance(mlp, functools.partial) or mlp.func is not _MoELayer:
        return layer_spec
    mlp = functools.partial(EPMoELayer, *mlp.args, **mlp.keywords, replica_slots=replica_slots,
                            overlap_a2a=overlap_a2a)
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(layer_spec.submodules, mlp=mlp))
